"""Static-shape masking and the masked-LM loss, shared by the apps.

A row of S tokens gets exactly round(ratio * S) masked positions, picked by a random permutation (argsort of uniform
noise drawn from the loop's generator), so no tensor shape depends on the draw and torch.compile sees static shapes.
"""

import torch
import torch.nn.functional as F

from lingua.args import UserError


def num_masked(mask_ratio: float, seq_len: int) -> int:
    """round(mask_ratio * seq_len); a ratio that masks no token, or every token, of a row is a UserError."""
    n = round(mask_ratio * seq_len)
    if not 0 < n < seq_len:
        raise UserError(f"mask_ratio {mask_ratio} masks {n} of {seq_len} tokens per sequence; need 0 < masked < "
                        f"{seq_len}: change model.mask_ratio or data.seq_len")
    return n


def random_positions(batch: int, seq_len: int, generator: torch.Generator, device) -> torch.Tensor:
    """One random permutation of 0..seq_len-1 per row, [batch, seq_len]."""
    noise = torch.rand(batch, seq_len, generator=generator, device=device)
    return noise.argsort(dim=1)


def gather_tokens(h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """h [B, S, D], index [B, K] -> [B, K, D]."""
    return h.gather(1, index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))


def masked_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    accuracy = (logits.argmax(-1) == targets).float().mean()
    return loss, {"accuracy": accuracy.detach()}
