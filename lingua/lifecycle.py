"""A run's life on every rank: the stop signals (a preemption warning, SIGTERM, Ctrl-C) and the agreement that
turns them, and one rank's failures, into one decision shared by all ranks; SLURM requeue; the run lock on the
dump_dir."""

import contextlib
import datetime
import fcntl
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from lingua.args import UserError
from lingua.distributed import DistributedArgs, fail_together, on_all_ranks, rank_and_world

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def stop_signals_held_for_the_main_thread(preemption: str):
    """Blocks the stop signals in this (main) thread while a run starts, so the threads it starts (the process
    group's, the data loader's) inherit the block and never receive them: a signal landing in a thread that waits
    in a socket call interrupts that call, which a collective may not survive. `StopSignal` unblocks them in the
    main thread alone; a preemption signal or Ctrl-C sent meanwhile waits until then. SIGTERM, unless it is the
    preemption signal, is not held back: a launcher stopping a start-up that hangs (torchrun before a restart)
    ends it at once. A thread started for that alone receives it (its default action ends the process); once the
    loop runs, the handler that `StopSignal` installs records it, in whichever thread it lands. The mask is
    restored on exit."""
    held = {signal.SIGINT, signal.Signals[preemption]}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    done = threading.Event()
    receiver = threading.Thread(target=done.wait, name="sigterm-receiver", daemon=True)
    if signal.SIGTERM not in held:
        receiver.start()  # before SIGTERM is blocked here: the one thread that may receive it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        done.set()
        if receiver.is_alive():
            receiver.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class StopSignal:
    """SIGTERM, the configured preemption signal (SIGUSR2: SLURM's warning before the time limit) and SIGINT
    (Ctrl-C) request a checkpoint and a clean stop. A second Ctrl-C interrupts at once, without saving.

    A signal may reach only some ranks, at any moment. `received` is this rank's own, set by the handler whenever
    the signal lands; `agreed` is the one all ranks stop for, set only by `agree` from the value reduced over the
    ranks, and every decision is taken from it. A signal that lands after this rank sent its flag is acted on after
    the next step, on every rank. When ranks received different signals, the preemption signal wins (the job is
    requeued), then SIGTERM, then the others."""

    def __init__(self, preemption: str = "SIGUSR2", timeout_minutes: float = 30):
        self.timeout = datetime.timedelta(minutes=timeout_minutes)
        self.priority = [signal.Signals[preemption], signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT]
        self.priority = list(dict.fromkeys(self.priority))  # the preemption signal may be SIGTERM
        self.signals = {signal.SIGTERM, signal.SIGINT, signal.Signals[preemption]}
        self.received: str | None = None
        self.agreed: str | None = None
        self.group = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self._handle) for s in self.signals}
        for s in self.signals:
            signal.siginterrupt(s, False)  # restart the main thread's interrupted system calls
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)  # this thread alone receives them
        if dist.is_initialized():  # a CPU group, so agreeing never waits for the GPU stream
            self.group = dist.new_group(backend="gloo", timeout=self.timeout) \
                if dist.get_backend() != "gloo" else dist.group.WORLD
        return self

    def __exit__(self, *exc):
        signal.pthread_sigmask(signal.SIG_BLOCK, self.signals)
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        """Only records the signal: a handler that logged could wait on a lock its interrupted thread holds."""
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name

    def rank_of(self, name: str | None) -> int:
        """The code sent for a received signal: larger for the signal that wins, 0 for none."""
        return len(self.priority) - self.priority.index(signal.Signals[name]) if name else 0

    def settle(self, code: int, sent: str | None) -> str | None:
        """Takes the reduced code as the agreed signal, and says so once."""
        if code and self.agreed is None:
            self.agreed = self.priority[len(self.priority) - code].name
            source = "received" if sent == self.agreed else "another rank received"
            logger.warning(f"{source} {self.agreed}: saving a checkpoint and stopping"
                           + (" (Ctrl-C again to stop without saving)" if self.agreed == "SIGINT" else ""))
        return self.agreed


def agree(stop: StopSignal, failure: str | None = None) -> str | None:
    """What every rank does next, from one all-reduce over the ranks (on the CPU: no device sync) of [the stop
    signal this rank received, whether it failed]: the first failing rank's reason is raised on every rank as a
    UserError (its data file changed, its metrics could not be written); else the agreed stop signal is returned
    (None: go on). Every rank calls it at the same points: before the first step and after every step."""
    sent = stop.received  # read once: the handler may set it while the reduction runs
    flags = torch.tensor([stop.rank_of(sent), failure is not None], dtype=torch.int32)
    if stop.group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=stop.group)
    code, failed = flags.tolist()
    if failed:
        fail_together(failure, stop.group)
    return stop.settle(code, sent)


def requeue_slurm_job(signal_name: str, args: DistributedArgs) -> bool:
    """After the preemption signal, rank 0 of a SLURM job asks SLURM to requeue it; True if it did."""
    job = os.environ.get("SLURM_JOB_ID")
    if not (job and args.requeue and signal_name == args.stop_signal and rank_and_world()[0] == 0):
        return False
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    except OSError as e:  # no scontrol here (a container): the checkpoint is saved, the job just ends
        logger.warning(f"cannot requeue SLURM job {job}: {e.strerror}: scontrol")
        return False
    if result.returncode:
        logger.warning(f"scontrol requeue {job} failed: {result.stderr.strip()}")
        return False
    logger.info(f"requeued SLURM job {job}: it resumes from this checkpoint when it starts again")
    return True


class RunLock:
    """An exclusive lock on a run's dump_dir while a job trains in it, held by the job's rank 0 for all its ranks.

    It is an advisory `flock` on DUMP_DIR/.lock, which the kernel releases when the holder exits, however it dies:
    a killed run never leaves it stuck. The file records the holder's pid and host for the refusal message.
    """

    def __init__(self, dump_dir: Path):
        self.path = Path(dump_dir) / ".lock"
        self.file = None

    def __enter__(self):
        on_all_ranks(self._acquire)
        return self

    def _acquire(self) -> None:
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

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()  # releases the lock; the file stays (removing it could race with a new holder)
