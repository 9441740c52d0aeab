"""Train ELECTRA: python -m apps.electra.train config=apps/electra/configs/debug.yaml [key=value ...]"""

from dataclasses import dataclass, field, replace

from apps.electra.model import ElectraArgs, build_electra
from lingua.model.scaling import BERT_LAWS
from lingua.train import App, TrainArgs, main


@dataclass
class ElectraTrainArgs(TrainArgs):
    model: ElectraArgs = field(default_factory=ElectraArgs)


# The paper fits no law for ELECTRA: it takes BERT's, on BERT's backbones.
APP = App(name="apps.electra.train", args_cls=ElectraTrainArgs, build_model=build_electra,
          scaling=replace(BERT_LAWS, shapes_of="bert"))

if __name__ == "__main__":
    main(APP)
