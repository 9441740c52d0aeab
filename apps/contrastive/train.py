"""Contrastive probing (frozen backbone, the pooler trains) or fine-tuning of a pre-trained run:
python -m apps.contrastive.train config=apps/contrastive/configs/debug.yaml init_from=PRETRAINED_RUN [key=value ...]"""

from dataclasses import dataclass, field

from apps.contrastive.data import (
    TripletDataArgs,
    build_triplet_loader,
    load_triplet_validation,
    repartition_triplets,
    row_shape,
)
from apps.contrastive.model import ContrastiveArgs, build_contrastive, configure
from lingua.app import DataPipeline
from lingua.eval.glue import GlueEvalArgs
from lingua.train import App, TrainArgs, main
from lingua.training.pretrained import load_pretrained
from lingua.training.validation import GLUE_PROBES

TRIPLETS = DataPipeline(build_triplet_loader, load_triplet_validation, repartition_triplets, row_shape)


@dataclass
class ContrastiveTrainArgs(TrainArgs):
    data: TripletDataArgs = field(default_factory=TripletDataArgs)
    model: ContrastiveArgs = field(default_factory=ContrastiveArgs)
    eval: GlueEvalArgs = field(default_factory=GlueEvalArgs)  # frozen GLUE probes every eval.every steps (0: off)


APP = App(name="apps.contrastive.train", args_cls=ContrastiveTrainArgs, build_model=build_contrastive,
          data=TRIPLETS, configure=configure, load_init=load_pretrained, evaluations=(GLUE_PROBES,))

if __name__ == "__main__":
    main(APP)
