"""The one training loop shared by every app.

An app (apps/<name>/train.py) supplies only its model and config: `App(name, args_cls, build_model)`, following the
contract in lingua/app.py (masking and random draws in `make_batch`, loss and logged stats in `forward`, FLOPs, the
modules FSDP shards, the representation `encode` gives evaluation). Everything about a run lives in its
`dump_dir`; restarting with the same dump_dir resumes from the newest checkpoint that loads and continues exactly,
on the same or another number of processes.

The same command runs in one process, under `torchrun` or under SLURM's `srun` (lingua/distributed.py): each rank
trains on its own share of the data; gradients are reduced by FSDP2; only rank 0 writes logs and metrics, whose
values are means over all ranks.

Exit status of `main`: 0 the run finished (or had nothing left to do); 2 a one-line error (a bad config or input,
a refused start, a failed write); EXIT_STOPPED a stop signal saved a checkpoint (the same command resumes);
EXIT_DIVERGED the loss or gradient became non-finite (nothing non-finite was saved); 130 interrupted without saving.
The preemption signal (`distributed.stop_signal`, SIGUSR2: a cluster taking the machines back) saves a checkpoint and
exits 0 on every rank, so torchrun and srun see a clean end; under SLURM the job is requeued and resumes by itself.
"""

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lingua.app import App
from lingua.args import (
    UserError,
    at_least,
    command_line,
    config_changes,
    dump_config,
    load_config,
    require,
    to_dict,
)
from lingua.checkpoint import (
    CheckpointArgs,
    CheckpointManager,
    DamagedCheckpoint,
    export_consolidated,
    load_weights,
    parameters_finite,
    saved_shapes,
    shape_mismatches,
    verify,
)
from lingua.data import DataArgs, ReadAhead
from lingua.app import build_model
from lingua.distributed import (
    DistributedArgs,
    Launch,
    agreed_failure,
    all_reduce,
    barrier,
    broadcast_object,
    collective_failure,
    destroy_process_group,
    detect_launch,
    fail_together,
    init_process_group,
    on_all_ranks,
    on_every_rank,
    rank_and_world,
    resolve_device,
)
from lingua.lifecycle import RunLock, StopSignal, agree, requeue_slurm_job, stop_signals_held_for_the_main_thread
from lingua.parallel import autocast, set_gradient_sync
from lingua.files import remove_partial_writes
from lingua.flops import count_params
from lingua.eval.glue import GlueEvalArgs, check_args, run_glue_probes
from lingua.metrics import (
    LoggingArgs,
    MetricLogger,
    format_progress,
    peak_flops,
    peak_memory_gib,
    setup_logging,
)
from lingua.optim import OptimArgs, build_optimizer, lr_at, set_lr
from lingua.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

EXIT_STOPPED = 3
EXIT_DIVERGED = 4


@dataclass
class ValidationArgs:
    every: int = 100  # steps between validations; 0 disables
    n_sequences: int = 64  # fixed held-out sequences
    batch_size: int = 16  # sequences per forward pass
    seed: int = 1234  # the masking of the validation set is the same at every validation and in every run

    def __post_init__(self):
        at_least(self, 0, "every", "seed")
        at_least(self, 1, "n_sequences", "batch_size")


@dataclass
class TrainArgs:
    dump_dir: str  # the run's folder: config, logs, metrics, checkpoints; an existing run resumes
    name: str = "run"  # shown in logs and wandb
    seed: int = 42  # model init and masking draws (the data order has data.seed)
    steps: int = 1000  # optimizer steps in all
    grad_acc_steps: int = 1  # micro-batches accumulated per optimizer step
    device: str = "auto"  # auto: each rank's GPU if there is one, else the CPU
    init_from: str = ""  # a new run starts from these weights (checkpoint folder, dump_dir or consolidated.pt)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    validation: ValidationArgs = field(default_factory=ValidationArgs)
    eval: GlueEvalArgs = field(default_factory=GlueEvalArgs)  # frozen GLUE probes every eval.every steps (0: off)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)

    def __post_init__(self):
        require(bool(self.dump_dir.strip()), "dump_dir", "is empty: name the run's folder")
        at_least(self, 1, "steps", "grad_acc_steps")
        at_least(self, 0, "seed")


@torch.no_grad()
def validate(model, tokens: torch.Tensor, args: ValidationArgs, device: torch.device, launch: Launch) -> dict:
    """Loss and accuracy on fixed sequences with a fixed masking seed: comparable across steps, runs and world sizes.
    Every rank draws the masks of each whole chunk and evaluates its own rows of it; the sums are reduced."""
    model.eval()
    generator = torch.Generator(device).manual_seed(args.seed)
    totals: dict[str, torch.Tensor] = {}
    for chunk in tokens.split(args.batch_size):
        batch = model.make_batch(chunk.to(device), generator)
        mine = {key: value.tensor_split(launch.world_size)[launch.rank] for key, value in batch.items()}
        rows = len(next(iter(mine.values())))  # rows predict equally many tokens: row-weighted means are exact
        with autocast(device):
            loss, stats = model(**mine)
        for key, value in {"loss": loss, **stats}.items():
            totals[key] = totals.get(key, 0) + value.detach().float() * rows
    model.train()
    means = (all_reduce(torch.stack(list(totals.values()))) / len(tokens)).tolist()
    return {f"val/{key}": value for key, value in zip(totals, means)}


def check_validation_split(args: ValidationArgs, world_size: int) -> None:
    """Each chunk of validation rows is split over the ranks: each must get at least one row of every chunk."""
    chunks = [args.batch_size] * (args.n_sequences // args.batch_size) + [args.n_sequences % args.batch_size]
    if min(c for c in chunks if c) < world_size:
        raise UserError(f"validation.batch_size {args.batch_size} and validation.n_sequences {args.n_sequences} "
                        f"leave a chunk of fewer rows than the {world_size} processes: use multiples of {world_size}")


class Throughput:
    """Tokens per second and MFU of all ranks together over the steps since the last report, and the share of this
    rank's time spent waiting for its data loader."""

    def __init__(self, model, args: TrainArgs, row_tokens: int, world_size: int, device: torch.device):
        self.world_size = world_size
        rows = args.data.batch_size * args.grad_acc_steps * world_size
        self.per_step = {
            "data_tokens": rows * row_tokens,
            "token_views": rows * row_tokens * model.views_per_sequence,
        }
        self.flops_per_view = model.flops_per_token_view(args.data.seq_len)  # the paper's count (no output head)
        self.flops_per_view_with_head = self.flops_per_view + model.head_flops_per_token_view(args.data.seq_len)
        peak = peak_flops(args.logging, device)
        self.peak = peak * world_size if peak else None
        self.start, self.steps, self.predicted, self.waited = time.perf_counter(), 0, 0, 0.0

    def compute(self, token_views: int) -> dict[str, float]:
        """The run's compute so far: eq. 6 as the paper counts it (no output head), and all the FLOPs it ran."""
        return {"compute_flops": token_views * self.flops_per_view,
                "compute_flops_with_head": token_views * self.flops_per_view_with_head}

    def exclude(self, seconds: float) -> None:
        """Time spent outside training steps (validation, probes, checkpoints) does not count."""
        self.start += seconds

    def step(self, predicted_tokens: int, waited_s: float) -> None:
        self.steps += 1
        self.predicted += predicted_tokens * self.world_size
        self.waited += waited_s

    def report(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        views_per_s = self.steps * self.per_step["token_views"] / elapsed
        out = {
            "data_tokens_per_s": self.steps * self.per_step["data_tokens"] / elapsed,
            "token_views_per_s": views_per_s,
            "predicted_tokens_per_s": self.predicted / elapsed,
            "mfu": self.flops_per_view_with_head * views_per_s / self.peak if self.peak else None,
            "data_wait": self.waited / elapsed,
        }
        self.start, self.steps, self.predicted, self.waited = time.perf_counter(), 0, 0, 0.0
        return out


class Diverged(Exception):
    """The loss or the gradient norm became non-finite; the run stops without saving."""


class NonFiniteGuard:
    """Remembers, on the device, the first step whose loss or gradient norm was not finite. Reading it is a host sync,
    so the loop reads it only where it syncs anyway: before a log line, an evaluation and a checkpoint."""

    def __init__(self, device: torch.device, checkpoints: CheckpointManager):
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)
        self.checkpoints = checkpoints  # named in the message: the newest one is finite

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.first_bad_step = torch.where(bad & (self.first_bad_step == 0), step, self.first_bad_step)

    def check(self) -> None:
        """Every rank calls this at the same steps; the first bad step of any rank stops them all."""
        latest_possible = 2**62
        encoded = torch.where(self.first_bad_step == 0, 0, latest_possible - self.first_bad_step).reshape(1)
        found = int(all_reduce(encoded, "max").item())
        step = latest_possible - found if found else 0
        if step:
            self.stop(f"the loss or gradient norm is not finite at step {step}")

    def check_before_save(self, model, step: int) -> None:
        """Also the weights themselves: an update can overflow them after the last finite loss."""
        self.check()
        if not parameters_finite(model):
            self.stop(f"the weights are not finite after step {step}")

    def stop(self, what: str) -> None:
        latest = self.checkpoints.latest()
        kept = f"the newest checkpoint, {latest.name}, has finite weights" if latest else "no checkpoint was saved"
        raise Diverged(f"{what}: the run stops without saving ({kept}); lower optim.lr or raise optim.warmup, then "
                       "run again (if it diverges again at once, that checkpoint is already unstable: delete it to "
                       "resume from an earlier one)")


def train(app: App, args) -> dict[str, Any]:
    """Trains, or resumes, the run in args.dump_dir, in this process and the others of its launch. The dump_dir is
    locked for the run; nothing in it is written before the start has succeeded (config checked, checkpoint
    loaded, data found)."""
    if app.configure is not None:
        app.configure(args)
    launch = detect_launch()
    device = resolve_device(args.device, launch.local_rank)
    if args.data.seq_len > args.model.encoder.max_seqlen:
        raise UserError(f"data.seq_len ({args.data.seq_len}) exceeds model.encoder.max_seqlen "
                        f"({args.model.encoder.max_seqlen}), the length of the position table")
    if args.validation.every > 0:
        check_validation_split(args.validation, launch.world_size)
    if args.eval.every > 0:
        check_args(args.eval)  # a bad GLUE path fails now, not at the first evaluation
        args.eval.max_len = min(args.eval.max_len or args.data.seq_len, args.model.encoder.max_seqlen)
    with stop_signals_held_for_the_main_thread(args.distributed.stop_signal):
        init_process_group(launch, device, args.distributed.timeout_minutes)
        activity = Activity("the start-up")
        try:
            dump_dir = Path(args.dump_dir)
            on_all_ranks(lambda: _make_folder(dump_dir))
            with RunLock(dump_dir):
                setup_logging(dump_dir / "train.log", launch.rank)
                return _train(app, args, dump_dir, device, launch, activity)
        except RuntimeError as e:
            kind = collective_failure(e)
            if kind is None:
                raise
            raise activity.failed(kind, launch.rank, args.distributed.timeout_minutes) from None
        finally:
            destroy_process_group()


@dataclass
class Activity:
    """What this rank is doing, named in the error when a collective fails: the other ranks' logs tell why."""

    now: str

    def failed(self, kind: str, rank: int, timeout_minutes: float) -> UserError:
        """The one line for a collective that timed out or lost a rank (`collective_failure`'s kind)."""
        if kind == "timeout":
            return UserError(f"rank {rank} waited more than {timeout_minutes:g} min for the other ranks during "
                             f"{self.now}: one of them has stopped or hangs (see its log); the newest checkpoint "
                             "is kept")
        return UserError(f"rank {rank} lost contact with another rank during {self.now}: it stopped or failed (see "
                         "its error); the newest checkpoint is kept")


def _make_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise UserError(f"dump_dir {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create dump_dir {folder}: {e.strerror}") from None


def _train(app: App, args, dump_dir: Path, device: torch.device, launch: Launch,
           activity: Activity) -> dict[str, Any]:
    rank, world_size = launch.rank, launch.world_size
    tokenizer = build_tokenizer(args.data.tokenizer)
    model = build_model(app.build_model, args.model, tokenizer, device, args.seed, (args.distributed, launch))
    check_batch_shape(model, app.data.row_shape(args.data), device)
    optimizer = build_optimizer(model, args.optim)
    params = {"app": app.name, "config": to_dict(args)}
    checkpoints = CheckpointManager(dump_dir / "checkpoints", args.checkpoint)
    on_all_ranks(checkpoints.check_folder)
    checkpoints.remove_leftovers()
    if rank == 0:
        for partial in remove_partial_writes(dump_dir):
            logger.info(f"removed {partial.name}, left by a process killed while writing it")
    state = resume(checkpoints, model, optimizer, app, args, launch)
    generator = torch.Generator(device).manual_seed(args.seed + rank)  # the masking's random draws
    if state is None:
        state = {"step": 0, "data": None, "data_tokens": 0}
        if args.init_from:
            changed = architecture_changes((app.load_init or load_weights)(args.init_from, model), args)
            if changed:
                raise UserError(f"init_from {args.init_from} is a model of another architecture ({', '.join(changed)})")
            logger.info(f"initialised the model from {args.init_from} (weights only: step, optimizer and data start "
                        "afresh)")
    elif state.get("generator") is not None:
        generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))

    val_tokens = None
    if args.validation.every > 0:  # every rank holds all rows; `validate` splits each chunk over the ranks
        val_tokens = on_every_rank(lambda: app.data.load_validation(args.data, tokenizer,
                                                                    args.validation.n_sequences))
    throughput = Throughput(model, args, math.prod(app.data.row_shape(args.data)), world_size, device)
    logger.info(
        f"{app.name}: {count_params(model):,} parameters ({count_params(model, embeddings=False):,} outside the "
        f"embedding) on {world_size} process(es) ({launch.source}, {device.type}"
        f"{', ' + args.distributed.fsdp_type if world_size > 1 else ''}), {args.steps} steps of "
        f"{throughput.per_step['data_tokens']:,} data tokens over all processes"
    )

    step, first_loss, last = state["step"], None, {}
    if step >= args.steps:
        logger.info(f"{dump_dir} already holds a finished run of {step} steps: nothing to train")
    window, guard = Window(), NonFiniteGuard(device, checkpoints)
    start = time.perf_counter()
    with (
        on_every_rank(lambda: ReadAhead(app.data.build_loader(args.data, tokenizer, rank, world_size,
                                                              state["data"]))) as loader,
        MetricLogger(dump_dir / "metrics.jsonl", state["step"], args.logging, params["config"], rank == 0) as metrics,
        StopSignal(args.distributed.stop_signal, args.distributed.timeout_minutes) as stop,
    ):
        if rank == 0 and step < args.steps:
            dump_config(args, dump_dir / "config.yaml")  # the start has succeeded: this is now the run's config
        # Every decision all ranks must share comes from `agree` (one reduced value), never from local state.
        activity.now = f"the agreement before step {step + 1}"
        stopping = step < args.steps and agree(stop, loader.prepare(args.grad_acc_steps))
        if state.get("evaluation_skipped") and not stopping:  # the stop that saved this checkpoint skipped it
            activity.now = f"the evaluation at step {step}"
            evaluate(step, model, tokenizer, val_tokens, args, device, metrics, launch, guard)
        while step < args.steps and not stopping:
            activity.now = f"step {step + 1}"
            lr = lr_at(step, args.optim, args.steps)
            set_lr(optimizer, lr)
            loss, stats, predicted, waited = train_step(model, loader, generator, args, device)
            grad_norm = clip_gradients(model, args.optim.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            guard.update(step, loss, grad_norm)
            state["data_tokens"] += throughput.per_step["data_tokens"]
            window.add(loss=loss, grad_norm=grad_norm, **stats)
            before = time.perf_counter()
            failure = loader.prepare(args.grad_acc_steps) if step < args.steps else None  # the next step's data
            throughput.step(predicted, waited + time.perf_counter() - before)
            activity.now = f"the agreement after step {step}"
            stopping = agree(stop, failure or metrics.failure)

            if step % args.logging.freq == 0 or step == args.steps:
                activity.now = f"the log line of step {step}"
                guard.check()
                last = {"step": step, **window.means(), "lr": lr, **throughput.report(),
                        "data_tokens": state["data_tokens"],
                        **throughput.compute(state["data_tokens"] * model.views_per_sequence),
                        "memory_gib": peak_memory_gib(device), "malformed_lines": loader.malformed_lines}
                last |= reduce_over_ranks(last, device, maximum=("memory_gib", "data_wait"), total=("malformed_lines",))
                first_loss = last["loss"] if first_loss is None else first_loss
                metrics.log(last)
                logger.info(format_progress(last, args.steps))
            pause = time.perf_counter()
            if not stopping:  # on a stop signal, save at once: the job may have little time left
                activity.now = f"the evaluation at step {step}"
                evaluate(step, model, tokenizer, val_tokens, args, device, metrics, launch, guard)
            if step % args.checkpoint.every == 0 or step == args.steps or stopping:
                activity.now = f"saving checkpoint {step}"
                guard.check_before_save(model, step)  # a non-finite state never becomes a checkpoint
                state.update(step=step, data=loader.state_dict(), generator=generator.get_state().tolist(),
                             evaluation_skipped=bool(stopping))
                checkpoints.save(step, model, optimizer, state, params)
            throughput.exclude(time.perf_counter() - pause)
        activity.now = "the last agreement"
        fail_together(metrics.failure)  # a record of the last step that could not be written

    if step == args.steps:
        activity.now = "the export of consolidated.pt"
        export_consolidated(model, params, dump_dir / "consolidated.pt")
    summary = {"steps": step, "first_loss": first_loss, "final_loss": last.get("loss"),
               "data_tokens": state["data_tokens"], "seconds": round(time.perf_counter() - start, 1),
               "stopped_by": stop.agreed,
               "requeued": bool(stop.agreed) and requeue_slurm_job(stop.agreed, args.distributed)}
    logger.info("summary: " + " | ".join(f"{k} {v}" for k, v in summary.items()))
    return summary


def check_batch_shape(model, row_shape: tuple[int, ...], device: torch.device) -> None:
    """The app can make a batch of rows of this shape (e.g. its mask ratio masks at least one token); checked at the
    start with a throwaway generator, so the run's random draws are untouched."""
    tokens = torch.zeros(1, *row_shape, dtype=torch.long, device=device)
    model.make_batch(tokens, torch.Generator(device).manual_seed(0))


def resume(checkpoints: CheckpointManager, model, optimizer, app: App, args, launch: Launch) -> dict | None:
    """Loads the newest checkpoint that loads and returns this rank's train state; None for a new run.

    Rank 0 picks the checkpoint and every rank loads that one. A damaged checkpoint (a missing, truncated or
    unreadable file) is set aside and the one before it is tried. A checkpoint of another app or model shape is
    refused in one line, before anything is loaded or written. A checkpoint saved by another number of processes
    loads too: DCP reshards the model and optimizer, and the data loader's unread data is re-partitioned.
    """
    while True:
        choice = broadcast_object(_pick_checkpoint(checkpoints, model, app, args) if launch.rank == 0 else None)
        if isinstance(choice, UserError) or choice is None:
            if choice is not None:
                raise choice
            return None
        path = Path(choice)
        try:
            states, damage = checkpoints.load(path, model, optimizer), None
        except DamagedCheckpoint as e:
            states, damage = None, str(e)
        damage = agreed_failure(damage)  # a file that one rank alone could not read is damaged for all of them
        if damage is not None:
            if launch.rank == 0:
                _set_aside(checkpoints, path, DamagedCheckpoint(damage))
            barrier()
            continue
        logger.info(f"resumed from {path}")
        report_changes(verify(path)["config"], args, states[0]["step"])
        if len(states) == launch.world_size:
            return states[launch.rank]
        logger.warning(f"the checkpoint was saved by {len(states)} process(es), this run has {launch.world_size}: "
                       "the masking random state starts afresh on every rank")
        old = [s["data"] for s in states]
        data = on_every_rank(lambda: app.data.repartition(old, launch.world_size, args.data))[launch.rank]
        return {**states[0], "data": data, "generator": None}


def _pick_checkpoint(checkpoints: CheckpointManager, model, app: App, args) -> str | UserError | None:
    """Rank 0: the newest checkpoint whose files are all there and whose model fits, as a path; a UserError to
    raise on every rank; None for a new run."""
    for path in reversed(checkpoints.complete_checkpoints()):
        try:
            saved = verify(path)
            check_same_model(path, saved, saved_shapes(path), model, app, args)
            return str(path)
        except DamagedCheckpoint as e:
            _set_aside(checkpoints, path, e)
        except UserError as e:
            return e
    if checkpoints.damaged_checkpoints():
        return UserError(f"no checkpoint in {checkpoints.folder} loads (the damaged ones are kept as *.damaged): "
                         "delete them to start this run from scratch, or use another dump_dir")
    if (checkpoints.folder.parent / "consolidated.pt").exists():  # its history would be overwritten
        return UserError(f"{checkpoints.folder.parent} holds the export of a finished run but no checkpoint to "
                         "resume from: use another dump_dir (init_from= starts from its weights)")
    return None


ARCHITECTURE_KEYS = ("dim", "n_layers", "n_heads", "head_dim", "ffn_multiple_of", "norm_eps", "rope_theta",
                     "scale_embeddings", "output_bias")


def check_same_model(path: Path, saved: dict, shapes: dict, model, app: App, args) -> None:
    """The checkpoint is of this app, its tensors fit the model, and no architecture setting changed (some, like
    n_heads at a fixed dim, change the computation but not the shapes)."""
    run = path.parent.parent
    if saved["app"] != app.name:
        raise UserError(f"{run} holds a run of {saved['app']}, not {app.name}: use another dump_dir")
    architecture = architecture_changes(saved["config"], args)
    mismatched = shape_mismatches(shapes, model)
    if architecture or mismatched:
        raise UserError(f"{run} holds a model of another shape ({', '.join(architecture) or 'tensor ' + mismatched[0]}"
                        "): resume with its config, or use another dump_dir")


def architecture_changes(old_config: dict, args) -> list[str]:
    """'key old -> new' for each architecture setting (and the tokenizer) that differs from a saved config."""
    changes = config_changes(old_config, to_dict(args))
    architecture = [key for key in changes if key == "data.tokenizer.name"
                    or (key.startswith("model.") and key.rsplit(".", 1)[-1] in ARCHITECTURE_KEYS)]
    return [f"{key} {changes[key][0]} -> {changes[key][1]}" for key in architecture]


def _set_aside(checkpoints: CheckpointManager, path: Path, error: DamagedCheckpoint) -> None:
    aside = checkpoints.set_aside(path)
    logger.warning(f"checkpoint {path.name} is damaged ({error}): set aside as {aside.name}; trying the one before it")


def report_changes(old_config: dict, args, step: int) -> None:
    changes = config_changes(old_config, to_dict(args))
    if changes:
        listed = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items())
        logger.warning(f"resuming with changed settings: {listed}")
    if "steps" in changes and step < args.steps:
        logger.warning(f"the learning-rate schedule is now that of a {args.steps}-step run: step {step + 1} uses lr "
                       f"{lr_at(step, args.optim, args.steps):.3g} (warm-up {args.optim.warmup} steps, cosine to "
                       f"{args.optim.lr_min:g} at step {args.steps})")


def evaluate(step, model, tokenizer, val_tokens, args, device, metrics, launch: Launch, guard: NonFiniteGuard) -> None:
    """Validation loss and, when configured, the frozen GLUE probes, at their intervals (on a finite model). Every
    rank takes part (a sharded model computes with all of them); rank 0 logs."""
    validating = val_tokens is not None and (step % args.validation.every == 0 or step == args.steps)
    probing = args.eval.every > 0 and step % args.eval.every == 0
    if validating or probing:
        guard.check()
    if validating:
        record = {"step": step, **validate(model, val_tokens, args.validation, device, launch)}
        if not math.isfinite(record["val/loss"]):
            guard.stop(f"the validation loss is {record['val/loss']} at step {step}")
        metrics.log(record)
        logger.info(f"step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
    if probing:
        scores = run_glue_probes(model, tokenizer, args.eval, device)
        metrics.log({"step": step, **scores})
        logger.info(f"step {step} | " + " | ".join(f"{k} {v:.1f}" for k, v in scores.items()))


class Window:
    """Means of per-step scalars since the last log line, summed on the device so steps do not wait for the host."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, **values: torch.Tensor) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0) + value.detach().float()
        self.count += 1

    def means(self) -> dict[str, float]:
        """Means over the window's steps and over all ranks (one reduction, one host sync)."""
        keys = list(self.sums)
        totals = all_reduce(torch.stack([self.sums[k] for k in keys])) / (self.count * rank_and_world()[1])
        self.sums, self.count = {}, 0
        return dict(zip(keys, totals.tolist()))


def train_step(model, loader, generator, args, device):
    """One optimizer step's forward/backward over grad_acc_steps micro-batches: the mean loss, the mean of each of the
    model's stats, the number of predicted tokens, and the seconds spent waiting for the data loader. Gradients are
    reduced across ranks on the last micro-batch only."""
    total_loss, totals, predicted, waited = 0.0, {}, 0, 0.0
    for micro in range(args.grad_acc_steps):
        set_gradient_sync(model, micro == args.grad_acc_steps - 1)
        before = time.perf_counter()
        tokens = next(loader)
        waited += time.perf_counter() - before
        batch = model.make_batch(tokens.to(device, non_blocking=True), generator)
        with autocast(device):
            loss, stats = model(**batch)
        (loss / args.grad_acc_steps).backward()
        total_loss = total_loss + loss.detach() / args.grad_acc_steps
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value.detach().float() / args.grad_acc_steps
        predicted += model.predicted_tokens(batch)
    return total_loss, totals, predicted, waited


def reduce_over_ranks(record: dict, device: torch.device, maximum: tuple[str, ...], total: tuple[str, ...]) -> dict:
    """Per-rank host values of a log record: the largest over ranks (memory, data wait) or their sum."""
    if rank_and_world()[1] == 1:
        return {}
    largest = all_reduce(torch.tensor([record[k] for k in maximum], dtype=torch.float64, device=device), "max")
    summed = all_reduce(torch.tensor([record[k] for k in total], dtype=torch.float64, device=device))
    return {**dict(zip(maximum, largest.tolist())), **{k: int(v) for k, v in zip(total, summed.tolist())}}


def clip_gradients(model, max_norm: float) -> torch.Tensor:
    """The global gradient norm before clipping (over all shards), as a plain tensor on this rank's device."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def main(app: App, argv: list[str] | None = None) -> None:
    """The command line of every app's train.py; exits with the status documented at the top of this module."""
    with command_line(f"python -m {app.name} config=PATH [key=value ...]: trains, or resumes, the run in dump_dir"):
        args = load_config(app.args_cls, sys.argv[1:] if argv is None else argv)
    try:
        summary = train(app, args)
    except UserError as e:
        _fail(str(e), 2)
    except OSError as e:  # a full disk or a lost mount while writing logs, metrics or the export
        _fail(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}", 2)
    except Diverged as e:
        _fail(str(e), EXIT_DIVERGED)
    except KeyboardInterrupt:
        _fail("interrupted: nothing was saved since the last checkpoint", 130)
    if summary["stopped_by"] and summary["stopped_by"] != args.distributed.stop_signal:
        sys.exit(EXIT_STOPPED)


def _fail(message: str, status: int):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)
