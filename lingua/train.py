"""The one training loop shared by every app.

An app (apps/<name>/train.py) supplies only its model and config: `App(name, args_cls, build_model)`. The model
owns its masking (`make_batch`, random draws from a generator the loop checkpoints), its loss (`forward`) and its
FLOPs per token (`flops_per_token_view`). Everything about a run lives in its `dump_dir`; restarting with the same
dump_dir resumes from the newest complete checkpoint and continues exactly.
"""

import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lingua.args import UserError, dump_config, load_config, to_dict
from lingua.checkpoint import (
    CheckpointArgs,
    CheckpointManager,
    export_consolidated,
    rank_and_world,
)
from lingua.data import DataArgs, build_train_loader, load_validation
from lingua.flops import count_params
from lingua.glue import GlueEvalArgs, check_args, run_glue_probes
from lingua.metrics import (
    LoggingArgs,
    MetricLogger,
    format_progress,
    peak_memory_gib,
    setup_logging,
)
from lingua.optim import OptimArgs, build_optimizer
from lingua.tokenizer import build_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ValidationArgs:
    every: int = 100  # steps between validations; 0 disables
    n_sequences: int = 64  # fixed held-out sequences
    batch_size: int = 16
    seed: int = 1234  # the masking of the validation set is the same at every validation and in every run


@dataclass
class TrainArgs:
    dump_dir: str
    name: str = "run"
    seed: int = 42
    steps: int = 1000
    grad_acc_steps: int = 1
    device: str = "auto"  # auto: cuda if available, else cpu
    compile: bool = False  # torch.compile the model's forward (shapes are static)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    validation: ValidationArgs = field(default_factory=ValidationArgs)
    eval: GlueEvalArgs = field(default_factory=GlueEvalArgs)  # frozen GLUE probes every eval.every steps (0: off)


@dataclass
class App:
    name: str  # the module that defines APP, e.g. "apps.bert.train"; stored with checkpoints to rebuild the model
    args_cls: type
    build_model: Callable[[Any, Any], torch.nn.Module]


class StopSignal:
    """SIGTERM / SIGUSR2 (SLURM's warning before a kill) request a checkpoint and a clean stop."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        logger.warning(f"received {signal.Signals(signum).name}: saving a checkpoint and stopping")
        self.requested = True


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device):
    """bf16 mixed precision on GPU; full precision on CPU, where bf16 matmuls are slow."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_model(app: App, args, tokenizer, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = app.build_model(args.model, tokenizer)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model


@torch.no_grad()
def validate(model, tokens: torch.Tensor, args: ValidationArgs, device: torch.device) -> dict[str, float]:
    """Loss and accuracy on fixed sequences with a fixed masking seed: comparable across steps and runs."""
    model.eval()
    generator = torch.Generator(device).manual_seed(args.seed)
    totals = {"loss": 0.0, "accuracy": 0.0}
    for chunk in tokens.split(args.batch_size):
        with autocast(device):
            loss, stats = model(**model.make_batch(chunk.to(device), generator))
        totals["loss"] += loss.item() * len(chunk)
        totals["accuracy"] += stats["accuracy"].item() * len(chunk)
    model.train()
    return {f"val/{k}": v / len(tokens) for k, v in totals.items()}


class Throughput:
    """Tokens per second and MFU over the steps since the last report."""

    def __init__(self, model, args: TrainArgs, world_size: int):
        seqs = args.data.batch_size * args.grad_acc_steps * world_size
        self.per_step = {
            "data_tokens": seqs * args.data.seq_len,
            "token_views": seqs * args.data.seq_len * model.views_per_sequence,
        }
        self.flops_per_view = model.flops_per_token_view(args.data.seq_len)
        self.peak = args.logging.peak_tflops * 1e12 * world_size
        self.start, self.steps, self.predicted = time.perf_counter(), 0, 0

    def exclude(self, seconds: float) -> None:
        """Time spent outside training steps (validation, probes, checkpoints) does not count."""
        self.start += seconds

    def step(self, predicted_tokens: int) -> None:
        self.steps += 1
        self.predicted += predicted_tokens

    def report(self) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        views_per_s = self.steps * self.per_step["token_views"] / elapsed
        out = {
            "data_tokens_per_s": self.steps * self.per_step["data_tokens"] / elapsed,
            "token_views_per_s": views_per_s,
            "predicted_tokens_per_s": self.predicted / elapsed,
            "mfu": self.flops_per_view * views_per_s / self.peak,
        }
        self.start, self.steps, self.predicted = time.perf_counter(), 0, 0
        return out


def train(app: App, args) -> dict[str, Any]:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would think it is rank 0 and share one dump_dir
        raise UserError("multi-process training (torchrun, SLURM tasks) is not supported yet: run one process")
    if args.data.seq_len > args.model.encoder.max_seqlen:
        raise UserError(f"data.seq_len ({args.data.seq_len}) exceeds model.encoder.max_seqlen "
                        f"({args.model.encoder.max_seqlen}), the length of the position table")
    dump_dir = Path(args.dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(dump_dir / "train.log")
    dump_config(args, dump_dir / "config.yaml")
    rank, world_size = rank_and_world()
    device = resolve_device(args.device)
    tokenizer = build_tokenizer(args.data.tokenizer)
    model = build_model(app, args, tokenizer, device)
    optimizer, scheduler = build_optimizer(model, args.optim, args.steps)
    generator = torch.Generator(device).manual_seed(args.seed + rank)  # the masking's random draws
    params = {"app": app.name, "config": to_dict(args)}
    checkpoints = CheckpointManager(dump_dir / "checkpoints", args.checkpoint)

    state = {"step": 0, "data": None, "data_tokens": 0}
    latest = checkpoints.latest()
    if latest is not None:
        state = checkpoints.load(latest, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))

    if args.eval.every > 0:
        check_args(args.eval)  # a bad GLUE path fails now, not at the first evaluation
        args.eval.max_len = min(args.eval.max_len or args.data.seq_len, args.model.encoder.max_seqlen)
    val_tokens = None
    if args.validation.every > 0:
        val_tokens = load_validation(args.data, tokenizer, args.validation.n_sequences, rank, world_size)
    forward = torch.compile(model) if args.compile else model
    throughput = Throughput(model, args, world_size)
    logger.info(
        f"{app.name}: {count_params(model):,} parameters ({count_params(model, embeddings=False):,} outside the "
        f"embedding) on {device}, {args.steps} steps of {throughput.per_step['data_tokens']:,} data tokens"
    )

    step, first_loss, last = state["step"], None, {}
    if step >= args.steps:
        logger.info(f"{dump_dir} already holds a finished run of {step} steps: nothing to train")
    window = Window()
    start = time.perf_counter()
    with (
        MetricLogger(dump_dir / "metrics.jsonl", state["step"], args.logging, params["config"]) as metrics,
        build_train_loader(args.data, tokenizer, rank, world_size, state["data"]) as loader,
        StopSignal() as stop,
    ):
        while step < args.steps and not stop.requested:
            loss, accuracy, predicted = train_step(model, forward, loader, generator, args, device)
            grad_norm = clip_gradients(model, args.optim.clip)
            lr = scheduler.get_last_lr()[0]  # the rate this step uses
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            state["data_tokens"] += throughput.per_step["data_tokens"]
            throughput.step(predicted)
            window.add(loss=loss, accuracy=accuracy, grad_norm=grad_norm)

            if step % args.logging.freq == 0 or step == args.steps:
                last = {"step": step, **window.means(), "lr": lr, **throughput.report(),
                        "data_tokens": state["data_tokens"],
                        "compute_flops": state["data_tokens"] * model.views_per_sequence * throughput.flops_per_view,
                        "memory_gib": peak_memory_gib(device), "malformed_lines": loader.malformed_lines}
                if not math.isfinite(last["loss"]):
                    raise RuntimeError(f"loss is {last['loss']} at step {step}")
                first_loss = last["loss"] if first_loss is None else first_loss
                metrics.log(last)
                logger.info(format_progress(last, args.steps))
            pause = time.perf_counter()
            if not stop.requested:  # on a stop signal, save at once: the job may have little time left
                evaluate(step, model, tokenizer, val_tokens, args, device, metrics, rank)
            if step % args.checkpoint.every == 0 or step == args.steps or stop.requested:
                state.update(step=step, data=loader.state_dict(), scheduler=scheduler.state_dict(),
                             generator=generator.get_state().tolist())
                checkpoints.save(step, model, optimizer, state, params)
            throughput.exclude(time.perf_counter() - pause)

    if step == args.steps:
        export_consolidated(model, params, dump_dir / "consolidated.pt")
    summary = {"steps": step, "first_loss": first_loss, "final_loss": last.get("loss"),
               "data_tokens": state["data_tokens"], "seconds": round(time.perf_counter() - start, 1)}
    logger.info("summary: " + " | ".join(f"{k} {v}" for k, v in summary.items()))
    return summary


def evaluate(step, model, tokenizer, val_tokens, args, device, metrics, rank) -> None:
    """Validation loss and, when configured, the frozen GLUE probes, at their intervals."""
    if val_tokens is not None and (step % args.validation.every == 0 or step == args.steps):
        record = {"step": step, **validate(model, val_tokens, args.validation, device)}
        metrics.log(record)
        logger.info(f"step {step} | val loss {record['val/loss']:.4f} | val acc {record['val/accuracy']:.3f}")
    if args.eval.every > 0 and step % args.eval.every == 0 and rank == 0:
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
        out = {key: (total / self.count).item() for key, total in self.sums.items()}
        self.sums, self.count = {}, 0
        return out


def train_step(model, forward, loader, generator, args, device):
    """One optimizer step's forward/backward over grad_acc_steps micro-batches: mean loss, mean accuracy, and the
    number of predicted tokens."""
    total_loss, total_acc, predicted = 0.0, 0.0, 0
    for _ in range(args.grad_acc_steps):
        batch = model.make_batch(next(loader).to(device, non_blocking=True), generator)
        with autocast(device):
            loss, stats = forward(**batch)
        (loss / args.grad_acc_steps).backward()
        total_loss = total_loss + loss.detach() / args.grad_acc_steps
        total_acc = total_acc + stats["accuracy"] / args.grad_acc_steps
        predicted += batch["targets"].numel()
    return total_loss, total_acc, predicted


def clip_gradients(model, max_norm: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)


def main(app: App, argv: list[str] | None = None) -> None:
    try:
        args = load_config(app.args_cls, sys.argv[1:] if argv is None else argv)
        train(app, args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
