"""Run metrics: one JSON line per logged step in DUMP_DIR/metrics.jsonl, readable progress lines, optional wandb."""

import json
import logging
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lingua.args import at_least, require
from lingua.files import atomic_write

logger = logging.getLogger(__name__)


@dataclass
class LoggingArgs:
    freq: int = 10  # steps between metric lines
    peak_tflops: float = 989.0  # per device, for MFU; 989 = H100 SXM dense bf16. Set to your hardware's peak.
    wandb_project: str = ""  # log to wandb too when set (needs `pip install wandb`)

    def __post_init__(self):
        at_least(self, 1, "freq")
        require(self.peak_tflops > 0, "peak_tflops", f"must be > 0, got {self.peak_tflops}")


def setup_logging(log_file: Path | None = None, rank: int = 0) -> None:
    """Progress on stdout (and in the run's log file); replaces handlers a previous run in this process added.
    Ranks other than 0 print only their warnings and errors, tagged with their rank, and write no file."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if log_file is not None and rank == 0:
        handlers.append(logging.FileHandler(log_file))
    tag = f"[rank {rank}] " if rank else ""
    fmt = logging.Formatter(f"%(asctime)s %(levelname).1s {tag}%(message)s", datefmt="%H:%M:%S")
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricLogger:
    """Appends records to metrics.jsonl. On resume, drops the records past the resumed step, which the resumed run
    will write again, so the file always describes one consistent run; that rewrite is atomic, so a kill during it
    leaves the old file whole. Only rank 0 writes (`enabled`); the records it gets are already reduced over ranks."""

    def __init__(self, path: Path, resume_step: int, args: LoggingArgs, config: dict[str, Any], enabled: bool = True):
        self.path, self.file, self.wandb = path, None, None
        if not enabled:
            return
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if _step_of(line, default=resume_step + 1)
                    <= resume_step]  # a line torn by a kill is dropped with the rest past the checkpoint
            atomic_write(path, "".join(line + "\n" for line in kept))
        self.file = path.open("a")
        if args.wandb_project:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, config=config, dir=str(path.parent), resume="allow")

    def log(self, record: dict[str, Any]) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _step_of(line: str, default: int) -> int:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return default


def format_progress(record: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {record['step']}/{total_steps}"]
    for key, fmt in [
        ("loss", "loss {:.4f}"),
        ("accuracy", "acc {:.3f}"),
        ("lr", "lr {:.2e}"),
        ("grad_norm", "gnorm {:.2f}"),
        ("data_tokens_per_s", "{:,.0f} tok/s"),
        ("mfu", "mfu {:.2%}"),
        ("data_wait", "data wait {:.0%}"),
        ("memory_gib", "mem {:.1f}GiB"),
    ]:
        if key in record:
            parts.append(fmt.format(record[key]))
    return " | ".join(parts)
