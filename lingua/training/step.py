"""One optimizer step, the one that the training loop, the benchmark and the diagnostic all run."""

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from lingua.parallel import autocast, set_gradient_sync


@dataclass
class StepResult:
    loss: torch.Tensor  # the mean over the micro-batches, on the device (reading it is a host sync)
    grad_norm: torch.Tensor  # the global gradient norm before clipping
    stats: dict[str, torch.Tensor]  # the model's, means over the micro-batches
    predicted_tokens: int  # from shapes only


def training_step(model, optimizer, batches: list[dict[str, torch.Tensor]], clip: float,
                  precision: Callable[[], AbstractContextManager] | None = None) -> StepResult:
    """Forward and backward over each micro-batch (the model's inputs, as `make_batch` gives them), with gradients
    reduced across ranks on the last one only; then the gradient norm is clipped to `clip` (0: not clipped), the
    optimizer steps and the gradients are freed. `precision`: the autocast context (default: the device's,
    bf16 on GPU)."""
    if precision is None:
        device = next(iter(batches[0].values())).device
        precision = lambda: autocast(device)  # noqa: E731
    total_loss, totals, predicted = 0.0, {}, 0
    for micro, batch in enumerate(batches):
        set_gradient_sync(model, micro == len(batches) - 1)
        with precision():
            loss, stats = model(**batch)
        (loss / len(batches)).backward()
        total_loss = total_loss + loss.detach() / len(batches)
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value.detach().float() / len(batches)
        predicted += model.predicted_tokens(batch)
    with record_function("optimizer"):  # the clipping's norm included: a profile's share of the update
        grad_norm = clip_gradients(model, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(total_loss, grad_norm, totals, predicted)


def clip_gradients(model, max_norm: float) -> torch.Tensor:
    """The global gradient norm before clipping (over all shards), as a plain tensor on this rank's device."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
