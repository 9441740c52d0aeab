"""Train ELECTRA: python -m apps.electra.train config=apps/electra/configs/debug.yaml [key=value ...]"""

from dataclasses import dataclass, field, replace

from apps.electra.model import ElectraArgs, build_electra
from lingua.eval.glue import GlueEvalArgs
from lingua.model.scaling import BERT_LAWS
from lingua.train import App, TrainArgs, main
from lingua.training.validation import GLUE_PROBES


@dataclass
class ElectraTrainArgs(TrainArgs):
    model: ElectraArgs = field(default_factory=ElectraArgs)
    eval: GlueEvalArgs = field(default_factory=GlueEvalArgs)  # frozen GLUE probes every eval.every steps (0: off)


# The paper fits no law for ELECTRA: it takes BERT's, on BERT's backbones.
APP = App(name="apps.electra.train", args_cls=ElectraTrainArgs, build_model=build_electra,
          scaling=replace(BERT_LAWS, shapes_of="bert"), evaluations=(GLUE_PROBES,))

if __name__ == "__main__":
    main(APP)
