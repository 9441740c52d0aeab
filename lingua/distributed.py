"""Process-level concerns, in one place: the launch (torchrun, SLURM srun, one process), the process group, each
rank's device, parallelising a model (FSDP2, per-block compile, activation checkpointing), mixed precision,
collectives for metrics, stop signals agreed across ranks, SLURM requeue, and the run lock.

Nothing here assumes CUDA, a GPU count per node or a cluster: on CPU the process group is gloo and the precision
fp32; on GPUs it is nccl, with bf16 compute and fp32 gradient reduction.
"""

import contextlib
import datetime
import fcntl
import functools
import gc
import logging
import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lingua.args import UserError, at_least, require

logger = logging.getLogger(__name__)

FSDP_TYPES = ("full_shard", "no_shard", "hybrid_shard")
STOP_SIGNALS = ("SIGUSR2", "SIGUSR1", "SIGTERM", "SIGHUP")  # what a scheduler sends before it takes the machines
AC_MODES = ("none", "full", "selective")


@dataclass
class DistributedArgs:
    fsdp_type: str = "full_shard"  # full_shard | no_shard (replicated) | hybrid_shard (shard in groups, replicate)
    shard_size: int = 0  # hybrid_shard: ranks per shard group; 0 = the processes of one node
    compile: bool = False  # torch.compile each block (static shapes: compiled once)
    activation_checkpointing: str = "none"  # none | full (recompute each block) | selective (keep matmul outputs)
    stop_signal: str = "SIGUSR2"  # SLURM's warning before the time limit (sbatch --signal=USR2@180)
    requeue: bool = True  # under SLURM, requeue the job after the stop signal, so it resumes unattended
    timeout_minutes: float = 30  # a collective that waits longer ends the job with one line naming the rank

    def __post_init__(self):
        require(self.fsdp_type in FSDP_TYPES, "fsdp_type", f"must be one of {', '.join(FSDP_TYPES)}")
        require(self.activation_checkpointing in AC_MODES, "activation_checkpointing",
                f"must be one of {', '.join(AC_MODES)}")
        require(self.stop_signal in STOP_SIGNALS, "stop_signal",
                f"must be one of {', '.join(STOP_SIGNALS)}, got '{self.stop_signal}'")
        at_least(self, 0, "shard_size")
        require(self.timeout_minutes > 0, "timeout_minutes", f"must be > 0, got {self.timeout_minutes}")


# ------------------------------------------------------------------------------------------------------- launch


@dataclass(frozen=True)
class Launch:
    """Who this process is. `source`: torchrun (any launcher setting RANK/WORLD_SIZE), slurm (srun tasks) or single."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"


def detect_launch(env: dict[str, str] | None = None) -> Launch:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"]),
                      int(env.get("LOCAL_WORLD_SIZE", 1)), env.get("MASTER_ADDR", "127.0.0.1"),
                      int(env.get("MASTER_PORT", 29500)), "torchrun")
    step_tasks = int(env.get("SLURM_STEP_NUM_TASKS", 1))  # set by srun for its tasks, not in the batch script
    if step_tasks > 1:
        nodes = int(env.get("SLURM_STEP_NUM_NODES", 1))
        return Launch(int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), step_tasks,
                      _tasks_on_first_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), step_tasks // nodes),
                      first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]),
                      20_000 + int(env.get("SLURM_JOB_ID", 0)) % 20_000, "slurm")
    if int(env.get("SLURM_NTASKS", 1)) > 1:
        logger.warning(f"SLURM allocated {env['SLURM_NTASKS']} tasks but this process was not started by srun: "
                       "training in one process (launch with srun for one process per task)")
    return Launch()


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[07-09,12],cpu1' -> 'gpu07'."""
    match = re.match(r"([^,\[]+)(?:\[([^\],]+?)(?:-[^\],]*)?[,\]])?", nodelist.strip())
    if not match:
        raise UserError(f"cannot read the SLURM node list '{nodelist}'")
    prefix, first = match.group(1), match.group(2)
    return prefix + (first or "")


def _tasks_on_first_node(tasks_per_node: str, default: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE, e.g. '4(x2),3' -> 4."""
    match = re.match(r"(\d+)", tasks_per_node)
    return int(match.group(1)) if match else max(default, 1)


# ------------------------------------------------------------------------------------------- process group, device


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto (this rank's GPU when there is one, else the CPU), cpu, cuda or cuda:N; anything else is a one-line
    error. With several processes, `cuda` means each rank's own GPU (its local rank)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"device must be auto, cpu, cuda or cuda:N, got '{name}'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device={name} but no GPU is available (device=auto picks one when there is)")
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UserError(f"device={name} on local rank {local_rank} but this machine has "
                            f"{torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", index)
    return device


def init_process_group(launch: Launch, device: torch.device, timeout_minutes: float) -> None:
    """One process group per run when there are several processes (nccl on GPUs, gloo on CPUs)."""
    if launch.world_size == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", launch.master_addr)
    os.environ.setdefault("MASTER_PORT", str(launch.master_port))
    timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout, store=_restart_store(launch, timeout),
                            device_id=device if device.type == "cuda" else None)


def _restart_store(launch: Launch, timeout: datetime.timedelta):
    """torchrun lends its workers its own rendezvous store (TORCHELASTIC_USE_AGENT_STORE), where the keys of a
    process group carry no restart number: workers restarted by `--max-restarts` would read the addresses of the
    round before and fail to connect (pytorch#135712). Each restart gets a key space of its own; None elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"lingua/restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def destroy_process_group() -> None:
    """Also collects garbage first: a model's reference cycles (FSDP's hooks) can hold gloo work, and freeing that
    during interpreter shutdown instead aborts the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum or max over ranks (in place, returned); the identity in one process."""
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return values


def broadcast_object(obj):
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj, group=None) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def agreed_failure(failure: str | None, group=None) -> str | None:
    """The failure of the first rank that has one (a one-line reason), on every rank; None if no rank failed. One
    all-reduce, and a gather of the reasons only when there is one. Every rank calls it at the same point."""
    failed = torch.tensor([failure is not None], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not failed.item():
        return None
    return next(f for f in all_gather_object(failure, group) if f is not None)


def fail_together(failure: str | None, group=None) -> None:
    """Raises the first rank's failure as a UserError on every rank, so that no rank waits for one that left."""
    agreed = agreed_failure(failure, group)
    if agreed is not None:
        raise UserError(agreed)


def on_all_ranks(check) -> None:
    """Runs `check` on rank 0 and re-raises its UserError on every rank, so all ranks stop together."""
    error = None
    if rank_and_world()[0] == 0:
        try:
            check()
        except UserError as e:
            error = str(e)
    error = broadcast_object(error)
    if error is not None:
        raise UserError(error)


def on_every_rank(build):
    """Runs `build` (which must not communicate) on every rank; a UserError on any rank is raised on all of them
    (what each rank built is closed), so an error that only one rank meets (its share of the data) stops the job in
    one line, not in a hang."""
    try:
        result, error = build(), None
    except UserError as e:
        result, error = None, str(e)
    try:
        fail_together(error)
    except UserError:
        if hasattr(result, "close"):
            result.close()
        raise
    return result


_COLLECTIVE_ERRORS = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "pair closure")


def collective_failure(error: BaseException) -> str | None:
    """'timeout' or 'lost' if `error` is a collective that failed (gloo raises plain RuntimeErrors), else None."""
    text = str(error)
    if not (isinstance(error, dist.DistError) or any(marker in text for marker in _COLLECTIVE_ERRORS)):
        return None
    return "timeout" if "imed out" in text or "imeout" in text else "lost"


def autocast(device: torch.device):
    """bf16 mixed precision on GPU; full precision on CPU, where bf16 matmuls are slow."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# -------------------------------------------------------------------------------------------------- parallelise


def parallelize(model: nn.Module, blocks: list[nn.Module], args: DistributedArgs, launch: Launch,
                device: torch.device) -> nn.Module:
    """Activation checkpointing and compile per block, then FSDP2 per block and at the root (which keeps the
    embedding, the tied head and everything outside the blocks). Applied on the meta device, before the weights
    are materialised; parameter names are unchanged."""
    for block in blocks:
        if args.activation_checkpointing != "none":
            _checkpoint_activations(block, args.activation_checkpointing)
        if args.compile:
            block.compile(fullgraph=True)
    if launch.world_size > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        mesh = _device_mesh(args, launch, device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if device.type == "cuda" else MixedPrecisionPolicy()
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        register_fsdp_forward_method(model, "encode")  # evaluation calls encode, not forward: gather there too
    return model


def _device_mesh(args: DistributedArgs, launch: Launch, device: torch.device):
    """1-D mesh for full_shard; (replicate, shard) 2-D mesh for no_shard (shard 1) and hybrid_shard."""
    from torch.distributed.device_mesh import init_device_mesh

    world = launch.world_size
    if args.fsdp_type == "full_shard":
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    shard = 1 if args.fsdp_type == "no_shard" else (args.shard_size or launch.local_world_size)
    if world % shard:
        raise UserError(f"distributed.shard_size {shard} does not divide the {world} processes")
    return init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def _checkpoint_activations(block: nn.Module, mode: str) -> None:
    """full: keep only the block's inputs and recompute the rest in the backward pass. selective: keep the outputs
    of matmuls and attention too, recomputing only cheap element-wise ops (norms, SwiGLU's gate, RoPE). The block's
    forward is wrapped in place, so parameter names do not change and the block still compiles."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    saved = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    forward = block.forward
    if mode == "full":
        block.forward = lambda *args: checkpoint(forward, *args, use_reentrant=False)
    else:
        context = functools.partial(create_selective_checkpoint_contexts, policy)  # a partial: compile traces it
        block.forward = lambda *args: checkpoint(forward, *args, use_reentrant=False, context_fn=context)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Gradient accumulation: FSDP reduces gradients only on the last micro-batch of a step."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


# ------------------------------------------------------------------------------------------------ stop signals


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


# ---------------------------------------------------------------------------------------------------- run lock


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


# ------------------------------------------------------------------------------------------------- model build


def build_model(build_fn, model_args, tokenizer, device: torch.device, seed: int = 0,
                parallel: tuple[DistributedArgs, Launch] | None = None) -> nn.Module:
    """The one way models are built, for training and for loading: on the meta device (no memory), parallelised
    when asked (`parallel`), materialised on `device`, then initialised from `seed` (`init_weights`)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = build_fn(model_args, tokenizer)
    if parallel is not None:
        parallelize(model, model.sharding_units(), *parallel, device)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model
