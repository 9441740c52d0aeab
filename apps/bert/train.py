"""Train the BERT baseline: python -m apps.bert.train config=apps/bert/configs/debug.yaml [key=value ...]"""

from dataclasses import dataclass, field

from apps.bert.model import BertArgs, build_bert
from lingua.model.scaling import BERT_LAWS
from lingua.train import App, TrainArgs, main


@dataclass
class BertTrainArgs(TrainArgs):
    model: BertArgs = field(default_factory=BertArgs)


APP = App(name="apps.bert.train", args_cls=BertTrainArgs, build_model=build_bert, scaling=BERT_LAWS)

if __name__ == "__main__":
    main(APP)
