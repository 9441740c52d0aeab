"""Train the BERT baseline: python -m apps.bert.train config=apps/bert/configs/debug.yaml [key=value ...]"""

from dataclasses import dataclass, field

from apps.bert.model import BertArgs, build_bert
from lingua.eval.glue import GlueEvalArgs
from lingua.model.scaling import BERT_LAWS
from lingua.train import App, TrainArgs, main
from lingua.training.validation import GLUE_PROBES


@dataclass
class BertTrainArgs(TrainArgs):
    model: BertArgs = field(default_factory=BertArgs)
    eval: GlueEvalArgs = field(default_factory=GlueEvalArgs)  # frozen GLUE probes every eval.every steps (0: off)


APP = App(name="apps.bert.train", args_cls=BertTrainArgs, build_model=build_bert, scaling=BERT_LAWS,
          evaluations=(GLUE_PROBES,))

if __name__ == "__main__":
    main(APP)
