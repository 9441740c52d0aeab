"""The one training loop shared by every app.

An app (apps/<name>/train.py) supplies only its model and config: `App(name, args_cls, build_model)`, following the
contract in lingua/app.py. Everything about a run lives in its `dump_dir`; restarting with the same dump_dir
resumes from the newest checkpoint that loads and continues exactly, on the same or another number of processes
(lingua/training/resume.py).

The same command runs in one process, under `torchrun` or under SLURM's `srun` (lingua/distributed.py): each rank
trains on its own share of the data; gradients are reduced by FSDP2; only rank 0 writes logs and metrics, whose
values are means over all ranks. Every decision that all ranks must share comes from one reduced value
(lingua/training/lifecycle.py: `agree`), never from a rank's own state.

Exit status of `main`: 0 the run finished (or had nothing left to do); 2 a one-line error (a bad config or input,
a refused start, a failed write, a collective that timed out); EXIT_STOPPED a stop signal saved a checkpoint (the
same command resumes); EXIT_DIVERGED the loss or gradient became non-finite (nothing non-finite was saved); 130
interrupted without saving. The preemption signal (`lifecycle.stop_signal`, SIGUSR2: a cluster taking the
machines back) saves a checkpoint and exits 0 on every rank, so torchrun and srun see a clean end; under SLURM the
job is requeued and resumes by itself.
"""

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lingua.app import App, build_model
from lingua.args import command_line, config_changes, dump_config, load_config, to_dict
from lingua.checkpoint.store import CheckpointArgs, CheckpointManager, TrainState, save_consolidated
from lingua.data.loader import DataArgs, ReadAhead
from lingua.data.tokenizer import build_tokenizer, recorded
from lingua.distributed import (
    DistributedArgs,
    Launch,
    collective_failure,
    destroy_process_group,
    detect_launch,
    fail_together,
    init_process_group,
    on_every_rank,
    on_rank_zero,
    resolve_device,
)
from lingua.errors import UserError, at_least, require
from lingua.files.safe import atomic_write, remove_partial_writes
from lingua.metrics import (
    LoggingArgs,
    MetricLogger,
    Throughput,
    Window,
    check_logging,
    format_progress,
    peak_flops,
    peak_memory_gib,
    reduce_over_ranks,
    setup_logging,
)
from lingua.model.flops import count_params
from lingua.run_folder import RunFolder
from lingua.training.batch_warmup import BatchWarmupArgs, check_batch_warmup, micro_batches_at
from lingua.training.divergence import Diverged, NonFiniteGuard
from lingua.training.ema import EmaArgs, WeightsAverage, weights_scored_by
from lingua.training.lifecycle import (
    LifecycleArgs,
    RunLock,
    StopSignal,
    agree,
    requeue_slurm_job,
    stop_signals_held_for_the_main_thread,
)
from lingua.training.memory import memory_shortfall
from lingua.training.optim import OptimArgs, build_optimizer, check_schedule, lr_at, set_lr
from lingua.training.resume import (
    Start,
    architecture_changes,
    continue_run,
    data_setting_changes,
    open_start,
    resume,
)
from lingua.training.step import training_step
from lingua.training.validation import EvalContext, ValidationArgs, build_evaluations, check_evaluations

logger = logging.getLogger(__name__)

EXIT_STOPPED = 3
EXIT_DIVERGED = 4


@dataclass
class TrainArgs:
    dump_dir: str  # the run's folder: config, logs, metrics, checkpoints; an existing run resumes
    name: str = "run"  # shown in logs and wandb
    seed: int = 42  # model init and masking draws (the data order has data.seed)
    steps: int = 1000  # optimizer steps in all
    grad_acc_steps: int = 1  # micro-batches accumulated per optimizer step
    batch_warmup: BatchWarmupArgs = field(default_factory=BatchWarmupArgs)  # fewer micro-batches per step at first
    device: str = "auto"  # auto: each rank's GPU if there is one, else the CPU
    init_from: str = ""  # a new run starts from these weights (checkpoint folder, dump_dir or consolidated.pt)
    # a new run continues another run's training from its checkpoint (DUMP_DIR: its newest, or DUMP_DIR/checkpoints/N):
    # weights, optimizer, step, tokens and data position; recorded as the exact checkpoint. A WSD decay branch, or a
    # phase (data.seq_len with the model's max_seqlen and rope_theta, the data mix, the mask ratio)
    continue_from: str = ""
    phase: str = ""  # the continued run's phase, recorded in its config (default: branch, or phase if data or model
    # settings changed)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    validation: ValidationArgs = field(default_factory=ValidationArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)  # processes, sharding, compile
    lifecycle: LifecycleArgs = field(default_factory=LifecycleArgs)  # the stop signal and SLURM's requeue
    ema: EmaArgs = field(default_factory=EmaArgs)  # an exponential moving average of the weights

    def __post_init__(self):
        require(bool(self.dump_dir.strip()), "dump_dir", "is empty: name the run's folder")
        at_least(self, 1, "steps", "grad_acc_steps")
        at_least(self, 0, "seed")
        check_batch_warmup(self.batch_warmup, self.grad_acc_steps)
        require(not (self.init_from and self.continue_from), "continue_from",
                "and init_from exclude each other (continue_from carries the weights as well)")
        check_schedule(self.optim, self.steps)


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


def train(app: App, config) -> dict[str, Any]:
    """Trains, or resumes, the run in config.dump_dir, in this process and the others of its launch. The dump_dir is
    locked for the run; nothing in it is written before the start has succeeded (config checked, checkpoint
    loaded, data found)."""
    launch = detect_launch()
    start = open_start(app, config, RunFolder(Path(config.dump_dir)), launch.world_size)  # its folder, made once here
    config = resolve_config(app, config, start)
    device = resolve_device(config.device, launch.local_rank)
    check_evaluations(app, config, launch.world_size)
    with stop_signals_held_for_the_main_thread(config.lifecycle.stop_signal):
        init_process_group(launch, device, config.distributed.timeout_minutes)
        activity = Activity("the start-up")
        try:
            fail_together(memory_shortfall(app, config, device, launch))  # before anything is allocated or written
            run = start.run
            on_rank_zero(lambda: _make_folder(run.root))
            with RunLock(run) as lock:
                on_every_rank(lambda: setup_logging(run.log, launch.rank, lock.lost))
                return Trainer(app, config, start, device, launch, activity, lock).fit()
        except RuntimeError as e:
            kind = collective_failure(e)
            if kind is None:
                raise
            raise activity.failed(kind, launch.rank, config.distributed.timeout_minutes) from None
        finally:
            destroy_process_group()


def resolve_config(app: App, config, start: Start):
    """The run's config as it trains: the app's decisions from what the run starts from (e.g. the shapes of
    init_from) and the sha256 of a Hugging Face tokenizer's file, checked before anything starts. The caller's
    config is left as it is."""
    if app.configure is not None:
        config = app.configure(config, start)
    config = replace(config, data=replace(config.data, tokenizer=recorded(config.data.tokenizer)))
    config = recorded_continuation(config, start)
    check_logging(config.logging)
    if config.data.seq_len > config.model.encoder.max_seqlen:
        raise UserError(f"data.seq_len ({config.data.seq_len}) exceeds model.encoder.max_seqlen "
                        f"({config.model.encoder.max_seqlen}), the length of the position table")
    return config


def recorded_continuation(config, start: Start):
    """A continued run's config names the exact checkpoint it continues from and its phase; resumed, it keeps what
    its first start recorded (its parent may have newer checkpoints since)."""
    if start.continued is not None:
        parent, this = start.continued.config, to_dict(config)
        changed = [key for key, (old, new) in config_changes(parent, this).items() if key.startswith("model.")] \
            + data_setting_changes(parent["data"], this["data"])
        return replace(config, continue_from=str(start.continued.path.resolve()),
                       phase=config.phase or ("phase" if changed else "branch"))
    recorded = (start.resumed or {}).get("continue_from")
    if recorded:  # a plain resume of a continued run keeps its parent: the scaling tools read the family by it
        return replace(config, continue_from=recorded, phase=start.resumed.get("phase", config.phase))
    return config


def _make_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise UserError(f"dump_dir {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create dump_dir {folder}: {e.strerror}") from None


class Trainer:
    """One run on this rank: set up on construction (model, optimizer, resume, data, evaluation), trained by `fit`.
    Every write into the run folder is fenced by the run's lease (`lock.lost`, checked on rank 0 right before it),
    and a lost lease is a failure of the agreement after every step: a process whose lease was taken over while it
    stalled writes nothing more and stops."""

    def __init__(self, app: App, config, start: Start, device: torch.device, launch: Launch, activity: Activity,
                 lock: RunLock):
        self.app, self.config, self.run, self.device, self.launch, self.activity, self.lock = \
            app, config, start.run, device, launch, activity, lock
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        self.model = build_model(app.build_model, config.model, self.tokenizer, device, config.seed,
                                 (config.distributed, launch), plan=app.parallelize)
        self.model.separate_documents(app.data.document_start(config.data, self.tokenizer))
        check_batch_shape(self.model, app.data.row_shape(config.data), device)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.average = WeightsAverage.of(self.model, config.ema)  # None when the run keeps none
        self.params = {"app": app.name, "config": to_dict(config)}
        self.checkpoints = CheckpointManager(self.run.checkpoints, config.checkpoint, lock.lost)
        on_rank_zero(lambda: self.checkpoints.check_folder(self.run))
        self.checkpoints.remove_leftovers()
        if launch.rank == 0:
            for partial in remove_partial_writes(self.run.root):
                logger.info(f"removed {partial.name}, left by a process killed while writing it")
        self.generator = torch.Generator(device).manual_seed(config.seed + launch.rank)  # the masking's draws
        self.state = self._start_state(start)  # init_from's weights are read there, then let go
        self._start_average()
        self.throughput = Throughput(self.model, config.data.batch_size, math.prod(app.data.row_shape(config.data)),
                                     config.data.seq_len, launch.world_size, peak_flops(config.logging, device),
                                     self.state.data_tokens)
        self.guard, self.window = NonFiniteGuard(device, self.checkpoints.latest), Window()
        self.evaluations = build_evaluations(app, EvalContext(self.model, self.tokenizer, config, device, launch,
                                                              self.guard, self.average))
        logger.info(
            f"{app.name}: {count_params(self.model):,} parameters ({count_params(self.model, embeddings=False):,} "
            f"outside the embedding) on {launch.world_size} process(es) ({launch.source}, {device.type}"
            f"{', ' + config.distributed.fsdp_type if dist.is_initialized() else ''}), {config.steps} steps of "
            f"{self.throughput.data_tokens(config.grad_acc_steps):,} data tokens over all processes"
            + (f" (from {self.throughput.data_tokens(config.batch_warmup.start):,} during the batch warm-up's first "
               f"{config.batch_warmup.tokens:,} tokens)" if config.batch_warmup.start else "")
        )

    def _start_state(self, start: Start) -> TrainState:
        """The resumed checkpoint's state, or a new run's: continued from another run's checkpoint, or from
        `init_from`'s weights when given."""
        config = self.config
        average = self._average_state()
        saved = resume(start, self.checkpoints, self.model, self.optimizer, self.app, config, self.launch, average)
        if saved is None and start.continued is not None:
            saved = continue_run(start, self.model, self.optimizer, self.app, config, self.launch, average)
        if saved is not None:
            state = TrainState.from_dict(saved)
            if state.generator is not None:
                self.generator.set_state(torch.tensor(state.generator, dtype=torch.uint8))
            return state
        if start.init_from is not None:
            changed = architecture_changes(self._load_init(start.init_from), config)
            if changed:
                raise UserError(f"init_from {config.init_from} is a model of another architecture "
                                f"({', '.join(changed)})")
            logger.info(f"initialised the model from {config.init_from} (weights only: step, optimizer and data start "
                        "afresh)")
        return TrainState()

    def _start_average(self) -> None:
        """The weights' average goes on from the checkpoint's; where it holds none (a new run, or one that turned
        ema.decay on), it starts at the weights the run starts from."""
        if self.average is None:
            self.state.ema_from = None
        elif self.state.ema_from is None:
            self.average.restart()
            self.state.ema_from = self.state.step

    def _average_state(self) -> dict | None:
        return None if self.average is None else self.average.state_dict()

    def _load_init(self, checkpoint) -> dict:
        """init_from's weights into the model (the app's way, when it has one); the config they were trained with."""
        try:
            if self.app.load_init is not None:
                return self.app.load_init(checkpoint, self.model)
            checkpoint.load_into(self.model)
            return checkpoint.config
        except UserError as e:
            raise UserError(f"init_from: {e}") from None

    def fit(self) -> dict[str, Any]:
        config, state, activity = self.config, self.state, self.activity
        step, first_loss, self.last = state.step, None, {}
        if step >= config.steps:
            logger.info(f"{self.run.root} already holds a finished run of {step} steps: nothing to train")
        start = time.perf_counter()
        with (
            on_every_rank(lambda: ReadAhead(self.app.data.build_loader(config.data, self.tokenizer, self.launch.rank,
                                                                       self.launch.world_size, state.data),
                                            self.device)) as loader,
            on_every_rank(lambda: MetricLogger(self.run.metrics, step, config.logging, self.params["config"],
                                               self.launch.rank == 0, self.lock.lost, self.run.tensorboard)) as metrics,
            StopSignal(config.lifecycle.stop_signal, config.distributed.timeout_minutes) as stop,
        ):
            if step < config.steps:  # the start has succeeded: the run's config now
                on_rank_zero(lambda: self._write(self.run.config, lambda path: dump_config(config, path)))
            activity.now = f"the agreement before step {step + 1}"
            stopping = step < config.steps and agree(stop, loader.prepare(self._micro_batches()) or self.lock.lost())
            if state.evaluation_skipped and not stopping:  # the stop that saved this checkpoint skipped it
                activity.now = f"the evaluation at step {step}"
                self._evaluate(step, metrics)
            while step < config.steps and not stopping:
                activity.now = f"step {step + 1}"
                lr, result = self._step(step, loader)
                step += 1
                before = time.perf_counter()
                failure = loader.prepare(self._micro_batches()) if step < config.steps else None  # the next step's
                self.throughput.step(result.predicted_tokens, time.perf_counter() - before)
                activity.now = f"the agreement after step {step}"
                stopping = agree(stop, failure or metrics.failure or self.lock.lost())
                if step % config.logging.freq == 0 or step == config.steps:
                    activity.now = f"the log line of step {step}"
                    self._log(step, lr, loader, metrics)
                    first_loss = self.last["loss"] if first_loss is None else first_loss
                pause = time.perf_counter()
                if not stopping:  # on a stop signal, save at once: the job may have little time left
                    activity.now = f"the evaluation at step {step}"
                    self._evaluate(step, metrics)
                if step % config.checkpoint.every == 0 or step == config.steps or stopping:
                    activity.now = f"saving checkpoint {step}"
                    self._save(step, loader, bool(stopping))
                self.throughput.exclude(time.perf_counter() - pause)
            activity.now = "the last agreement"
            fail_together(metrics.failure)  # a record of the last step that could not be written
        if step == config.steps:
            activity.now = "saving consolidated.pt"
            if self.average is not None:  # written first: a finished run (it has consolidated.pt) has both
                with self.average.swapped_in():
                    save_consolidated(self.model, self.params, self.run.consolidated_ema, self.lock.lost)
            else:  # an average an earlier start of this run kept would be older than these weights
                on_rank_zero(lambda: self._write(self.run.consolidated_ema, lambda path: path.unlink(missing_ok=True)))
            save_consolidated(self.model, self.params, self.run.consolidated, self.lock.lost)
        return self._summary(step, first_loss, time.perf_counter() - start, stop.agreed)

    def _summary(self, step: int, first_loss: float | None, seconds: float, stopped_by: str | None) -> dict[str, Any]:
        """What the run did, logged and returned; a run stopped by the preemption signal asks SLURM to requeue it."""
        summary = {"steps": step, "first_loss": first_loss, "final_loss": self.last.get("loss"),
                   "data_tokens": self.state.data_tokens, "seconds": round(seconds, 1), "stopped_by": stopped_by,
                   "requeued": bool(stopped_by) and requeue_slurm_job(stopped_by, self.config.lifecycle)}
        logger.info(summary_line(summary))
        return summary

    def _step(self, step: int, loader: ReadAhead):
        """Optimizer step `step + 1` (its learning rate, micro-batches, update), counted and checked; returns its
        learning rate and result."""
        config = self.config
        lr = lr_at(step, config.optim, config.steps)
        set_lr(self.optimizer, lr)
        batches = [self.model.make_batch(next(loader), self.generator) for _ in range(self._micro_batches())]
        result = training_step(self.model, self.optimizer, batches, config.optim.clip)
        if self.average is not None:
            self.average.update()
        self.guard.update(step + 1, result.loss, result.grad_norm)
        self.state.data_tokens += self.throughput.data_tokens(len(batches))
        self.window.add(loss=result.loss, grad_norm=result.grad_norm, **result.stats)
        return lr, result

    def _micro_batches(self) -> int:
        """Micro-batches of the next optimizer step: grad_acc_steps, fewer during the batch warm-up."""
        return micro_batches_at(self.config.batch_warmup, self.config.grad_acc_steps, self.state.data_tokens)

    def _log(self, step: int, lr: float, loader: ReadAhead, metrics: MetricLogger) -> None:
        """The window's means over steps and ranks, throughput and compute: one metrics record and one log line."""
        self.guard.check()
        data_tokens = self.state.data_tokens
        record = {"step": step, **self.window.means(), "lr": lr, **self.throughput.report(data_tokens),
                  "data_tokens": data_tokens, **self._compute(data_tokens),
                  "memory_gib": peak_memory_gib(self.device), "malformed_lines": loader.malformed_lines,
                  "new_malformed_lines": loader.new_malformed_lines()}
        record |= reduce_over_ranks(record, self.device, maximum=("memory_gib", "data_wait"),
                                    total=("malformed_lines", "new_malformed_lines"))
        metrics.log(record)
        logger.info(format_progress(record, self.config.steps))
        self.last = record

    def _compute(self, data_tokens: int) -> dict[str, float]:
        """The compute spent up to `data_tokens`: that of the phases before this run's (a continued run's parents,
        each at its own FLOPs per token: a phase may change the sequence length or the mask ratio), then this one's."""
        start = self.state.phase_start or {}
        since = self.throughput.compute((data_tokens - start.get("data_tokens", 0)) * self.model.views_per_sequence)
        return {key: flops + start.get(key, 0) for key, flops in since.items()}

    def _evaluate(self, step: int, metrics: MetricLogger) -> None:
        """The evaluations due at this step, on finite weights only, each logged; a new best of an evaluation's
        keep_best metric saves its weights (the same record on every rank: evaluations are reduced)."""
        due = [evaluation for evaluation in self.evaluations if evaluation.due(step)]
        if due:
            self.guard.check()
        for evaluation in due:
            record = {"step": step, **evaluation.run(step)}
            metrics.log(record)
            logger.info(f"step {step} | " + " | ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step"))
            if evaluation.keep_best:
                self._keep_best(evaluation, record)

    def _keep_best(self, evaluation, record: dict) -> None:
        key = evaluation.keep_best
        if key not in record:
            raise UserError(f"{evaluation.name}.keep_best: the {evaluation.name} has no metric {key!r} (it logs "
                            f"{', '.join(k for k in record if k != 'step')})")
        if self.state.best is None or record[key] > self.state.best[key]:
            self.state.best = record
            with weights_scored_by(key, self.average):
                save_consolidated(self.model, self.params, self.run.best_weights, self.lock.lost)
            on_rank_zero(lambda: self._write(self.run.best_record, lambda path: atomic_write(
                path, json.dumps(record, indent=1) + "\n")))

    def _write(self, path: Path, write) -> None:
        """Rank 0: `write(path)` into the run folder, if this process still holds the run; a failure is one line."""
        lost = self.lock.lost()
        if lost is not None:
            raise UserError(lost)
        try:
            write(path)
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror}") from None

    def _save(self, step: int, loader: ReadAhead, stopping: bool) -> None:
        self.guard.check_before_save(self.model, step)  # a non-finite state never becomes a checkpoint
        self.state.step, self.state.data, self.state.evaluation_skipped = step, loader.state_dict(), stopping
        self.state.generator = self.generator.get_state().tolist()
        self.state.compute = self._compute(self.state.data_tokens)
        self.checkpoints.save(step, self.model, self.optimizer, self.state.state_dict(), self.params,
                              self._average_state())


def summary_line(summary: dict[str, Any]) -> str:
    """`_summary`'s dict for people: "summary: 300 steps | 307,200 data tokens | 200.1 s | first loss 10.6 | final
    loss 7.29 | stopped: no"."""
    losses = [f"{which} loss {summary[f'{which}_loss']:.3g}" for which in ("first", "final")
              if summary[f"{which}_loss"] is not None]
    stopped = f"by {summary['stopped_by']}{', requeued' if summary['requeued'] else ''}" if summary["stopped_by"] \
        else "no"
    return " | ".join([f"summary: {summary['steps']:,} steps", f"{summary['data_tokens']:,} data tokens",
                       f"{summary['seconds']:,.1f} s", *(losses or ["no loss logged"]), f"stopped: {stopped}"])


def check_batch_shape(model, row_shape: tuple[int, ...], device: torch.device) -> None:
    """The app can make a batch of rows of this shape (e.g. its mask ratio masks at least one token); checked at the
    start with a throwaway generator, so the run's random draws are untouched."""
    tokens = torch.zeros(1, *row_shape, dtype=torch.long, device=device)
    model.make_batch(tokens, torch.Generator(device).manual_seed(0))


def main(app: App, argv: list[str] | None = None) -> None:
    """The command line of every app's train.py; exits with the status documented at the top of this module."""
    with command_line(f"python -m {app.name} config=PATH [key=value ...]: trains, or resumes, the run in dump_dir"):
        config = load_config(app.args_cls, sys.argv[1:] if argv is None else argv)
    try:
        summary = train(app, config)
    except UserError as e:
        _fail(str(e), 2)
    except OSError as e:  # a full disk or a lost mount while writing logs, metrics or the weights
        _fail(f"{e.strerror or e}{f': {e.filename}' if e.filename else ''}", 2)
    except Diverged as e:
        _fail(str(e), EXIT_DIVERGED)
    except KeyboardInterrupt:
        _fail(f"interrupted without saving: {_resumes_from(config)}", 130)
    if summary["stopped_by"] and summary["stopped_by"] != config.lifecycle.stop_signal:
        sys.exit(EXIT_STOPPED)


def _resumes_from(config) -> str:
    """What the same command resumes from after an interruption: the newest checkpoint, or none."""
    checkpoints = CheckpointManager(RunFolder(Path(config.dump_dir)).checkpoints, config.checkpoint)
    try:
        return checkpoints.kept()
    except OSError as e:
        return f"the checkpoints in {checkpoints.folder} cannot be listed ({e.strerror})"


def _fail(message: str, status: int):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(status)
