"""A text encoder exported from Lingua, in plain PyTorch for `transformers` (`trust_remote_code=True`).

Copied into every export folder by `python -m lingua.export`; it needs `torch` and `transformers`, not the Lingua
repository. It computes what Lingua's `Encoder.encode` and poolers compute, operation for operation:

- token embedding (times sqrt(hidden_size) with `scale_embeddings`), pre-norm blocks (RMSNorm, bidirectional
  self-attention with RoPE on the two halves of each head, SwiGLU), a final RMSNorm: `last_hidden_state`;
- padding: a real token attends to the real tokens only, a padding token to the padding only (Lingua's mask);
- `pooler_output`, the L2-normalised sentence embedding: the mean of the real tokens' states (`pooling="mean"`),
  or a learned query that reads them through cross-attention blocks without RoPE, then an RMSNorm
  (`pooling="attention"`).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .configuration_lingua import LinguaConfig


class LinguaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(config: LinguaConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, seq_len, 1, head_dim // 2]: rows of the whole table, computed as Lingua computes it."""
    dim = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)[:seq_len]
    return angles.cos()[None, :, None], angles.sin()[None, :, None]


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class LinguaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, context, rope, allowed):
        """x [B, Sq, D] attends to context [B, Sk, D]; rope None: no rotation; allowed: bool, broadcast to
        [B, 1, Sq, Sk], or None (everything)."""
        B, Sq, Sk = x.shape[0], x.shape[1], context.shape[1]
        q = self.wq(x).view(B, Sq, self.n_heads, self.head_dim)
        k = self.wk(context).view(B, Sk, self.n_heads, self.head_dim)
        v = self.wv(context).view(B, Sk, self.n_heads, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=allowed)
        return self.wo(out.transpose(1, 2).reshape(B, Sq, -1))


class LinguaFeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LinguaBlock(nn.Module):
    """RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual. Self-attention when context is None."""

    def __init__(self, config: LinguaConfig, n_heads: int, head_dim: int):
        super().__init__()
        self.attention_norm = LinguaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = LinguaAttention(config.hidden_size, n_heads, head_dim)
        self.ffn_norm = LinguaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = LinguaFeedForward(config.hidden_size, config.intermediate_size)

    def forward(self, h, rope, allowed, context=None):
        x = self.attention_norm(h)
        h = h + self.attention(x, x if context is None else context, rope, allowed)
        return h + self.feed_forward(self.ffn_norm(h))


class LinguaAttentionPooler(nn.Module):
    """A learned query reads the token states through cross-attention blocks, then the final norm. No RoPE: the
    pooled vector does not depend on where a text sits in its row."""

    def __init__(self, config: LinguaConfig):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        self.layers = nn.ModuleList(
            LinguaBlock(config, config.pooler_num_attention_heads, config.pooler_head_dim)
            for _ in range(config.pooler_num_layers))
        self.norm = LinguaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        h = self.query.expand(hidden.shape[0], 1, -1)
        allowed = None if real is None else real[:, None, None, :]
        for layer in self.layers:
            h = layer(h, None, allowed, context=hidden)
        return self.norm(h)[:, 0].float()


class LinguaPreTrainedModel(PreTrainedModel):
    config_class = LinguaConfig
    base_model_prefix = "lingua"
    _no_split_modules = ["LinguaBlock"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LinguaAttentionPooler):
            nn.init.normal_(module.query, std=self.config.initializer_range)


class LinguaModel(LinguaPreTrainedModel):
    """input_ids, attention_mask [B, S] -> last_hidden_state [B, S, D] and pooler_output [B, D] (unit rows)."""

    def __init__(self, config: LinguaConfig):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LinguaBlock(config, config.num_attention_heads, config.head_dim) for _ in range(config.num_hidden_layers))
        self.norm = LinguaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pooler = LinguaAttentionPooler(config) if config.pooling == "attention" else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.tok_embeddings = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                return_dict: bool | None = None):
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_position_embeddings:
            raise ValueError(f"{seq_len} tokens: this model takes at most {self.config.max_position_embeddings}")
        real = None if attention_mask is None else attention_mask.bool()
        # Lingua's padding mask: a query attends to a key iff both are real tokens or both are padding
        allowed = None if real is None else (real[:, :, None] == real[:, None, :])[:, None]
        h = self.tok_embeddings(input_ids)
        if self.config.scale_embeddings:
            h = h * math.sqrt(self.config.hidden_size)
        rope = rope_tables(self.config, seq_len, input_ids.device)
        for layer in self.layers:
            h = layer(h, rope, allowed)
        hidden = self.norm(h)
        if self.pooler is not None:
            pooled = self.pooler(hidden, real)
        else:
            pooled = mean_pool(hidden, torch.ones_like(input_ids, dtype=torch.bool) if real is None else real)
        output = BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=F.normalize(pooled, dim=-1))
        return output.to_tuple() if return_dict is False else output  # a tuple when asked, as transformers' models


def mean_pool(hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The mean over the real tokens, in float32."""
    mask = real.unsqueeze(-1).float()
    return (hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1)
