"""BERT baseline: a flat encoder trained with masked language modelling (paper section 2, eq. 1).

Masking has a static shape: exactly round(mask_ratio * seq_len) positions per row, picked by a batched random
permutation (argsort of uniform noise) and replaced by <mask>. The loss is computed only at those positions,
gathered by index, so no tensor shape depends on the random draw and torch.compile sees static shapes.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lingua.args import UserError, require
from lingua.flops import encoder_flops_per_token
from lingua.transformer import Encoder, TransformerArgs, default_positions, init_weights


@dataclass
class BertArgs:
    encoder: TransformerArgs = field(default_factory=TransformerArgs)
    mask_ratio: float = 0.2  # the paper's BERT

    def __post_init__(self):
        require(0 < self.mask_ratio < 1, "mask_ratio", f"must be strictly between 0 and 1, got {self.mask_ratio}")


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


class Bert(nn.Module):
    views_per_sequence = 1  # each data token is processed once per step

    def __init__(self, args: BertArgs, vocab_size: int, mask_id: int):
        super().__init__()
        self.args, self.mask_id = args, mask_id
        self.encoder = Encoder(args.encoder, vocab_size)

    def make_batch(self, tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        n_masked = num_masked(self.args.mask_ratio, tokens.shape[1])
        mask_idx = random_positions(*tokens.shape, generator, tokens.device)[:, :n_masked]
        return {
            "inputs": tokens.scatter(1, mask_idx, self.mask_id),
            "mask_idx": mask_idx,
            "targets": tokens.gather(1, mask_idx),
        }

    def forward(self, inputs, mask_idx, targets) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.encoder(inputs, default_positions(inputs))
        logits = self.encoder.logits(gather_tokens(h, mask_idx))
        return masked_lm_loss(logits, targets)

    def encode(self, tokens, pad_mask=None, all_layers: bool = False):
        return self.encoder.encode(tokens, pad_mask, all_layers)

    def flops_per_token_view(self, seq_len: int) -> float:
        return encoder_flops_per_token(self.args.encoder, seq_len)

    def sharding_units(self) -> list[nn.Module]:
        """The modules FSDP shards (and compiles, and checkpoints) one by one; the rest stays with the root."""
        return list(self.encoder.layers)

    def init_weights(self) -> None:
        init_weights(self, self.args.encoder.init_std)


def build_bert(args: BertArgs, tokenizer) -> Bert:
    return Bert(args, tokenizer.vocab_size, tokenizer.mask_id)
