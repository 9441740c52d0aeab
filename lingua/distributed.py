"""Process-level concerns, in one place: the launch, ranks, devices, mixed precision, stop signals, the run lock."""

import contextlib
import fcntl
import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from lingua.args import UserError

logger = logging.getLogger(__name__)


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def check_single_process() -> None:
    """Several processes would each think they are rank 0 and write one dump_dir: refused until supported."""
    launched = {"WORLD_SIZE": os.environ.get("WORLD_SIZE"), "SLURM_NTASKS": os.environ.get("SLURM_NTASKS")}
    for variable, value in launched.items():
        if value is not None and value.isdigit() and int(value) > 1:
            raise UserError(f"multi-process training (torchrun, SLURM tasks) is not supported yet: {variable}={value}; "
                            "run one process")


def resolve_device(name: str) -> torch.device:
    """auto (a GPU when there is one, else the CPU), cpu, cuda or cuda:N; anything else is a one-line error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"device must be auto, cpu, cuda or cuda:N, got '{name}'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device={name} but no GPU is available (device=auto picks one when there is)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device={name} but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def autocast(device: torch.device):
    """bf16 mixed precision on GPU; full precision on CPU, where bf16 matmuls are slow."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class StopSignal:
    """SIGTERM, SIGUSR2 (SLURM's warning before a kill) and SIGINT (Ctrl-C) request a checkpoint and a clean stop.
    A second Ctrl-C interrupts at once, without saving."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt
        logger.warning(f"received {name}: saving a checkpoint and stopping"
                       + (" (Ctrl-C again to stop without saving)" if signum == signal.SIGINT else ""))
        self.received = self.received or name


class RunLock:
    """An exclusive lock on a run's dump_dir while a process trains in it.

    It is an advisory `flock` on DUMP_DIR/.lock, which the kernel releases when the holder exits, however it dies:
    a killed run never leaves it stuck. The file records the holder's pid and host for the refusal message.
    """

    def __init__(self, dump_dir: Path):
        self.path = Path(dump_dir) / ".lock"
        self.file = None

    def __enter__(self):
        file = open(self.path, "a+")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            raise UserError(f"{self.path.parent} is in use by a running training ({holder}); "
                            "wait for it to end or use another dump_dir") from None
        except OSError as e:  # a file system without flock (ENOLCK, EOPNOTSUPP): train, but unguarded
            logger.warning(f"cannot lock {self.path} ({e.strerror}): nothing stops a second run in this dump_dir")
        file.truncate(0)
        file.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        file.flush()
        self.file = file
        return self

    def __exit__(self, *exc):
        self.file.close()  # releases the lock; the file stays (removing it could race with a new holder)
