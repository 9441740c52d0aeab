"""Train CrossBERT: python -m apps.crossbert.train config=apps/crossbert/configs/debug.yaml [key=value ...]"""

from dataclasses import dataclass, field

from apps.crossbert.model import CrossBertArgs, build_crossbert
from lingua.train import App, TrainArgs, main


@dataclass
class CrossBertTrainArgs(TrainArgs):
    model: CrossBertArgs = field(default_factory=CrossBertArgs)


APP = App(name="apps.crossbert.train", args_cls=CrossBertTrainArgs, build_model=build_crossbert)

if __name__ == "__main__":
    main(APP)
