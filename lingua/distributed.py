"""The processes of a run: the launch (torchrun, SLURM srun, one process), each rank's device, the process group,
and the collectives the library uses (metrics, rank 0's checks, failures raised on every rank). How a model is
parallelised is lingua/parallel.py; signals, requeue and the run lock are lingua/training/lifecycle.py.

Nothing here assumes CUDA, a GPU count per node or a cluster: on CPU the process group is gloo; on GPUs, nccl.
"""

import datetime
import gc
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lingua.errors import UserError, at_least, require

logger = logging.getLogger(__name__)

FSDP_TYPES = ("full_shard", "no_shard", "hybrid_shard")  # the plans; `auto` picks one from the run's sizes
REDUCE_DTYPES = ("fp32", "bf16")
AC_MODES = ("none", "full", "selective")


@dataclass
class DistributedArgs:
    fsdp_type: str = "full_shard"  # full_shard | no_shard | hybrid_shard (shard in groups, replicate) | auto (by size)
    shard_size: int = 0  # hybrid_shard: ranks per shard group; 0 = the processes of one node
    reduce_dtype: str = "fp32"  # gradient reduction under mixed precision (GPUs): fp32 | bf16 (half the traffic)
    compile: bool = False  # torch.compile each block (static shapes: compiled once)
    compile_backend: str = "inductor"  # torch.compile's backend; aot_eager tells a tracing fault from Inductor's code
    activation_checkpointing: str = "none"  # none | full (recompute each block) | selective (keep matmul outputs)
    timeout_minutes: float = 30  # a collective that waits longer ends the job with one line naming the rank

    def __post_init__(self):
        require(self.fsdp_type in (*FSDP_TYPES, "auto"), "fsdp_type", f"must be one of {', '.join(FSDP_TYPES)}, auto")
        require(self.reduce_dtype in REDUCE_DTYPES, "reduce_dtype", f"must be one of {', '.join(REDUCE_DTYPES)}")
        require(self.activation_checkpointing in AC_MODES, "activation_checkpointing",
                f"must be one of {', '.join(AC_MODES)}")
        at_least(self, 0, "shard_size")
        require(self.timeout_minutes > 0, "timeout_minutes", f"must be > 0, got {self.timeout_minutes}")
        if self.compile:
            from torch._dynamo import list_backends

            backends = list_backends(exclude_tags=())
            require(self.compile_backend in backends, "compile_backend", f"must be one of {', '.join(backends)}")


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
    """One process group per run (nccl on GPUs, gloo on CPUs) when there are several processes, or one under
    torchrun: `torchrun --nproc-per-node 1` trains under FSDP2 too (its mixed precision, its checkpoints)."""
    if dist.is_initialized() or (launch.world_size == 1 and launch.source != "torchrun"):
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


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective of `group` must live: this rank's GPU for nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agreed_failure(failure: str | None, group=None) -> str | None:
    """The failure of the first rank that has one (a one-line reason), on every rank; None if no rank failed. One
    all-reduce, and a gather of the reasons only when there is one. Every rank calls it at the same point."""
    failed = torch.tensor([failure is not None], dtype=torch.int32, device=collective_device(group))
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


def on_rank_zero(action) -> None:
    """Runs `action` (a write, a check of the file system) on rank 0 only and raises its UserError on every rank, so
    all ranks stop together."""
    error = None
    if rank_and_world()[0] == 0:
        try:
            action()
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


def parameters_finite(model: nn.Module, optimizer=None, more: Iterable[torch.Tensor] = ()) -> bool:
    """Whether every weight of the model, of the optimizer's state and of `more` is finite (every shard, on every
    rank): one reduction, one host sync."""
    tensors = [*model.parameters(), *more]
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.is_floating_point()]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    finite_ranks = all_reduce(torch.stack([torch.isfinite(p).all() for p in local]).all().float().reshape(1))
    return finite_ranks.item() == rank_and_world()[1]
