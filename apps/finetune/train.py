"""GLUE fine-tuning of any pre-trained run (BERT, CrossBERT, ELECTRA, a contrastive or fine-tuning run), the whole
backbone trained, with a dev-set evaluation after each epoch and the best epoch's weights kept (best.pt):

    python -m apps.finetune.train config=apps/finetune/configs/debug.yaml init_from=PRETRAINED_RUN data.task=rte

`steps`, the warm-up and the evaluation interval follow from `epochs`, `warmup_ratio` and the train split's size.
"""

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from apps.finetune.data import (
    GlueDataArgs,
    GlueLoader,
    check_splits,
    load_dev_rows,
    repartition_position,
    row_shape,
    steps_per_epoch,
)
from apps.finetune.model import FinetuneArgs, build_finetune
from lingua.app import DataPipeline
from lingua.checkpoint.store import Checkpoint
from lingua.distributed import Launch, all_reduce
from lingua.errors import UserError, at_least, require
from lingua.eval.glue import GlueEvalArgs, task_scores
from lingua.parallel import autocast
from lingua.train import App, TrainArgs, main
from lingua.training.optim import OptimArgs
from lingua.training.pretrained import adopt_pretrained, load_pretrained
from lingua.training.resume import Start
from lingua.training.validation import GLUE_PROBES, ValidationArgs

GLUE = DataPipeline(GlueLoader, load_dev_rows, repartition_position, row_shape, check_splits)
FINETUNE = "apps.finetune.train"


def protocol_optimizer() -> OptimArgs:
    """RoBERTa's and ModernBERT's AdamW; the learning rate is the sweep's."""
    return OptimArgs(lr=2e-5, lr_min=0.0, decay="linear", weight_decay=0.01, beta2=0.98, eps=1e-6)


@dataclass
class FinetuneTrainArgs(TrainArgs):
    data: GlueDataArgs = field(default_factory=GlueDataArgs)
    model: FinetuneArgs = field(default_factory=FinetuneArgs)
    eval: GlueEvalArgs = field(default_factory=GlueEvalArgs)  # frozen GLUE probes every eval.every steps (0: off)
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


def configure(config: FinetuneTrainArgs, start: Start) -> FinetuneTrainArgs:
    """The pre-trained run's shapes and tokenizer (lingua/training/pretrained.py), the task's head, the data order
    from the run's seed, and the schedule in epochs (from the train split's size, `check_splits`): `steps`,
    `optim.warmup`, the evaluation after each epoch and a checkpoint at least once an epoch. A run resumed on another
    number of processes, whose epochs would change, is refused."""
    config = adopt_pretrained(config, start, attention_pooler=config.model.pooling == "attention")
    per_epoch = steps_per_epoch(start.data["train_rows"], config.data, start.world_size)
    steps = config.epochs * per_epoch
    started = start.resumed
    if started and (started["steps"], started["validation"]["every"]) != (steps, per_epoch):
        raise UserError(f"{config.dump_dir} was started with {started['validation']['every']} steps an epoch, here "
                        f"{per_epoch}: resume it on as many processes as it started on")
    task, seed = config.data.glue_task, config.seed if config.data.seed is None else config.data.seed
    return replace(config, steps=steps, data=replace(config.data, seed=seed),
                   model=replace(config.model, num_labels=len(task.labels) or 1),
                   optim=replace(config.optim, warmup=round(config.warmup_ratio * steps)),
                   validation=replace(config.validation, every=per_epoch, keep_best="val/score"),
                   checkpoint=replace(config.checkpoint, every=min(config.checkpoint.every, per_epoch)),
                   origin=started["origin"] if started else pretrained_origin(start.init_from))


def pretrained_origin(init_from: Checkpoint | None) -> str:
    """The pre-training checkpoint a run starts from, through the fine-tuning runs between (an MNLI start)."""
    if init_from is None:
        return ""
    return init_from.config["origin"] if init_from.app_name == FINETUNE else str(init_from.path)


@torch.no_grad()
def validate_dev(model, rows: torch.Tensor, validation: ValidationArgs, data: GlueDataArgs, device: torch.device,
                 launch: Launch) -> dict[str, float]:
    """The task's metrics on the whole dev split, in percent, and the mean loss; `val/score` is the task's headline
    metric (the paper's number). Every rank scores the same predictions."""
    task = data.glue_task
    logits = dev_logits(model, rows, validation.batch_size, device, launch)
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
          configure=configure, load_init=load_pretrained, validate=validate_dev,
          evaluations=(GLUE_PROBES,))

if __name__ == "__main__":
    main(APP)
