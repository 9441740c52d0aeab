"""Run metrics: one JSON line per logged step in DUMP_DIR/metrics.jsonl, readable progress lines, optional wandb and
TensorBoard."""

import contextlib
import importlib.util
import json
import logging
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lingua.distributed import all_reduce, rank_and_world
from lingua.errors import UserError, at_least, require
from lingua.files.safe import Fence, atomic_write, open_appending, refuse_link, unfenced
from lingua.files.untrusted import Malformed, parse_json, read_bytes

logger = logging.getLogger(__name__)


@dataclass
class LoggingArgs:
    freq: int = 10  # steps between metric lines
    peak_tflops: float | None = None  # per device, for MFU; default: the GPU's dense bf16 peak if it is known
    wandb_project: str = ""  # log to wandb too when set (needs `pip install wandb`)
    tensorboard: bool = False  # TensorBoard event files too, in the run folder's tensorboard/ (needs tensorboard)

    def __post_init__(self):
        at_least(self, 1, "freq")
        require(self.peak_tflops is None or self.peak_tflops > 0, "peak_tflops",
                f"must be > 0, got {self.peak_tflops}")


def check_logging(args: LoggingArgs) -> None:
    """What the config asks of the installed packages, checked with the config (wandb starts only after start-up)."""
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        raise UserError("logging.wandb_project is set but wandb is not installed: pip install wandb, or unset it")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("logging.tensorboard is true but the tensorboard package is not installed: pip install "
                        "tensorboard, or set logging.tensorboard=false")


# Dense (not 2:4 sparse) bf16 tensor-core peaks from the vendors' data sheets, matched in this order against
# torch.cuda.get_device_name(), so "H100 PCIe" is found before "H100".
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H800", 989.0), ("H200", 989.0),
                    ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0))


def peak_flops(args: LoggingArgs, device: torch.device) -> float | None:
    """FLOP/s of one device for MFU: logging.peak_tflops if set, else the table's entry for this GPU; None (MFU
    unknown) for a CPU or an unlisted GPU."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS if key in name), None)


def setup_logging(log_file: Path | None = None, rank: int = 0, fence: Fence = unfenced) -> None:
    """Progress on stdout (and in the run's log file); replaces handlers a previous run in this process added.
    Ranks other than 0 print only their warnings and errors, tagged with their rank, and write no file. The log file
    is never opened through a link (LinkRefused); once `fence` says this process no longer holds the run, nothing
    more is written to it."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None and rank == 0:
        try:
            handlers.append(RunLogHandler(log_file, fence))
        except OSError as e:
            raise UserError(f"cannot write {log_file}: {e.strerror}") from None
    tag = f"[rank {rank}] " if rank else ""
    fmt = logging.Formatter(f"%(asctime)s %(levelname).1s {tag}%(message)s", datefmt="%H:%M:%S")
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


class RunLogHandler(logging.StreamHandler):
    """Appends to a run's log file, opened never through a link; drops every record once `fence` reports the run's
    lease lost (another process now writes that file)."""

    def __init__(self, path: Path, fence: Fence):
        super().__init__(open_appending(path))
        self.fence = fence

    def emit(self, record: logging.LogRecord) -> None:
        if self.fence() is None:
            super().emit(record)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.stream.close()
        super().close()


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricLogger:
    """Appends records to metrics.jsonl. On resume, drops the records past the resumed step, which the resumed run
    will write again, so the file always describes one consistent run; that rewrite is atomic, so a kill during it
    leaves the old file whole. Only rank 0 writes (`enabled`); the records it gets are already reduced over ranks.
    A link at `path` is refused (LinkRefused) before anything is read or written; once `fence` reports the run's
    lease lost, no record is written and the loop stops with that reason. With `args.tensorboard`, every record's
    numbers go to TensorBoard event files too, in the folder given as `tensorboard` (`TensorBoardLog`)."""

    def __init__(self, path: Path, resume_step: int, args: LoggingArgs, config: dict[str, Any], enabled: bool = True,
                 fence: Fence = unfenced, tensorboard: Path | None = None):
        self.path, self.file, self.wandb, self.tensorboard, self.fence = path, None, None, None, fence
        self.failure: str | None = None  # why a record could not be written: the loop stops every rank with it
        if not enabled:
            return
        try:
            refuse_link(path)
            if path.exists():
                # a line torn by a kill, or that is not a record, is dropped with the rest past the checkpoint
                lines = read_bytes(path, "metrics file").decode(errors="replace").splitlines()
                kept = [line for line in lines if _step_of(line, default=resume_step + 1) <= resume_step]
                atomic_write(path, "".join(line + "\n" for line in kept))
            self.file = open_appending(path)
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror}") from None
        if args.wandb_project:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, config=config, dir=str(path.parent), resume="allow")
        if args.tensorboard:
            self.tensorboard = TensorBoardLog(tensorboard, resume_step)

    def log(self, record: dict[str, Any]) -> None:
        if self.file is None or self.failure is not None:
            return
        self.failure = self.fence()
        if self.failure is not None:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk or a lost mount: the other ranks must hear of it, not wait for this one
            self.failure = f"cannot write {self.path}: {e.strerror or e}"
            return
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        if self.tensorboard is not None:
            self.failure = self.tensorboard.log(record)

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):  # the failed write is already reported
                self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorBoardLog:
    """A record's numbers as TensorBoard scalars (float32, as TensorBoard keeps them; metrics.jsonl has the exact
    values), each tagged with its key, at the record's step. A resume at step N marks the steps past N purged, so
    TensorBoard drops what an earlier process wrote there, as MetricLogger drops those records. Every record is
    flushed when logged: nothing is left queued to be written after the run's lease is lost. Each process writes a
    new file, named by the time, host and pid (torch's SummaryWriter)."""

    def __init__(self, folder: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter  # imported only when asked: it loads the tensorboard package

        self.folder = folder
        try:
            refuse_link(folder)  # the event file's name is new to each process: no link can be there already
            self.writer = SummaryWriter(str(folder), purge_step=resume_step + 1)
        except OSError as e:
            raise UserError(f"cannot write TensorBoard's events in {folder}: {e.strerror}") from None

    def log(self, record: dict[str, Any]) -> str | None:
        """Writes the record's numbers; returns why they could not be written (a full disk, say), or None."""
        try:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()  # raises what the writer's thread met
        except OSError as e:
            return f"cannot write TensorBoard's events in {self.folder}: {e.strerror or e}"
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a failed write is already reported
            self.writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none if it does not exist; a UserError if it is not a regular file or cannot
    be read). A line that is not a JSON object (torn by a killed writer, or written by something else, bytes that are
    not UTF-8 included) is skipped, with one warning that counts them."""
    records, skipped = [], 0
    lines = read_bytes(path, "metrics file").decode(errors="replace").splitlines() if path.exists() else []
    for line in lines:
        record = _record(line)
        if record is None:
            skipped += 1
        else:
            records.append(record)
    if skipped:
        logger.warning(f"{path}: skipped {skipped} line(s) that are not JSON objects")
    return records


def _record(line: str) -> dict[str, Any] | None:
    try:
        return parse_json(line, dict)
    except Malformed:  # not a JSON object, or nested too deep to parse
        return None


def _step_of(line: str, default: int) -> int:
    step = (_record(line) or {}).get("step")
    return step if isinstance(step, int) else default


def format_progress(record: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {record['step']}/{total_steps}"]
    for key, fmt in [
        ("loss", "loss {:.4f}"),
        ("accuracy", "acc {:.3f}"),
        ("lr", "lr {:.2e}"),
        ("grad_norm", "gnorm {:.2f}"),
        ("data_tokens_per_s", "{:,.0f} tok/s"),
        ("mfu", "mfu {:.1%}"),
        ("mfu_hw", "mfu_hw {:.1%}"),
        ("data_wait", "data wait {:.0%}"),
        ("memory_gib", "mem {:.1f}GiB"),
    ]:
        if key in record:
            parts.append(fmt.format(record[key]) if record[key] is not None else fmt.split()[0] + " unknown")
    if record.get("new_malformed_lines"):
        parts.append(f"skipped {record['new_malformed_lines']:,} malformed lines")
    return " | ".join(parts)


class Throughput:
    """Tokens per second and MFU of all ranks together over the steps since the last report, and the share of this
    rank's time spent waiting for its data loader. A step's tokens are counted from its micro-batches, whose number
    may change from step to step (lingua/training/batch_warmup.py)."""

    def __init__(self, model, rows_per_rank: int, row_tokens: int, seq_len: int, world_size: int, peak: float | None,
                 data_tokens: int = 0):
        """`rows_per_rank`: data rows of one micro-batch on one rank; `seq_len`: the length the FLOPs are counted at;
        `peak`: one device's peak FLOP/s (`peak_flops`), None: no MFU; `data_tokens`: the run's count at its start
        (a resumed run's)."""
        self.world_size = world_size
        self.micro_batch_tokens = rows_per_rank * world_size * row_tokens  # data tokens, all ranks together
        self.views_per_sequence = model.views_per_sequence
        self.flops_per_view = model.flops_per_token_view(seq_len)  # the paper's count (no output head)
        self.flops_per_view_with_head = self.flops_per_view + model.head_flops_per_token_view(seq_len)
        self.flops_per_view_hw = model.hardware_flops_per_token_view(seq_len)  # what the kernels run
        self.peak = peak * world_size if peak else None
        self.reported_tokens = data_tokens
        self.start, self.predicted, self.waited = time.perf_counter(), 0, 0.0

    def data_tokens(self, micro_batches: int) -> int:
        """Data tokens of one optimizer step of `micro_batches` micro-batches, over all ranks."""
        return micro_batches * self.micro_batch_tokens

    def compute(self, token_views: int) -> dict[str, float]:
        """The run's compute so far: eq. 6 as the paper counts it (no output head), and all the FLOPs it ran."""
        return {"compute_flops": token_views * self.flops_per_view,
                "compute_flops_with_head": token_views * self.flops_per_view_with_head}

    def exclude(self, seconds: float) -> None:
        """Time spent outside training steps (validation, probes, checkpoints) does not count."""
        self.start += seconds

    def step(self, predicted_tokens: int, waited_s: float) -> None:
        self.predicted += predicted_tokens * self.world_size
        self.waited += waited_s

    def report(self, data_tokens: int) -> dict[str, float]:
        """Rates since the last report; `data_tokens`: the run's count now."""
        elapsed = time.perf_counter() - self.start
        tokens, self.reported_tokens = data_tokens - self.reported_tokens, data_tokens
        views_per_s = tokens * self.views_per_sequence / elapsed
        out = {
            "data_tokens_per_s": tokens / elapsed,
            "token_views_per_s": views_per_s,
            "predicted_tokens_per_s": self.predicted / elapsed,
            "mfu": self.flops_per_view_with_head * views_per_s / self.peak if self.peak else None,
            "mfu_hw": self.flops_per_view_hw * views_per_s / self.peak if self.peak else None,
            "data_wait": self.waited / elapsed,
        }
        self.start, self.predicted, self.waited = time.perf_counter(), 0, 0.0
        return out


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


def reduce_over_ranks(record: dict, device: torch.device, maximum: tuple[str, ...], total: tuple[str, ...]) -> dict:
    """Per-rank host values of a log record: the largest over ranks (memory, data wait) or their sum."""
    if rank_and_world()[1] == 1:
        return {}
    largest = all_reduce(torch.tensor([record[k] for k in maximum], dtype=torch.float64, device=device), "max")
    summed = all_reduce(torch.tensor([record[k] for k in total], dtype=torch.float64, device=device))
    return {**dict(zip(maximum, largest.tolist())), **{k: int(v) for k, v in zip(total, summed.tolist())}}
