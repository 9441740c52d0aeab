"""AdamW with linear warm-up then a decay to a minimum learning rate: over the rest of the run
(`schedule=warmup_decay`: cosine for pre-training, paper: betas 0.9/0.95, min lr 1e-6; linear for fine-tuning), or
after a stable phase at the peak, over the run's last `decay_steps` or `decay_fraction` (`schedule=wsd`,
warmup-stable-decay).

The schedule is a pure function of the step and the run's length (`lr_at`), set before every step: nothing about
it is checkpointed, so a resumed run, or one extended to more steps, follows the schedule of its current config. A
WSD run's decay starts from the stable value, so a run continued from a stable run's checkpoint (`continue_from`)
with the same warm-up and peak decays from where the stable run was.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from lingua.errors import at_least, require

SCHEDULES = ("warmup_decay", "wsd")
DECAYS = ("cosine", "linear", "1-sqrt")
IMPLEMENTATIONS = ("fused", "foreach", "for-loop")


@dataclass
class OptimArgs:
    lr: float = 6e-4  # peak learning rate (AdamW)
    lr_min: float = 1e-6  # end of the decay
    weight_decay: float = 0.1  # decoupled; none on norms and embeddings
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    eps: float = 1e-8  # AdamW
    warmup: int = 2000  # steps of linear warm-up from 0
    schedule: str = "warmup_decay"  # the decay from the warm-up to the last step; wsd: stable at lr, then the decay
    decay: str = "cosine"  # the decay's shape, from lr to lr_min at the last step: cosine | linear | 1-sqrt
    decay_steps: int = 0  # wsd: the decay's length in steps; 0: decay_fraction of the run
    decay_fraction: float = 0.2  # wsd: the decay's share of the run's steps when decay_steps is 0 (0: no decay)
    clip: float = 1.0  # max global grad norm; 0 disables clipping
    # AdamW's kernels: fused (one kernel per step over all parameters; used where their device has it, else foreach),
    # foreach (grouped per-op kernels: several passes over the states), for-loop (one parameter at a time)
    implementation: str = "fused"

    def __post_init__(self):
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        require(0 <= self.lr_min <= self.lr, "lr_min", f"must be between 0 and lr ({self.lr}), got {self.lr_min}")
        require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        for name in ("beta1", "beta2"):
            require(0 <= getattr(self, name) < 1, name, f"must be in [0, 1), got {getattr(self, name)}")
        at_least(self, 0, "weight_decay", "warmup", "clip")
        require(self.schedule in SCHEDULES, "schedule",
                f"must be one of {', '.join(SCHEDULES)}, got '{self.schedule}'")
        require(self.decay in DECAYS, "decay", f"must be one of {', '.join(DECAYS)}, got '{self.decay}'")
        at_least(self, 0, "decay_steps")
        require(0 <= self.decay_fraction <= 1, "decay_fraction", f"must be in [0, 1], got {self.decay_fraction}")
        require(self.implementation in IMPLEMENTATIONS, "implementation",
                f"must be one of {', '.join(IMPLEMENTATIONS)}, got '{self.implementation}'")

    def decay_window(self, total_steps: int) -> tuple[int, int]:
        """(the step the decay starts at, its length in steps) in a run of `total_steps`."""
        if self.schedule == "warmup_decay":
            return self.warmup, max(total_steps - self.warmup, 1)
        length = self.decay_steps or round(self.decay_fraction * total_steps)
        return total_steps - length, length


def check_schedule(args: OptimArgs, total_steps: int) -> None:
    """A WSD decay fits in the run after its warm-up (checked by the run's config, which knows its steps)."""
    start, length = args.decay_window(total_steps)
    require(args.schedule != "wsd" or start >= args.warmup, "optim.decay_steps",
            f"the decay ({length} steps) and the warm-up ({args.warmup}) exceed the run's {total_steps} steps")


def lr_at(step: int, args: OptimArgs, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    start, length = args.decay_window(total_steps)
    if step < start:  # WSD's stable phase
        return args.lr
    progress = min((step - start) / max(length, 1), 1.0)
    if args.decay == "linear":
        remaining = 1 - progress
    elif args.decay == "1-sqrt":
        remaining = 1 - math.sqrt(progress)
    else:
        remaining = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr_min + (args.lr - args.lr_min) * remaining


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms, biases (1-d tensors) and embeddings (nn.Embedding, or a parameter named *embedding)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        exempt = param.ndim < 2 or id(param) in embeddings or name.endswith("embedding")
        (no_decay if exempt else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, args: OptimArgs) -> torch.optim.AdamW:
    groups = param_groups(model, args.weight_decay)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                             **kernels(args.implementation, [p for group in groups for p in group["params"]]))


def kernels(implementation: str, params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's `fused`/`foreach` flags for `implementation`; fused falls back to foreach where a parameter's device
    has no fused kernel (torch's list of those devices)."""
    if implementation == "fused" and all(p.device.type in _get_fused_kernels_supported_devices() for p in params):
        return {"fused": True}
    return {"foreach": implementation != "for-loop"}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
