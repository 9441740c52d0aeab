"""What the training loop measures besides the training loss: evaluations, each at its interval. The loop runs a list
of them (`build_evaluations`): the validation (the loss on fixed held-out sequences, or an app's own, e.g. a
fine-tuned model's dev-set scores), then the kinds the app registers (`App.evaluations`), e.g. the frozen GLUE probes
(`GLUE_PROBES`, read from the config's `eval` section)."""

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from lingua.app import App
from lingua.data.loader import ValidationRows
from lingua.distributed import Launch, all_reduce, on_every_rank
from lingua.errors import UserError, at_least
from lingua.eval.glue import GlueEvalArgs, check_args, probe_length, run_glue_probes
from lingua.eval.glue_data import SkippedLinesReport
from lingua.parallel import autocast
from lingua.training.divergence import NonFiniteGuard
from lingua.training.ema import SCORE_PREFIX, WeightsAverage


@dataclass
class ValidationArgs:
    every: int = 100  # steps between validations; 0 disables
    n_sequences: int = 64  # fixed held-out sequences
    batch_size: int = 16  # sequences per forward pass
    seed: int = 1234  # the masking of the validation set is the same at every validation and in every run
    keep_best: str = ""  # a validation metric, higher is better (e.g. val/score): the weights where it is highest
    # so far are saved to DUMP_DIR/best.pt, their validation record to best.json (ema/val/score: the average's)

    def __post_init__(self):
        at_least(self, 0, "every", "seed")
        at_least(self, 1, "n_sequences", "batch_size")


@torch.no_grad()
def validate(model, rows: ValidationRows, args: ValidationArgs, device: torch.device, launch: Launch) -> dict:
    """Loss and accuracy on fixed sequences with a fixed masking seed: comparable across steps, runs and world sizes.
    Every rank draws the masks of each whole chunk and evaluates its own rows of it; the sums are reduced. Rows from
    several sources (`rows.source_rows`) also give each source's loss, val/loss/SOURCE: a rank evaluates its rows of
    a chunk source by source, masked as the whole chunk."""
    model.eval()
    generator = torch.Generator(device).manual_seed(args.seed)
    tokens, sources = rows.tokens, rows.source_rows
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


class Evaluation(Protocol):
    """One evaluation of the model being trained, run by the loop when it is `due`: on finite weights only, by every
    rank at the same steps (a sharded model computes with all of them); its scores are logged to metrics.jsonl with
    the step, and must be the same on every rank (reduced)."""

    name: str  # what it is called in logs and errors; with keep_best, the config section of that key
    keep_best: str  # a metric of its scores, higher is better, whose best weights are kept (best.pt; one evaluation
    # of a run at most); "": none

    def due(self, step: int) -> bool: ...

    def run(self, step: int) -> dict[str, float]: ...


@dataclass(frozen=True)
class EvalContext:
    """What evaluations during training are built from."""

    model: torch.nn.Module  # the model being trained
    tokenizer: Any
    config: Any  # the run's config (TrainArgs) as it trains
    device: torch.device
    launch: Launch
    guard: NonFiniteGuard  # stops the run on a non-finite score (`guard.stop`)
    average: WeightsAverage | None = None  # the weights' average (`ema`), which evaluations score when asked


@dataclass(frozen=True)
class EvaluationKind:
    """An evaluation an app registers (`App.evaluations`): `check(config, world_size)` refuses a bad config before the
    run starts (a missing data folder fails then, not at the first evaluation); `build(context)` makes the run's
    evaluation, or None when the config leaves it off."""

    build: Callable[[EvalContext], Evaluation | None]
    check: Callable[[Any, int], None] = lambda config, world_size: None


def build_evaluations(app: App, context: EvalContext) -> list[Evaluation]:
    """The evaluations the loop runs, in order: the validation (`validation.every`), then those of the kinds the app
    registers (`App.evaluations`), each scoring the weights `ema.evaluate` names. The validation's rows are read
    here, at the start."""
    config, evaluations = context.config, []
    if config.validation.every > 0:
        evaluations.append(Validation(app, context))
    evaluations += [evaluation for kind in app.evaluations if (evaluation := kind.build(context)) is not None]
    if context.average is not None and config.ema.evaluate != "raw":
        evaluations = [OfTheAverage(evaluation, context.average, config.ema.evaluate) for evaluation in evaluations]
    keeping = [evaluation.name for evaluation in evaluations if evaluation.keep_best]
    if len(keeping) > 1:
        raise UserError(f"one evaluation keeps the best weights (best.pt), not {len(keeping)}: {', '.join(keeping)}")
    return evaluations


def check_evaluations(app: App, config, world_size: int) -> None:
    """What would stop an evaluation later, checked before the run starts."""
    if config.validation.every > 0 and app.validate is None:
        check_validation_split(config.validation, world_size)
    key, weights = config.validation.keep_best, config.ema.evaluate
    if key and weights != "both" and key.startswith(SCORE_PREFIX) != (weights == "ema"):
        raise UserError(f"validation.keep_best {key}: the validation logs it only with ema.evaluate="
                        f"{'ema or both' if key.startswith(SCORE_PREFIX) else 'raw or both'}, here '{weights}'")
    for kind in app.evaluations:
        kind.check(config, world_size)


class OfTheAverage:
    """An evaluation that scores the weights' average (its scores named ema/KEY), after the raw weights when
    `weights` is both."""

    def __init__(self, evaluation: Evaluation, average: WeightsAverage, weights: str):
        self.evaluation, self.average, self.weights = evaluation, average, weights
        self.name, self.keep_best = evaluation.name, evaluation.keep_best

    def due(self, step: int) -> bool:
        return self.evaluation.due(step)

    def run(self, step: int) -> dict[str, float]:
        scores = self.evaluation.run(step) if self.weights == "both" else {}
        with self.average.swapped_in():
            return scores | {SCORE_PREFIX + key: value for key, value in self.evaluation.run(step).items()}


class Validation:
    """The loss on the validation rows (or the app's own `validate()`) every `validation.every` steps and at the last
    one; a non-finite loss stops the run."""

    name = "validation"

    def __init__(self, app: App, context: EvalContext):
        config, model = context.config, context.model
        self.every, self.last_step, self.keep_best = config.validation.every, config.steps, config.validation.keep_best
        self.guard = context.guard
        rows = on_every_rank(lambda: app.data.load_validation(config.data, context.tokenizer,
                                                              config.validation.n_sequences))
        self.score: Callable[[], dict[str, float]] = (
            functools.partial(app.validate, model, rows, config.validation, config.data, context.device, context.launch)
            if app.validate is not None else
            functools.partial(validate, model, rows if isinstance(rows, ValidationRows) else ValidationRows(rows),
                              config.validation, context.device, context.launch))

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    def run(self, step: int) -> dict[str, float]:
        scores = self.score()
        if not math.isfinite(scores["val/loss"]):
            self.guard.stop(f"the validation loss is {scores['val/loss']} at step {step}")
        return scores


class GlueProbes:
    """The frozen GLUE probes (lingua/eval/glue.py) every `eval.every` steps, on texts of at most the training length;
    each file's malformed lines are reported once in the run."""

    name, keep_best = "eval", ""

    def __init__(self, model, tokenizer, args: GlueEvalArgs, seq_len: int, device: torch.device):
        self.model, self.tokenizer, self.device, self.report = model, tokenizer, device, SkippedLinesReport()
        self.args = replace(args, max_len=probe_length(args, seq_len, model.backbone.args.max_seqlen))

    @classmethod
    def of_run(cls, context: EvalContext) -> "GlueProbes | None":
        """The probes of the run's `eval` section; None when `eval.every` is 0."""
        config = context.config
        if config.eval.every == 0:
            return None
        return cls(context.model, context.tokenizer, config.eval, config.data.seq_len, context.device)

    def due(self, step: int) -> bool:
        return step % self.args.every == 0

    def run(self, step: int) -> dict[str, float]:
        return run_glue_probes(self.model, self.tokenizer, self.args, self.device, self.report)

    @staticmethod
    def check(config, world_size: int) -> None:
        """A bad GLUE setting (e.g. a missing data folder) of probes that will run; an app that registers them
        without their config section."""
        if not isinstance(getattr(config, "eval", None), GlueEvalArgs):
            raise UserError(f"{type(config).__name__} has no `eval: GlueEvalArgs` section, which the GLUE probes "
                            "it registers (App.evaluations) read")
        if config.eval.every > 0:
            check_args(config.eval)


# The frozen GLUE probes during training: an app registers them (App.evaluations) beside a config section
# `eval: GlueEvalArgs` of its TrainArgs.
GLUE_PROBES = EvaluationKind(GlueProbes.of_run, GlueProbes.check)
