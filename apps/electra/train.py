"""Train ELECTRA: python -m apps.electra.train config=apps/electra/configs/debug.yaml [key=value ...]"""

from dataclasses import dataclass, field

from apps.electra.model import ElectraArgs, build_electra
from lingua.train import App, TrainArgs, main


@dataclass
class ElectraTrainArgs(TrainArgs):
    model: ElectraArgs = field(default_factory=ElectraArgs)


APP = App(name="apps.electra.train", args_cls=ElectraTrainArgs, build_model=build_electra)

if __name__ == "__main__":
    main(APP)
