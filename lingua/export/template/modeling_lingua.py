"""A text encoder exported from Lingua, in plain PyTorch for `transformers` (`trust_remote_code=True`).

Copied into every export folder by `python -m lingua.export`; it needs `torch` and `transformers`, not the Lingua
repository. It computes what Lingua computes, operation for operation:

- `LinguaModel` (AutoModel), Lingua's `Encoder.encode` and poolers: token embedding (times sqrt(hidden_size) with
  `scale_embeddings`), pre-norm blocks (RMSNorm, bidirectional self-attention with RoPE on the two halves of each
  head, SwiGLU), a final RMSNorm: `last_hidden_state`; padding: a real token attends to the real tokens only, a
  padding token to the padding only (Lingua's mask); `pooler_output`, the L2-normalised sentence embedding: the mean
  of the real tokens' states (`pooling="mean"`), or a learned query that reads them through cross-attention blocks
  without RoPE, then an RMSNorm (`pooling="attention"`);
- `LinguaForSequenceClassification`: a linear head on the vector that `classifier_pooling` names, not normalised:
  the float32 mean of the real tokens' states, the first token's (`<s>`), or the attention pooler's;
- `LinguaForTokenClassification`: a linear head on every token's state;
- `LinguaForMaskedLM` (`masked_lm` other than "none"): the output head tied to the token embedding (plus the
  run's output bias, `mlm_output_bias`) on the states of what predicts a `<mask>` in Lingua. `encoder` (e.g. BERT):
  the encoder's final states. `cross_attention` (e.g. CrossBERT's predictor): the encoder reads the real tokens other
  than `<mask>` only (the `<mask>` tokens never enter its attention), and the network puts its learned mask embedding
  at every position, which reads those states through cross-attention only, RoPE at each query's and key's position:
  at a `<mask>` this is the model's prediction; at another position, its prediction of that token from the same
  tokens, itself included. `self_attention` (e.g. ELECTRA's generator): the network's self-attention blocks over the
  encoder's token embeddings of the input.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)

from .configuration_lingua import LinguaConfig


class LinguaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(config: LinguaConfig, head_dim: int, theta: float, seq_len: int,
                device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, seq_len, 1, head_dim // 2]: the first rows of the whole table, computed as Lingua computes it."""
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"{seq_len} tokens: this model takes at most {config.max_position_embeddings}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)[:seq_len]
    return angles.cos()[None, :, None], angles.sin()[None, :, None]


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


def same_group(groups: torch.Tensor | None) -> torch.Tensor | None:
    """[B, 1, S, S] bool: a token attends to the tokens of its own group (groups [B, S] ints); None: to all."""
    return None if groups is None else (groups[:, :, None] == groups[:, None, :])[:, None]


def real_tokens(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if attention_mask is None else attention_mask.bool()


def padding_groups(real: torch.Tensor | None) -> torch.Tensor | None:
    """Lingua's padding mask as groups: the real tokens (True) in one, the padding in the other."""
    return None if real is None else (~real).int()


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

    def __init__(self, dim: int, n_heads: int, head_dim: int, hidden_dim: int, eps: float):
        super().__init__()
        self.attention_norm = LinguaRMSNorm(dim, eps)
        self.attention = LinguaAttention(dim, n_heads, head_dim)
        self.ffn_norm = LinguaRMSNorm(dim, eps)
        self.feed_forward = LinguaFeedForward(dim, hidden_dim)

    def forward(self, h, rope, allowed, context=None):
        x = self.attention_norm(h)
        h = h + self.attention(x, x if context is None else context, rope, allowed)
        return h + self.feed_forward(self.ffn_norm(h))


def blocks(config: LinguaConfig, n_layers: int, dim: int, n_heads: int, head_dim: int,
           hidden_dim: int) -> nn.ModuleList:
    return nn.ModuleList(LinguaBlock(dim, n_heads, head_dim, hidden_dim, config.rms_norm_eps)
                         for _ in range(n_layers))


def mlm_blocks(config: LinguaConfig) -> nn.ModuleList:
    """The blocks of the masked-LM head's network."""
    return blocks(config, config.mlm_num_layers, config.mlm_hidden_size, config.mlm_num_attention_heads,
                  config.mlm_head_dim, config.mlm_intermediate_size)


class LinguaAttentionPooler(nn.Module):
    """A learned query reads the token states through cross-attention blocks, then the final norm. No RoPE: the
    pooled vector does not depend on where a text sits in its row."""

    def __init__(self, config: LinguaConfig):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        self.layers = blocks(config, config.pooler_num_layers, config.hidden_size, config.pooler_num_attention_heads,
                             config.pooler_head_dim, config.intermediate_size)
        self.norm = LinguaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """[B, D] float32, before the L2 normalisation."""
        h = self.query.expand(hidden.shape[0], 1, -1)
        allowed = None if real is None else real[:, None, None, :]
        for layer in self.layers:
            h = layer(h, None, allowed, context=hidden)
        return self.norm(h)[:, 0].float()


class LinguaCrossAttentionNetwork(nn.Module):
    """`masked_lm="cross_attention"`: its mask embedding at every position reads the encoder's states of the visible
    tokens through cross-attention blocks, then a final norm; projections in and out when its width is not the
    encoder's."""

    def __init__(self, config: LinguaConfig):
        super().__init__()
        self.config = config
        dim = config.mlm_hidden_size
        resize = dim != config.hidden_size
        self.mask_embedding = nn.Parameter(torch.zeros(dim))
        self.context_proj = nn.Linear(config.hidden_size, dim, bias=False) if resize else nn.Identity()
        self.layers = mlm_blocks(config)
        self.norm = LinguaRMSNorm(dim, config.rms_norm_eps)
        self.output_proj = nn.Linear(dim, config.hidden_size, bias=False) if resize else nn.Identity()

    def forward(self, hidden: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """hidden [B, S, D], visible [B, S] bool: the keys every query reads -> [B, S, D]."""
        B, S = visible.shape
        h = self.mask_embedding.expand(B, S, -1)
        context = self.context_proj(hidden)
        rope = rope_tables(self.config, self.config.mlm_head_dim, self.config.mlm_rope_theta, S, hidden.device)
        for layer in self.layers:
            h = layer(h, rope, visible[:, None, None, :], context=context)
        return self.output_proj(self.norm(h))


class LinguaSelfAttentionNetwork(nn.Module):
    """`masked_lm="self_attention"`: self-attention blocks and a final norm over the encoder's token embeddings."""

    def __init__(self, config: LinguaConfig):
        super().__init__()
        self.config = config
        self.layers = mlm_blocks(config)
        self.norm = LinguaRMSNorm(config.mlm_hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
        rope = rope_tables(self.config, self.config.mlm_head_dim, self.config.mlm_rope_theta, h.shape[1], h.device)
        allowed = same_group(groups)
        for layer in self.layers:
            h = layer(h, rope, allowed)
        return self.norm(h)


class LinguaPreTrainedModel(PreTrainedModel):
    config_class = LinguaConfig
    base_model_prefix = "lingua"
    _no_split_modules = ["LinguaBlock"]
    # one model.safetensors holds every head's weights: each class takes its own
    _keys_to_ignore_on_load_unexpected = [r"^classifier\.", r"^token_classifier\.", r"^mlm_network\.",
                                          r"^output_bias$"]

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LinguaAttentionPooler):
            nn.init.normal_(module.query, std=self.config.initializer_range)
        elif isinstance(module, LinguaCrossAttentionNetwork):
            nn.init.normal_(module.mask_embedding, std=self.config.initializer_range)
        elif isinstance(module, LinguaForMaskedLM) and module.output_bias is not None:
            nn.init.zeros_(module.output_bias)


def returned(output, return_dict: bool | None):
    return output.to_tuple() if return_dict is False else output  # a tuple when asked, as transformers' models


class LinguaModel(LinguaPreTrainedModel):
    """input_ids, attention_mask [B, S] -> last_hidden_state [B, S, D] and pooler_output [B, D] (unit rows)."""

    def __init__(self, config: LinguaConfig):
        super().__init__(config)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = blocks(config, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                             config.head_dim, config.intermediate_size)
        self.norm = LinguaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pooler = LinguaAttentionPooler(config) if config.pooling == "attention" else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.tok_embeddings = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                return_dict: bool | None = None):
        real = real_tokens(attention_mask)
        hidden = self.encode(input_ids, padding_groups(real))
        pooled = F.normalize(self.pooled(hidden, real, self.config.pooling), dim=-1)
        return returned(BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled), return_dict)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        return h * math.sqrt(self.config.hidden_size) if self.config.scale_embeddings else h

    def encode(self, input_ids: torch.Tensor, groups: torch.Tensor | None) -> torch.Tensor:
        """The final states [B, S, D]; a token attends to the tokens of its group (`same_group`)."""
        config = self.config
        rope = rope_tables(config, config.head_dim, config.rope_theta, input_ids.shape[1], input_ids.device)
        h = self.embed(input_ids)
        allowed = same_group(groups)
        for layer in self.layers:
            h = layer(h, rope, allowed)
        return self.norm(h)

    def pooled(self, hidden: torch.Tensor, real: torch.Tensor | None, kind: str) -> torch.Tensor:
        """[B, D] float32 before the L2 normalisation: `kind` is "attention", "first" or "mean"."""
        if kind == "attention":
            return self.pooler(hidden, real)
        return hidden[:, 0].float() if kind == "first" else mean_pool(hidden, real)


def mean_pool(hidden: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """The mean over the real tokens (all when real is None), in float32."""
    if real is None:
        return hidden.float().mean(1)
    mask = real.unsqueeze(-1).float()
    return (hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1)


class LinguaForSequenceClassification(LinguaPreTrainedModel):
    """logits [B, num_labels]: a linear head on the pooled vector; with labels, transformers' loss (regression
    when num_labels is 1)."""

    def __init__(self, config: LinguaConfig):
        super().__init__(config)
        if config.classifier_pooling == "attention" and config.pooling != "attention":
            raise ValueError("classifier_pooling='attention' reads the attention pooler, which this export has not "
                             "(pooling='mean'): use classifier_pooling='mean' or 'first'")
        self.num_labels = config.num_labels
        self.lingua = LinguaModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_dict: bool | None = None):
        real = real_tokens(attention_mask)
        hidden = self.lingua.encode(input_ids, padding_groups(real))
        logits = self.classifier(self.lingua.pooled(hidden, real, self.config.classifier_pooling))
        loss = None if labels is None else self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return returned(SequenceClassifierOutput(loss=loss, logits=logits), return_dict)


class LinguaForTokenClassification(LinguaPreTrainedModel):
    """logits [B, S, num_labels]: a linear head on every token's state; labels -100 are left out of the loss."""

    def __init__(self, config: LinguaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.lingua = LinguaModel(config)
        self.token_classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_dict: bool | None = None):
        real = real_tokens(attention_mask)
        logits = self.token_classifier(self.lingua.encode(input_ids, padding_groups(real)))
        loss = None if labels is None else self.loss_function(logits, labels, self.config)
        return returned(TokenClassifierOutput(loss=loss, logits=logits), return_dict)


class LinguaForMaskedLM(LinguaPreTrainedModel):
    """logits [B, S, vocab_size] of the tied head at every position; those at the `<mask>` tokens are Lingua's
    predictions; labels -100 are left out of the loss."""

    def __init__(self, config: LinguaConfig):
        super().__init__(config)
        if config.masked_lm == "none":
            raise ValueError("this export has no masked-LM head: its run (contrastive or fine-tuning) predicts no "
                             "token; AutoModel gives its states")
        self.lingua = LinguaModel(config)
        networks = {"cross_attention": LinguaCrossAttentionNetwork, "self_attention": LinguaSelfAttentionNetwork}
        self.mlm_network = networks[config.masked_lm](config) if config.masked_lm in networks else None
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.mlm_output_bias else None
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_dict: bool | None = None):
        real = real_tokens(attention_mask)
        logits = F.linear(self.predicting_states(input_ids, real), self.lingua.tok_embeddings.weight, self.output_bias)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return returned(MaskedLMOutput(loss=loss, logits=logits), return_dict)

    def predicting_states(self, input_ids: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        """[B, S, hidden_size]: the states the tied head reads."""
        if self.config.masked_lm == "cross_attention":
            real = torch.ones_like(input_ids, dtype=torch.bool) if real is None else real
            visible = real & (input_ids != self.config.mask_token_id)
            # groups: the visible tokens (0), the <mask> tokens (1) and the padding (2) attend within themselves
            hidden = self.lingua.encode(input_ids, (~visible).int() + (~real).int())
            return self.mlm_network(hidden, visible)
        if self.config.masked_lm == "self_attention":
            return self.mlm_network(self.lingua.embed(input_ids), padding_groups(real))
        return self.lingua.encode(input_ids, padding_groups(real))
