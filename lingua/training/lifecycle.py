"""A run's life on every rank: the stop signals (a preemption warning, SIGTERM, Ctrl-C) and the agreement that
turns them, and one rank's failures, into one decision shared by all ranks; SLURM requeue; the run lock on the
dump_dir, a lease that holds across the hosts of a cluster file system."""

import contextlib
import dataclasses
import datetime
import errno
import logging
import os
import re
import signal
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lingua.distributed import fail_together, on_rank_zero, rank_and_world
from lingua.errors import UserError, require
from lingua.files.safe import fsync_dir
from lingua.host import boot_id, process_start
from lingua.run_folder import RunFolder

logger = logging.getLogger(__name__)

STOP_SIGNALS = ("SIGUSR2", "SIGUSR1", "SIGTERM", "SIGHUP")  # what a scheduler sends before it takes the machines


@dataclass
class LifecycleArgs:
    stop_signal: str = "SIGUSR2"  # SLURM's warning before the time limit (sbatch --signal=USR2@180): save, then requeue
    requeue: bool = True  # under SLURM, requeue the job after the stop signal, so it resumes unattended

    def __post_init__(self):
        require(self.stop_signal in STOP_SIGNALS, "stop_signal",
                f"must be one of {', '.join(STOP_SIGNALS)}, got '{self.stop_signal}'")


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


def requeue_slurm_job(signal_name: str, args: LifecycleArgs) -> bool:
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


HEARTBEAT_S = 30  # how often the holder renews its lease
STALE_AFTER_S = 300  # a lease not renewed for this long is taken over, whoever holds it
CLAIM_TIMEOUT_S = 10  # a takeover or release lasts milliseconds: a claim older than this was left by a killed process


def lease_holder() -> dict[str, str | None]:
    """What a lease says of this process, its holder. `machine` (boot and pid namespace) is shared by the processes
    whose pids this one can check; `job` and `round` name a SLURM job or torchrun rendezvous and its requeue or
    restart."""
    started = process_start(os.getpid())
    try:
        machine = f"{boot_id()}/{os.readlink('/proc/self/ns/pid').removeprefix('pid:[').removesuffix(']')}"
    except OSError:
        machine = None
    env, jobs, rounds = os.environ, [], []
    if "SLURM_JOB_ID" in env:
        jobs.append(f"slurm:{env['SLURM_JOB_ID']}")
        rounds.append(env.get("SLURM_RESTART_COUNT", "0"))
    if "TORCHELASTIC_RUN_ID" in env:
        jobs.append(f"torchrun:{env['TORCHELASTIC_RUN_ID']}@{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}")
        rounds.append(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return {"pid": str(os.getpid()), "host": os.uname().nodename, "started": started,
            "machine": machine if started else None, "job": "+".join(jobs) or None, "round": ".".join(rounds) or None}


def lease_text(holder: dict[str, str | None]) -> str:
    """A lease's one line: `pid N on HOST` (what a refusal quotes), then what tells that its holder is gone."""
    fields = [f"{key}={''.join(value.split())}" for key, value in holder.items()
              if key not in ("pid", "host") and value is not None]
    return " ".join([f"pid {holder['pid']} on {holder['host']}", *fields]) + "\n"


@dataclass(frozen=True)
class Lease:
    """A lease file as read: its identity (inode and text), its last renewal (mtime) and its holder, from a text
    `pid N on HOST key=value ...`. A lease being created is empty for a moment; an older library wrote the first
    four words alone."""

    inode: int
    text: str
    renewed_ns: int
    pid: int | None = None
    host: str | None = None
    fields: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, status: os.stat_result, text: str) -> "Lease":
        words = text.split()
        if len(words) < 4 or words[0] != "pid" or not re.fullmatch("[0-9]{1,9}", words[1]) or words[2] != "on":
            return cls(status.st_ino, text, status.st_mtime_ns)
        fields = dict(word.split("=", 1) for word in words[4:] if "=" in word)
        return cls(status.st_ino, text, status.st_mtime_ns, int(words[1]), words[3], fields)

    @classmethod
    def read(cls, path: Path) -> "Lease | None":
        """The lease at `path`, None if there is none. A link there is never followed, and refused like anything
        else that is not a file."""
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(f"{path} is a symbolic link, not a run lease: delete it (the run lock never follows "
                                "one)") from None
            raise UserError(f"cannot read the run lease {path}: {e.strerror}") from None
        try:
            status = os.fstat(descriptor)
            if not stat.S_ISREG(status.st_mode):
                raise UserError(f"{path} is not a file, so not a run lease: delete it")
            text = os.read(descriptor, 4096).decode(errors="replace")
        finally:
            os.close(descriptor)
        return cls.parse(status, text)

    @property
    def holder(self) -> str:
        return f"pid {self.pid} on {self.host}" if self.pid is not None else "another process"

    def stale_because(self, stale_after_s: float) -> str | None:
        """Why its holder is certainly gone; None if it may still train."""
        me = lease_holder()
        if me["machine"] is not None and self.fields.get("machine") == me["machine"]:  # its pid is checkable
            return None if process_start(self.pid) == self.fields.get("started") else "its process is gone"
        if me["job"] is not None and self.fields.get("job") == me["job"] and self.fields.get("round") != me["round"]:
            return "its job has been requeued or restarted since (a new round starts once the last one has stopped)"
        age = time.time() - self.renewed_ns / 1e9
        return f"not renewed for {age:.0f} s" if age > stale_after_s else None


class RunLock:
    """An exclusive lease on a run's dump_dir while a job trains in it, held by the job's rank 0 for all its ranks;
    it holds across the hosts of a cluster file system (NFS, Lustre, BeeGFS), where `flock` may be local to a host.

    The lease is DUMP_DIR/.lock, created exclusively and never through a link, one line naming its holder (`pid N
    on HOST started=... machine=... job=... round=...`); a thread renews it (sets its mtime) every `heartbeat_s`.
    Another start is refused while the lease may be live, and takes it over once its holder is certainly gone: on
    the same machine (same boot and pid namespace) when its pid runs no more or runs another process (another start
    time), in the same SLURM job or torchrun rendezvous when the job has restarted since, anywhere when it has not
    been renewed for `stale_after_s` (the hosts' clocks must agree to within a minute or so). A process removes a
    lease, to take it over or at the end of its own run, only under the lease's claim: DUMP_DIR/.lock.claim-INODE,
    created exclusively, under which it checks that the lease is still the one it judged. Of two processes racing
    for a stale lease, one removes it and creates its own; the other finds that one live and is refused.

    A holder that stalled (stopped, swapped out, cut off) past `stale_after_s` may find its lease taken over when
    it resumes. So every write into the run folder is fenced: right before it, `lost` checks that the lease is
    still this process's own, the same file and text (an inode alone may be reused); once it is not, the process
    writes nothing more there and the loop stops every rank with that reason.
    """

    def __init__(self, run: RunFolder, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.path = run.lock
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.descriptor: int | None = None  # of this process's lease, while it holds one (rank 0)
        self.lease: Lease | None = None
        self.released = threading.Event()
        self.renewer: threading.Thread | None = None
        self.taken_over: str | None = None  # once lost, the lease stays lost

    def __enter__(self):
        try:
            on_rank_zero(self._acquire)
        except BaseException:
            self._release()  # rank 0 took the lease, but the ranks could not agree
            raise
        return self

    def __exit__(self, *exc):
        self._release()

    def _acquire(self) -> None:
        while not self._create():
            lease = Lease.read(self.path)
            if lease is None:
                continue  # released meanwhile
            reason = lease.stale_because(self.stale_after_s)
            if reason is None:
                age = max(0.0, time.time() - lease.renewed_ns / 1e9)
                raise UserError(f"{self.path.parent} is in use by a running training ({lease.holder}, lease "
                                f"{self.path} renewed {age:.0f} s ago); wait for it to end or use another dump_dir; "
                                f"if it is gone, start again once the lease is {self.stale_after_s:.0f} s old, or "
                                f"delete {self.path}")
            with self._claim(lease) as claimed:
                if claimed and self._remove_if_unchanged(lease):
                    logger.warning(f"took over the run lease {self.path} of {lease.holder}: {reason}")
            if not claimed:
                self._wait_for_claim(lease)
        self.renewer = threading.Thread(target=self._renew, name="run-lease-heartbeat", daemon=True)
        self.renewer.start()

    def _create(self) -> bool:
        """Creates this process's lease, unless there is one (or a link, or anything else) at its path."""
        try:
            descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise UserError(f"cannot create the run lease {self.path}: {e.strerror}") from None
        text = lease_text(lease_holder())
        try:
            os.write(descriptor, text.encode())
            os.fsync(descriptor)  # NFS shows the text to other hosts only once written back
            fsync_dir(self.path.parent)
        except OSError as e:
            os.close(descriptor)
            os.unlink(self.path)
            raise UserError(f"cannot write the run lease {self.path}: {e.strerror}") from None
        self.descriptor, self.lease = descriptor, Lease.parse(os.fstat(descriptor), text)
        return True

    def lost(self) -> str | None:
        """The fence (lingua.files.safe.Fence): why this process may no longer write into the run folder, its lease
        being gone or another's; None while it holds the lease, and on the ranks that hold none (rank 0 holds it for
        all)."""
        if self.taken_over is None and self.lease is not None:
            try:
                current = Lease.read(self.path)
            except UserError as e:  # not this process's lease (a link, a folder), or it cannot be read
                self.taken_over = f"{e}: this process cannot tell that it still holds {self.path.parent}, so it " \
                                  "stops without writing there again"
                return self.taken_over
            if current is None or (current.inode, current.text) != (self.lease.inode, self.lease.text):
                self.taken_over = (f"the run lease {self.path} was taken over by another process (this one did not "
                                   f"renew it for {self.stale_after_s:.0f} s): it stops without writing to "
                                   f"{self.path.parent} again")
        return self.taken_over

    def _claim_path(self, lease: Lease) -> Path:
        return self.path.with_name(f"{self.path.name}.claim-{lease.inode}")

    @contextlib.contextmanager
    def _claim(self, lease: Lease):
        """Yields whether this process alone may now remove `lease`: it created the lease's claim (removed on exit).
        Since a lease is only removed under its claim, it cannot change while the claim is held."""
        claim = self._claim_path(lease)
        try:
            os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644))
        except FileExistsError:
            yield False
            return
        except OSError as e:
            raise UserError(f"cannot create {claim}: {e.strerror}") from None
        try:
            yield True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim)

    def _remove_if_unchanged(self, lease: Lease) -> bool:
        """Under its claim: removes the lease if it is still `lease` (the same file, text and renewal)."""
        if Lease.read(self.path) != lease:
            return False
        os.unlink(self.path)
        fsync_dir(self.path.parent)
        return True

    def _wait_for_claim(self, lease: Lease) -> None:
        """Another process is taking over or releasing `lease`: a moment, unless it was killed while doing so."""
        claim = self._claim_path(lease)
        try:
            age = time.time() - os.lstat(claim).st_mtime
        except FileNotFoundError:
            return
        if age > CLAIM_TIMEOUT_S:
            raise UserError(f"{claim} was left by a process killed while taking over or releasing the run lease "
                            f"{self.path}: if no training runs in {self.path.parent}, delete both files")
        time.sleep(0.05)

    def _renew(self) -> None:
        """The heartbeat: sets the lease's mtime to now every `heartbeat_s`. If the lease was taken over (this
        process stalled for `stale_after_s`), says so once (on stdout: the log file is another run's now) and stops."""
        while not self.released.wait(self.heartbeat_s):
            if self.lost() is not None:
                logger.error(self.taken_over)
                return
            try:
                os.utime(self.descriptor)
            except OSError as e:
                logger.warning(f"cannot renew the run lease {self.path} ({e.strerror}): trying again in "
                               f"{self.heartbeat_s:.0f} s")

    def _release(self) -> None:
        """Stops the heartbeat and removes the lease if it is still this process's."""
        if self.descriptor is None:
            return
        self.released.set()
        if self.renewer is not None:
            self.renewer.join()
        if self.lost() is not None:  # its folder is another process's now: not even a claim is created there
            os.close(self.descriptor)
            self.descriptor = self.lease = None
            return
        try:
            own = dataclasses.replace(self.lease, renewed_ns=os.fstat(self.descriptor).st_mtime_ns)
            with self._claim(own) as claimed:
                if not (claimed and self._remove_if_unchanged(own)):
                    logger.warning(f"the run lease {self.path} was taken over by another process: left in place")
        except (OSError, UserError) as e:
            logger.warning(f"cannot remove the run lease {self.path}: {e}")
        finally:
            os.close(self.descriptor)
            self.descriptor = self.lease = None
