"""An exponential moving average (EMA) of the weights, `ema.decay` per optimizer step: after each step the average
moves towards the new weights by (1 - decay), in fp32.

It is kept as the parameters are: on each rank, the part of each trained parameter that the rank holds (a DTensor
shaped as the parameter's shard under FSDP2). Every checkpoint saves it beside the model and the optimizer (DCP's
`ema.` entries, resharded on load like them), so a resumed run continues the same average; the run's end writes its
weights to consolidated_ema.pt, which every command that reads a consolidated.pt takes (`lingua.export`, `tools.eval`).
The evaluations during training score the raw weights, the average or both (`ema.evaluate`): the average is copied
into the parameters for the evaluation and the raw weights back after it, the optimizer state untouched.
"""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lingua.errors import require

EVALUATE = ("raw", "ema", "both")
SCORE_PREFIX = "ema/"  # an evaluation's scores of the average: ema/val/loss beside the raw weights' val/loss


@dataclass
class EmaArgs:
    decay: float = 0.0  # per optimizer step (0.999: an average over about the last 1,000 steps); 0: none is kept
    # the weights the evaluations during training score: raw | ema | both. The average's scores are logged as ema/KEY
    # (ema/val/loss); a keep_best naming one of them saves the average's weights to best.pt
    evaluate: str = "raw"

    def __post_init__(self):
        require(0 <= self.decay < 1, "decay", f"must be in [0, 1), got {self.decay}")
        require(self.evaluate in EVALUATE, "evaluate", f"must be one of {', '.join(EVALUATE)}, got '{self.evaluate}'")
        require(self.evaluate == "raw" or self.decay > 0, "evaluate",
                f"is '{self.evaluate}', but no average is kept: set ema.decay (e.g. 0.999)")


class WeightsAverage:
    """The average of `model`'s trained parameters, started at their values now."""

    def __init__(self, model: nn.Module, decay: float):
        self.model, self.decay = model, decay
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.averages = {name: p.detach().float().clone() for name, p in self.params.items()}

    @classmethod
    def of(cls, model: nn.Module, args: EmaArgs) -> "WeightsAverage | None":
        """The model's average, or None when the config keeps none."""
        return cls(model, args.decay) if args.decay > 0 else None

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: average += (1 - decay) * (weights - average), on this rank's shards."""
        weights = [_local(p).float() for p in self.params.values()]
        torch._foreach_lerp_(_locals(self.averages), weights, 1 - self.decay)

    @torch.no_grad()
    def restart(self) -> None:
        """The average starts again at the weights as they are now."""
        torch._foreach_copy_(_locals(self.averages), _locals(self.params))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter name: its average} (DTensors under FSDP2): what a checkpoint saves and loads in place."""
        return self.averages

    @contextlib.contextmanager
    def swapped_in(self):
        """The average in the model's parameters inside the block, the raw weights back after it, bit for bit.
        FSDP2 keeps the root's gathered parameters after a forward pass: they are let go on both sides of the swap,
        so that the next forward gathers the weights now in the shards."""
        params = _locals(self.params)
        with torch.no_grad():
            raw = [p.clone() for p in params]
            _reshard(self.model)
            torch._foreach_copy_(params, _locals(self.averages))
        try:
            yield
        finally:
            with torch.no_grad():
                _reshard(self.model)
                torch._foreach_copy_(params, raw)


def weights_scored_by(key: str, average: WeightsAverage | None):
    """The weights an evaluation's score `key` is of, in the model inside the block: the average's for ema/KEY."""
    if key.startswith(SCORE_PREFIX) and average is not None:
        return average.swapped_in()
    return contextlib.nullcontext()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (its storage: written in place)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _locals(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [_local(t) for t in tensors.values()]


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
