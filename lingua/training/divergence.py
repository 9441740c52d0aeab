"""The divergence guard: a run whose loss, gradient norm or weights become non-finite stops on every rank, and never
saves them, so every kept checkpoint is finite."""

from collections.abc import Callable
from pathlib import Path

import torch

from lingua.distributed import all_reduce, parameters_finite


class Diverged(Exception):
    """The loss or the gradient norm became non-finite; the run stops without saving."""


class NonFiniteGuard:
    """Remembers, on the device, the first step whose loss or gradient norm was not finite. Reading it is a host sync,
    so the loop reads it only where it syncs anyway: before a log line, an evaluation and a checkpoint."""

    def __init__(self, device: torch.device, newest_checkpoint: Callable[[], Path | None]):
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)
        self.newest_checkpoint = newest_checkpoint  # named in the message: the newest one is finite

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.first_bad_step = torch.where(bad & (self.first_bad_step == 0), step, self.first_bad_step)

    def check(self) -> None:
        """Every rank calls this at the same steps; the first bad step of any rank stops them all."""
        latest_possible = 2**62
        encoded = torch.where(self.first_bad_step == 0, 0, latest_possible - self.first_bad_step).reshape(1)
        found = int(all_reduce(encoded, "max").item())
        step = latest_possible - found if found else 0
        if step:
            self.stop(f"the loss or gradient norm is not finite at step {step}")

    def check_before_save(self, model, step: int) -> None:
        """Also the weights themselves: an update can overflow them after the last finite loss."""
        self.check()
        if not parameters_finite(model):
            self.stop(f"the weights are not finite after step {step}")

    def stop(self, what: str) -> None:
        latest = self.newest_checkpoint()
        kept = f"the newest checkpoint, {latest.name}, has finite weights" if latest else "no checkpoint was saved"
        raise Diverged(f"{what}: the run stops without saving ({kept}); lower optim.lr or raise optim.warmup, then "
                       "run again (if it diverges again at once, that checkpoint is already unstable: delete it to "
                       "resume from an earlier one)")
