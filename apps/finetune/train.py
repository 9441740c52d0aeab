"""GLUE fine-tuning of any pre-trained run (BERT, CrossBERT, ELECTRA, a contrastive or fine-tuning run), the whole
backbone trained, with a dev-set evaluation after each epoch and the best epoch's weights kept (best.pt):

    python -m apps.finetune.train config=apps/finetune/configs/debug.yaml init_from=PRETRAINED_RUN data.task=rte

`steps`, the warm-up and the evaluation interval follow from `epochs`, `warmup_ratio` and the train split's size.
"""

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from apps.finetune.data import (
    GlueDataArgs,
    GlueLoader,
    load_dev_rows,
    read_split,
    repartition_position,
    row_shape,
    steps_per_epoch,
)
from apps.finetune.model import FinetuneArgs, build_finetune
from lingua.app import DataPipeline
from lingua.args import UserError, at_least, require
from lingua.checkpoint import Checkpoint, CheckpointArgs, CheckpointManager
from lingua.distributed import Launch, all_reduce, detect_launch
from lingua.eval.glue import task_scores
from lingua.optim import OptimArgs
from lingua.parallel import autocast
from lingua.pretrained import adopt_pretrained, load_pretrained
from lingua.run_folder import RunFolder
from lingua.train import App, TrainArgs, main

GLUE = DataPipeline(GlueLoader, load_dev_rows, repartition_position, row_shape)
FINETUNE = "apps.finetune.train"


def protocol_optimizer() -> OptimArgs:
    """RoBERTa's and ModernBERT's AdamW; the learning rate is the sweep's."""
    return OptimArgs(lr=2e-5, lr_min=0.0, decay="linear", weight_decay=0.01, beta2=0.98, eps=1e-6)


@dataclass
class FinetuneTrainArgs(TrainArgs):
    data: GlueDataArgs = field(default_factory=GlueDataArgs)
    model: FinetuneArgs = field(default_factory=FinetuneArgs)
    optim: OptimArgs = field(default_factory=protocol_optimizer)
    epochs: int = 3  # passes over the train split; the dev set is scored after each (steps follow from it)
    warmup_ratio: float = 0.06  # the share of the steps with a linear warm-up (then optim.decay)
    origin: str = ""  # set at the start: the pre-training checkpoint this run descends from (for the table)

    def __post_init__(self):
        super().__post_init__()
        at_least(self, 1, "epochs")
        require(0 <= self.warmup_ratio < 1, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        require(self.grad_acc_steps == 1, "grad_acc_steps", "must be 1: an epoch ends on a whole batch (a fine-tuning "
                "batch fits one step: set data.batch_size)")


def configure(args: FinetuneTrainArgs) -> FinetuneTrainArgs:
    """The pre-trained run's shapes and tokenizer (lingua/pretrained.py), the task's head, the data order from the
    run's seed, and the schedule in epochs: `steps`, `optim.warmup`, the evaluation after each epoch and a checkpoint
    at least once an epoch. Both splits are read first, so bad data stops the run before anything is written; a run
    resumed on another number of processes, whose epochs would change, is refused."""
    args = adopt_pretrained(args, attention_pooler=args.model.pooling == "attention")
    read_split(args.data, "dev")
    per_epoch = steps_per_epoch(args.data, detect_launch().world_size)
    steps = args.epochs * per_epoch
    started = started_config(Path(args.dump_dir))
    if started and (started["steps"], started["validation"]["every"]) != (steps, per_epoch):
        raise UserError(f"{args.dump_dir} was started with {started['validation']['every']} steps an epoch, here "
                        f"{per_epoch}: resume it on as many processes as it started on")
    task, seed = args.data.glue_task, args.seed if args.data.seed is None else args.data.seed
    return replace(args, steps=steps, data=replace(args.data, seed=seed),
                   model=replace(args.model, num_labels=len(task.labels) or 1),
                   optim=replace(args.optim, warmup=round(args.warmup_ratio * steps)),
                   validation=replace(args.validation, every=per_epoch, keep_best="val/score"),
                   checkpoint=replace(args.checkpoint, every=min(args.checkpoint.every, per_epoch)),
                   origin=started["origin"] if started else pretrained_origin(args.init_from))


def started_config(dump_dir: Path) -> dict | None:
    """The config of a run being resumed (one that saved a checkpoint), else None."""
    if CheckpointManager(RunFolder(dump_dir).checkpoints, CheckpointArgs()).latest() is None:
        return None
    return Checkpoint.open(dump_dir).config


def pretrained_origin(init_from: str) -> str:
    """The pre-training checkpoint a run starts from, through the fine-tuning runs between (an MNLI start)."""
    if not init_from:
        return ""
    checkpoint = Checkpoint.open(init_from)
    return checkpoint.config["origin"] if checkpoint.app_name == FINETUNE else str(checkpoint.path)


@torch.no_grad()
def validate_dev(model, rows: torch.Tensor, args: FinetuneTrainArgs, device: torch.device,
                 launch: Launch) -> dict[str, float]:
    """The task's metrics on the whole dev split, in percent, and the mean loss; `val/score` is the task's headline
    metric (the paper's number). Every rank scores the same predictions."""
    task = args.data.glue_task
    logits = dev_logits(model, rows, args.validation.batch_size, device, launch)
    labels = model.make_batch(rows, None)["labels"]
    if task.regression:
        loss, predictions = F.mse_loss(logits[:, 0], labels), logits[:, 0]
    else:
        loss, predictions = F.cross_entropy(logits, labels), logits.argmax(1)
    scores = task_scores(task, predictions, labels)
    return {"val/loss": loss.item(), **{f"val/{k}": v for k, v in scores.items()}, "val/score": scores[task.headline]}


def dev_logits(model, rows: torch.Tensor, batch_size: int, device: torch.device, launch: Launch) -> torch.Tensor:
    """[N, num_labels] on the CPU. Each chunk of rows is split over the ranks (each gets a row of every chunk: the
    sharded model computes with all of them) and their logits are summed into one tensor, the same on every rank."""
    world = launch.world_size
    padded = torch.cat([rows, rows[-1:].expand(-len(rows) % world, -1)])
    logits = torch.zeros(len(padded), model.args.num_labels, device=device)
    model.eval()
    for chunk in torch.arange(len(padded)).split(batch_size * world):
        mine = chunk.tensor_split(world)[launch.rank]
        tokens = padded[mine, 1:]
        longest = int((tokens != model.pad_id).sum(1).max())
        with autocast(device):
            logits[mine.to(device)] = model.logits(tokens[:, :longest].to(device))
    model.train()
    return all_reduce(logits)[:len(rows)].cpu()


APP = App(name=FINETUNE, args_cls=FinetuneTrainArgs, build_model=build_finetune, data=GLUE,
          configure=configure, load_init=load_pretrained, validate=validate_dev)

if __name__ == "__main__":
    main(APP)
