"""Poolers: one L2-normalised vector per text from the encoder's token states (paper section 4.2, Appendix D).

`attention`: a learned query cross-attends to the token states through a few cross-attention blocks (the CrossBERT
predictor's blocks, read once), then the final norm. Neither the query nor the keys are rotated (no RoPE): the
pooled vector is a content-weighted average that does not depend on where a text sits in its row. Its parameter
names are `query`, `layers.*` and `norm.*`: a pre-trained model that offers a warm start (`pooler_warm_start`:
CrossBERT's predictor, as the paper does) gives its weights under these names. `mean`: the average of the real
tokens' states, normalised.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lingua.errors import at_least, require
from lingua.eval.features import mean_pool
from lingua.model.transformer import (
    AttnMask,
    CrossAttentionBlock,
    RMSNorm,
    TransformerArgs,
    build_attn_bias,
    head_dim_of,
    sub_network,
)

POOLERS = ("attention", "mean")


@dataclass
class PoolerArgs:
    kind: str = "attention"  # attention: a learned query and cross-attention blocks | mean: mean of the real tokens
    n_layers: int = 1  # cross-attention blocks (attention), for every app alike; a warm start must have this shape
    n_heads: int | None = None  # default: the encoder's
    warm_start: bool = True  # initialise the attention pooler from a CrossBERT predictor when init_from has one

    ARCHITECTURE: ClassVar[tuple[str, ...]] = ("n_layers", "n_heads")

    def __post_init__(self):
        require(self.kind in POOLERS, "kind", f"must be one of {', '.join(POOLERS)}, got '{self.kind}'")
        at_least(self, 1, "n_layers", "n_heads")


class AttentionPooler(nn.Module):
    """[B, S, D] token states and their pad mask -> [B, D] unit vectors (`pooled`: before the normalisation)."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.query = nn.Parameter(torch.empty(args.dim))
        self.layers = nn.ModuleList(CrossAttentionBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, hidden: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.normalize(self.pooled(hidden, pad_mask), dim=-1)

    def pooled(self, hidden: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, D] float32 before the L2 normalisation: what a classifier head reads."""
        B, S = hidden.shape[:2]
        h = self.query.expand(B, 1, -1)
        no_rotation = _identity_rope(B, max(S, 1), head_dim_of(self.args), hidden.device)
        q_rope = tuple(t[:, :1] for t in no_rotation)
        mask = None if pad_mask is None else AttnMask(torch.zeros_like(pad_mask[:, :1], dtype=torch.int),
                                                      (~pad_mask).int())
        bias = build_attn_bias(mask, self.args.attn_backend, self.args.n_heads)
        for layer in self.layers:
            h = layer(h, hidden, q_rope, no_rotation, bias)
        return self.norm(h)[:, 0].float()


def _identity_rope(batch: int, seq_len: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (batch, seq_len, 1, head_dim // 2)
    return torch.ones(shape, device=device), torch.zeros(shape, device=device)


def mean_pool_normalised(hidden: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
    return F.normalize(mean_pool(hidden, pad_mask), dim=-1)


def pooler_transformer(args: PoolerArgs, encoder: TransformerArgs) -> TransformerArgs:
    """The attention pooler's block shapes: the encoder's width, norms and backend; its own depth and heads."""
    return sub_network(encoder, args.n_layers, n_heads=args.n_heads)
