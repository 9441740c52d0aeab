"""What the training loop measures besides the training loss: the loss on fixed held-out sequences (or an app's
own validation, e.g. a fine-tuned model's dev-set scores), and the frozen GLUE probes, each at its interval."""

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lingua.args import UserError, at_least
from lingua.distributed import Launch, all_reduce
from lingua.divergence import NonFiniteGuard
from lingua.eval.glue import GlueEvalArgs, run_glue_probes
from lingua.metrics import MetricLogger
from lingua.parallel import autocast

logger = logging.getLogger(__name__)


@dataclass
class ValidationArgs:
    every: int = 100  # steps between validations; 0 disables
    n_sequences: int = 64  # fixed held-out sequences
    batch_size: int = 16  # sequences per forward pass
    seed: int = 1234  # the masking of the validation set is the same at every validation and in every run
    keep_best: str = ""  # a validation metric, higher is better (e.g. val/score): the weights where it is highest
    # so far are exported to DUMP_DIR/best.pt, their validation record to best.json

    def __post_init__(self):
        at_least(self, 0, "every", "seed")
        at_least(self, 1, "n_sequences", "batch_size")


@torch.no_grad()
def validate(model, tokens: torch.Tensor, args: ValidationArgs, device: torch.device, launch: Launch) -> dict:
    """Loss and accuracy on fixed sequences with a fixed masking seed: comparable across steps, runs and world sizes.
    Every rank draws the masks of each whole chunk and evaluates its own rows of it; the sums are reduced. Rows from
    several sources (`tokens.source_rows`, lingua.data.load_validation's {source: rows}) also give each source's
    loss, val/loss/SOURCE: a rank evaluates its rows of a chunk source by source, masked as the whole chunk."""
    model.eval()
    generator = torch.Generator(device).manual_seed(args.seed)
    sources = getattr(tokens, "source_rows", None) or {}
    ends = list(itertools.accumulate(sources.values())) if len(sources) > 1 else [len(tokens)]
    totals: dict[str, torch.Tensor] = {}
    by_source = torch.zeros(len(ends), device=device)
    first = 0  # the chunk's first row
    for chunk in tokens.split(args.batch_size):
        batch = model.make_batch(chunk.to(device), generator)
        mine = torch.arange(first, first + len(chunk)).tensor_split(launch.world_size)[launch.rank]
        for source, (start, end) in _parts(int(mine[0]), int(mine[-1]) + 1, ends).items():
            part = {key: value[start - first:end - first] for key, value in batch.items()}
            with autocast(device):
                loss, stats = model(**part)
            rows = end - start  # rows predict equally many tokens: row-weighted means are exact
            for key, value in {"loss": loss, **stats}.items():
                totals[key] = totals.get(key, 0) + value.detach().float() * rows
            by_source[source] += loss.detach().float() * rows
        first += len(chunk)
    model.train()
    rows = torch.tensor([len(tokens)] * len(totals) + [end - begin for begin, end in zip([0, *ends], ends)],
                        device=device)
    means = (all_reduce(torch.cat([torch.stack(list(totals.values())), by_source])) / rows).tolist()
    record = {f"val/{key}": value for key, value in zip(totals, means)}
    if len(sources) > 1:
        record |= {f"val/loss/{name}": value for name, value in zip(sources, means[len(totals):])}
    return record


def _parts(start: int, end: int, ends: list[int]) -> dict[int, tuple[int, int]]:
    """{source index: (first row, end row)} of rows [start, end) where sources end at `ends` (cumulative)."""
    parts, begin = {}, 0
    for index, source_end in enumerate(ends):
        low, high = max(start, begin), min(end, source_end)
        if low < high:
            parts[index] = (low, high)
        begin = source_end
    return parts


def check_validation_split(args: ValidationArgs, world_size: int) -> None:
    """Each chunk of validation rows is split over the ranks: each must get at least one row of every chunk."""
    chunks = [args.batch_size] * (args.n_sequences // args.batch_size) + [args.n_sequences % args.batch_size]
    if min(c for c in chunks if c) < world_size:
        raise UserError(f"validation.batch_size {args.batch_size} and validation.n_sequences {args.n_sequences} "
                        f"leave a chunk of fewer rows than the {world_size} processes: use multiples of {world_size}")


@dataclass
class Evaluator:
    """The validation (`validation.every`, and at the last step: the loss on the validation rows, or the app's own
    `validate()`) and the frozen GLUE probes (`eval.every`) of the model being trained, on finite weights only.
    Every rank takes part (a sharded model computes with all of them); rank 0 logs."""

    model: torch.nn.Module
    tokenizer: object
    val_tokens: torch.Tensor | None  # every rank holds all rows; `validate` splits each chunk over the ranks
    validation: ValidationArgs
    probes: GlueEvalArgs
    last_step: int
    device: torch.device
    launch: Launch
    metrics: MetricLogger
    guard: NonFiniteGuard
    app_validate: Callable[[], dict[str, float]] | None = None  # the app's own validation, reduced over the ranks

    def run(self, step: int) -> dict | None:
        """Validates and probes when `step` asks for it; returns the validation record, if there was one."""
        validating = self.val_tokens is not None and (step % self.validation.every == 0 or step == self.last_step)
        probing = self.probes.every > 0 and step % self.probes.every == 0
        if validating or probing:
            self.guard.check()
        if validating:
            scores = (self.app_validate() if self.app_validate is not None else
                      validate(self.model, self.val_tokens, self.validation, self.device, self.launch))
            record = {"step": step, **scores}
            if not math.isfinite(record["val/loss"]):
                self.guard.stop(f"the validation loss is {record['val/loss']} at step {step}")
            self.metrics.log(record)
            logger.info(f"step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
        if probing:
            scores = run_glue_probes(self.model, self.tokenizer, self.probes, self.device)
            self.metrics.log({"step": step, **scores})
            logger.info(f"step {step} | " + " | ".join(f"{k} {v:.1f}" for k, v in scores.items()))
        return record if validating else None
