"""The memory a run needs, estimated from its config before anything is allocated, so that a config this machine
cannot hold is refused in one line at the start instead of filling the memory.

The estimate is a lower bound, per process: what a training step cannot do without. It never refuses a config that
would fit; it refuses the ones that cannot. Per process:

- weights and optimizer: 16 bytes a parameter (fp32 weights, their gradients, AdamW's two moments), and 4 more for
  the weights' average when the run keeps one (`ema.decay`), split over the processes the parallelism plan shards
  them over (`auto`: the plan it chooses);
- the batch, on the host (the loader builds it there): 8 bytes a token (int64), and 8 more a row for the draw of
  its sources; the validation rows, held from the start;
- activations, on the device: each block's input kept for the backward (2 bytes a value at least, as in bf16), for
  the micro-batch's tokens; and the batch itself copied to the device.

Available: the device's free memory (torch.cuda.mem_get_info), or the host's shared by the processes of this node:
the least of MemAvailable (/proc/meminfo), what the cgroup v2 memory.max of this process (and of each cgroup above
it) leaves above its memory.current, and what the RLIMIT_AS soft limit leaves above this process's address space
(VmSize): a container or a ulimit kills or fails a process well below the host's free memory.
"""

import math
import resource
from pathlib import Path

import torch

from lingua.app import App
from lingua.data.tokenizer import build_tokenizer
from lingua.distributed import Launch
from lingua.model.flops import count_params
from lingua.parallel import STATE_BYTES, configured_sharding

GIB = 2**30
TOKEN_BYTES = 8  # int64 token ids
ACTIVATION_BYTES = 2  # bf16, the narrowest a block's saved input is kept in
AVERAGE_BYTES = 4  # fp32, the weights' average (lingua/training/ema.py)


def memory_shortfall(app: App, config, device: torch.device, launch: Launch) -> str | None:
    """Why this process cannot hold the run (one line: the estimate, what is available, the key to change), or
    None."""
    parts = estimate(app, config, launch, device)
    host_free, limit = host_available(launch.local_world_size)
    if device.type == "cuda":
        device_free = torch.cuda.mem_get_info(device)[0]
        device_parts = {k: parts[k] for k in ("weights and optimizer", "activations", "batch on the device")}
        problem = _shortfall(device_parts, device_free, f"memory of {device}", "its free memory")
        host_parts = {k: parts[k] for k in ("batch", "validation rows")}
        return problem or _shortfall(host_parts, host_free, "host memory", limit)
    del parts["batch on the device"]  # the host's batch itself
    return _shortfall(parts, host_free, "host memory", limit)


def estimate(app: App, config, launch: Launch, device: torch.device) -> dict[str, int]:
    """{part: bytes} needed by one process at least (see the module's docstring)."""
    with torch.device("meta"):
        n_params = count_params(app.build_model(config.model, build_tokenizer(config.data.tokenizer)))
    shards = configured_sharding(config.distributed, n_params, launch, device).shard_size
    row = math.prod(app.data.row_shape(config.data))
    rows = config.data.batch_size
    encoder = config.model.encoder
    validation_rows = config.validation.n_sequences // launch.world_size if config.validation.every else 0
    return {
        "weights and optimizer": (STATE_BYTES + (AVERAGE_BYTES if config.ema.decay else 0)) * n_params // shards,
        "batch": rows * (row + 1) * TOKEN_BYTES,
        "validation rows": validation_rows * row * TOKEN_BYTES,
        "batch on the device": rows * row * TOKEN_BYTES,
        "activations": rows * row * encoder.dim * encoder.n_layers * ACTIVATION_BYTES,
    }


def host_available(processes: int = 1, proc: Path = Path("/proc"),
                   cgroups: Path = Path("/sys/fs/cgroup")) -> tuple[int, str]:
    """(bytes one of this node's `processes` can still get from the host, the limit that sets it): the least of the
    limits in the module's docstring that this host has; the node's are shared, RLIMIT_AS is per process."""
    shared = [(_kib(proc / "meminfo", "MemAvailable:"), "the host's MemAvailable")]
    membership = _read(proc / "self" / "cgroup") or ""
    own = next((cgroups / line[3:].lstrip("/") for line in membership.splitlines() if line.startswith("0::")), None)
    for folder in [own, *own.parents] if own else []:
        if not folder.is_relative_to(cgroups):
            break
        ceiling = _read(folder / "memory.max")
        if ceiling and ceiling.isdigit():  # "max": no limit at this level
            shared.append((int(ceiling) - int(_read(folder / "memory.current") or 0),
                           f"the memory.max of cgroup /{folder.relative_to(cgroups).as_posix().strip('.')}"))
    limits = [(available // processes, limit) for available, limit in shared]
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        limits.append((soft - _kib(proc / "self" / "status", "VmSize:"), "the RLIMIT_AS soft limit (ulimit -v)"))
    available, limit = min(limits)
    return max(available, 0), limit


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _kib(path: Path, key: str) -> int:
    """Bytes of a `key: N kB` line of a /proc file."""
    for line in path.read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise OSError(f"{path} has no {key.rstrip(':')}")


def _shortfall(parts: dict[str, int], available: int, where: str, limit: str) -> str | None:
    need = sum(parts.values())
    if need <= available:
        return None
    biggest = max(parts, key=parts.get)
    change = ("lower data.batch_size (grad_acc_steps keeps the tokens per step)" if biggest != "weights and optimizer"
              else "a smaller model, or more processes to shard it over")
    listed = ", ".join(f"{name} {_size(size)}" for name, size in parts.items() if size)
    return (f"the run needs at least {_size(need)} of {where} per process ({listed}), {_size(available)} is "
            f"available ({limit}): {change}")


def _size(n: int) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"
