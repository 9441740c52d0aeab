"""Train CrossBERT: python -m apps.crossbert.train config=apps/crossbert/configs/debug.yaml [key=value ...]"""

from dataclasses import dataclass, field

from apps.crossbert.model import CrossBertArgs, build_crossbert
from lingua.eval.glue import GlueEvalArgs
from lingua.model.scaling import CROSSBERT_LAWS
from lingua.train import App, TrainArgs, main
from lingua.training.validation import GLUE_PROBES


@dataclass
class CrossBertTrainArgs(TrainArgs):
    model: CrossBertArgs = field(default_factory=CrossBertArgs)
    eval: GlueEvalArgs = field(default_factory=GlueEvalArgs)  # frozen GLUE probes every eval.every steps (0: off)


VARIANTS = {"ratio 0.65": ["mask_ratio=0.65"], "dense view mask": ["cms_attention=mask"], "no CMS": ["cms=false"],
            "whole logits": ["encoder.head_chunk=0"]}
APP = App(name="apps.crossbert.train", args_cls=CrossBertTrainArgs, build_model=build_crossbert,
          scaling=CROSSBERT_LAWS, variants=VARIANTS, evaluations=(GLUE_PROBES,))

if __name__ == "__main__":
    main(APP)
