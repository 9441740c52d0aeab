"""GLUE fine-tuning of any pre-trained run (BERT, CrossBERT, ELECTRA, a contrastive or fine-tuning run), the whole
backbone trained, with a dev-set evaluation after each epoch and the best epoch's weights kept (best.pt):

    python -m apps.finetune.train config=apps/finetune/configs/debug.yaml init_from=PRETRAINED_RUN data.task=rte

`steps`, the warm-up and the evaluation interval follow from `epochs`, `warmup_ratio` and the train split's size.
"""

from dataclasses import dataclass, field, replace

import torch

from apps.finetune.data import (
    GlueDataArgs,
    build_glue_loader,
    load_dev_rows,
    repartition_position,
    row_shape,
    steps_per_epoch,
)
from apps.finetune.model import FinetuneArgs, build_finetune
from lingua.app import DataPipeline
from lingua.args import at_least, require
from lingua.distributed import Launch, all_reduce, detect_launch
from lingua.eval.glue import task_scores
from lingua.parallel import autocast
from lingua.pretrained import adopt_pretrained, load_pretrained
from lingua.train import App, TrainArgs, main

GLUE = DataPipeline(build_glue_loader, load_dev_rows, repartition_position, row_shape)


@dataclass
class FinetuneTrainArgs(TrainArgs):
    data: GlueDataArgs = field(default_factory=GlueDataArgs)
    model: FinetuneArgs = field(default_factory=FinetuneArgs)
    epochs: int = 3  # passes over the train split; the dev set is scored after each (steps follow from it)
    warmup_ratio: float = 0.06  # the share of the steps with a linear warm-up (then optim.decay, linear)

    def __post_init__(self):
        super().__post_init__()
        at_least(self, 1, "epochs")
        require(0 <= self.warmup_ratio < 1, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")


def configure(args: FinetuneTrainArgs) -> FinetuneTrainArgs:
    """The pre-trained run's shapes and tokenizer (lingua/pretrained.py), the task's head, the data order from the
    run's seed, and the schedule in epochs: `steps`, `optim.warmup`, the evaluation after each epoch and a checkpoint
    at least once an epoch."""
    args = adopt_pretrained(args, attention_pooler=args.model.pooling == "attention")
    per_epoch = steps_per_epoch(args.data, detect_launch().world_size, args.grad_acc_steps)
    steps = args.epochs * per_epoch
    task, seed = args.data.glue_task, args.seed if args.data.seed is None else args.data.seed
    return replace(args, steps=steps, data=replace(args.data, seed=seed),
                   model=replace(args.model, num_labels=len(task.labels) or 1),
                   optim=replace(args.optim, warmup=round(args.warmup_ratio * steps)),
                   validation=replace(args.validation, every=per_epoch, keep_best="val/score"),
                   checkpoint=replace(args.checkpoint, every=min(args.checkpoint.every, per_epoch)))


@torch.no_grad()
def validate_dev(model, rows: torch.Tensor, args: FinetuneTrainArgs, device: torch.device,
                 launch: Launch) -> dict[str, float]:
    """The task's metrics on the whole dev split, in percent, and the mean loss; `val/score` is the task's headline
    metric (the paper's number). Each chunk of rows is split over the ranks, whose logits are summed into one
    tensor, so every rank scores the same predictions."""
    task, world = args.data.glue_task, launch.world_size
    padded = torch.cat([rows, rows[-1:].expand(-len(rows) % world, -1)])  # every rank gets a row of every chunk
    logits = torch.zeros(len(padded), model.args.num_labels, device=device)
    model.eval()
    for chunk in torch.arange(len(padded)).split(args.validation.batch_size * world):
        mine = chunk.tensor_split(world)[launch.rank]
        batch = model.make_batch(padded[mine], None)
        tokens = batch["tokens"]
        longest = int((tokens != model.pad_id).sum(1).max())
        with autocast(device):
            logits[mine.to(device)] = model.logits(tokens[:, :longest].to(device))
    model.train()
    logits = all_reduce(logits)[:len(rows)].cpu()
    labels = model.make_batch(rows, None)["labels"]
    if task.regression:
        loss, predictions = torch.nn.functional.mse_loss(logits[:, 0], labels), logits[:, 0]
    else:
        loss, predictions = torch.nn.functional.cross_entropy(logits, labels), logits.argmax(1)
    scores = task_scores(task, predictions, labels)
    return {"val/loss": loss.item(), **{f"val/{k}": v for k, v in scores.items()}, "val/score": scores[task.headline]}


APP = App(name="apps.finetune.train", args_cls=FinetuneTrainArgs, build_model=build_finetune, data=GLUE,
          configure=configure, load_init=load_pretrained, validate=validate_dev)

if __name__ == "__main__":
    main(APP)
