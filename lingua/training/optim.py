"""AdamW with linear warm-up then a cosine (pre-training; paper: betas 0.9/0.95, min lr 1e-6) or linear (fine-tuning)
decay to a minimum learning rate.

The schedule is a pure function of the step and the run's length (`lr_at`), set before every step: nothing about
it is checkpointed, so a resumed run, or one extended to more steps, follows the schedule of its current config.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from lingua.errors import at_least, require

DECAYS = ("cosine", "linear")
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
    decay: str = "cosine"  # cosine | linear: from lr after the warm-up to lr_min at the last step
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
        require(self.decay in DECAYS, "decay", f"must be one of {', '.join(DECAYS)}, got '{self.decay}'")
        require(self.implementation in IMPLEMENTATIONS, "implementation",
                f"must be one of {', '.join(IMPLEMENTATIONS)}, got '{self.implementation}'")


def lr_at(step: int, args: OptimArgs, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    decay_steps = max(total_steps - args.warmup, 1)
    progress = min((step - args.warmup) / decay_steps, 1.0)
    remaining = 1 - progress if args.decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
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
