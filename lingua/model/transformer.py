"""Transformer building blocks shared by every app: RMSNorm, RoPE, SwiGLU, self- and cross-attention blocks.

Positions are per token (`[batch, seq]`), so a sequence whose tokens were gathered out of order (CrossBERT's visible
tokens) keeps each token's original position. Attention masks are described once, as per-token group ids
(`AttnMask`): a query attends to a key iff their ids are equal. Each attention backend (one `AttentionBackend` in
`ATTN_BACKENDS`, by its config name) turns that description into its own mask format and computes attention with it;
`None` means full bidirectional attention. Rows made of independent parts of static lengths (CrossBERT's
two views) are described by `Segments` instead: each part's attention is computed on its own, with no mask and no
score computed across parts.

Models are built on the meta device and materialised by `init_weights` (truncated normal, std `init_std`).
"""

import abc
import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.profiler import record_function

from lingua.errors import ConfigError, at_least, require
from lingua.model.masking import HEAD_LOSSES, chunked_lm_loss, masked_lm_loss


@dataclass
class TransformerArgs:
    dim: int = 768  # model width
    n_layers: int = 12  # transformer blocks
    n_heads: int = 12  # attention heads
    head_dim: int | None = None  # default: dim // n_heads
    ffn_multiple_of: int = 256  # SwiGLU hidden size is 8*dim/3 rounded up to a multiple of this (Lingua's rule)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    max_seqlen: int = 512  # longest sequence (RoPE table size)
    init_std: float = 0.02  # std of the truncated-normal init of every matrix and embedding
    attn_backend: str = "sdpa"  # sdpa (CPU and GPU) | flex (flex_attention: compiled on GPU) | xformers (if installed)
    head_chunk: int = 4096  # predicted tokens the output head and its loss take at a time; 0: all logits at once
    head_loss: str = "auto"  # eager (reference) | compiled (each chunk fused) | liger (CUDA) | auto: head_loss_path
    scale_embeddings: bool = True  # token embeddings enter the residual stream times sqrt(dim); false: unscaled
    output_bias: bool = False  # a learned per-token bias in the tied output head (zero at init)

    # The fields that make another model (a checkpoint of different ones is refused on resume), not another run.
    ARCHITECTURE: ClassVar[tuple[str, ...]] = ("dim", "n_layers", "n_heads", "head_dim", "ffn_multiple_of", "norm_eps",
                                               "rope_theta", "scale_embeddings", "output_bias")

    def __post_init__(self):
        at_least(self, 1, "dim", "n_layers", "n_heads", "head_dim", "ffn_multiple_of", "max_seqlen")
        at_least(self, 0, "head_chunk")
        require(self.head_loss in HEAD_LOSSES, "head_loss",
                f"must be one of {', '.join(HEAD_LOSSES)}, got '{self.head_loss}'")
        for name in ("norm_eps", "rope_theta", "init_std"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(self.attn_backend in ATTN_BACKENDS, "attn_backend",
                f"must be one of {', '.join(ATTN_BACKENDS)}, got '{self.attn_backend}'")
        require(self.head_dim is not None or self.dim % self.n_heads == 0, "dim",
                f"{self.dim} is not divisible by n_heads {self.n_heads}; set head_dim")
        require(head_dim_of(self) % 2 == 0, "head_dim" if self.head_dim else "dim",
                f"gives heads of {head_dim_of(self)} dimensions, an odd number: rotary embeddings turn pairs of them")


def check_sub_network(name: str, shape: Callable[[], TransformerArgs]) -> None:
    """Checks, with its owner's config, the blocks of a sub-network whose shape follows from the owner's (the
    predictor's, the generator's, a pooler's): a problem is named by the owner's key `name`, before any weight
    exists."""
    try:
        shape()
    except ConfigError as e:
        raise ConfigError(name, f"makes a {name} whose {e.key} {e.problem}") from None


def sub_network(encoder: TransformerArgs, n_layers: int, dim: int | None = None, n_heads: int | None = None,
                head_dim: int | None = None, rope_theta: float | None = None) -> TransformerArgs:
    """The shapes of a network beside the encoder (CrossBERT's predictor, ELECTRA's generator, an attention pooler):
    its own depth; the encoder's width, heads and RoPE base unless given; the encoder's head size unless given, when
    width and heads are the encoder's (else dim // n_heads); the encoder's norms, init and attention backend."""
    dim, n_heads = dim or encoder.dim, n_heads or encoder.n_heads
    same_heads = (dim, n_heads) == (encoder.dim, encoder.n_heads)
    return dataclasses.replace(encoder, n_layers=n_layers, dim=dim, n_heads=n_heads,
                               head_dim=head_dim or (encoder.head_dim if same_heads else None),
                               rope_theta=rope_theta or encoder.rope_theta)


def quarter_depth(encoder: TransformerArgs) -> int:
    """The default depth of a network beside the encoder: a quarter of the encoder's, at least one block."""
    return max(1, encoder.n_layers // 4)


def architecture_fields(args, prefix: str = "") -> list[str]:
    """The dotted keys of every architecture field in a tree of config dataclasses (each class lists its own in
    `ARCHITECTURE`)."""
    keys = [f"{prefix}{name}" for name in getattr(type(args), "ARCHITECTURE", ())]
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if dataclasses.is_dataclass(value):
            keys += architecture_fields(value, f"{prefix}{f.name}.")
    return keys


def ffn_hidden_dim(dim: int, multiple_of: int) -> int:
    return multiple_of * math.ceil(8 * dim / 3 / multiple_of)


def head_dim_of(args: TransformerArgs) -> int:
    return args.head_dim or args.dim // args.n_heads


@dataclass
class AttnMask:
    """Query i of row b attends to key j iff q_ids[b, i] == kv_ids[b, j]."""

    q_ids: torch.Tensor  # [B, Sq] integer
    kv_ids: torch.Tensor  # [B, Sk] integer

    def within(self, groups: "AttnMask", n_groups: int) -> "AttnMask":
        """Attention that both this mask and `groups` (ids 0..n_groups-1) allow: one id per pair of ids, so that
        every backend takes it as it takes any mask."""
        return AttnMask(self.q_ids * n_groups + groups.q_ids, self.kv_ids * n_groups + groups.kv_ids)


@dataclass(frozen=True)
class Segments:
    """Every row is the same sequence of independent segments laid end to end: query segment i attends to key
    segment i only. Lengths are static (Python ints), so shapes stay static under torch.compile."""

    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...]

    def __post_init__(self):
        if len(self.q_lengths) != len(self.kv_lengths):
            raise ValueError(f"{len(self.q_lengths)} query segments but {len(self.kv_lengths)} key segments")


def padding_mask(pad_mask: torch.Tensor | None) -> AttnMask | None:
    """Keeps real tokens (pad_mask True) from attending to padding: real tokens get id 0, padding id 1."""
    if pad_mask is None:
        return None
    ids = (~pad_mask).int()
    return AttnMask(ids, ids)


def document_mask(document_ids: torch.Tensor | None) -> AttnMask | None:
    """Keeps each token to the tokens of its own document (document_ids [B, S]); None: to its whole row."""
    return None if document_ids is None else AttnMask(document_ids, document_ids)


class AttentionBackend(abc.ABC):
    """One attention kernel: the mask format it consumes (built from group ids once per forward, shared by all
    layers) and the attention it computes with that mask (None: full attention). Tensors are [B, S, H, Dh]."""

    name: ClassVar[str]  # the `attn_backend` value that selects it

    @abc.abstractmethod
    def bias(self, mask: AttnMask, n_heads: int):
        """The mask in this kernel's format."""

    @abc.abstractmethod
    def attend(self, q, k, v, bias) -> torch.Tensor:
        """q: [B, Sq, H, Dh], k/v: [B, Sk, H, Dh] -> [B, Sq, H, Dh]."""


class SdpaBackend(AttentionBackend):
    """PyTorch's scaled_dot_product_attention (CPU and GPU) with a boolean mask."""

    name = "sdpa"

    def bias(self, mask, n_heads):
        return (mask.q_ids[:, :, None] == mask.kv_ids[:, None, :])[:, None]  # [B, 1, Sq, Sk] bool

    def attend(self, q, k, v, bias):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexBackend(AttentionBackend):
    """flex_attention with a block mask, which skips the blocks where no query attends any key: compiled on a GPU;
    eager elsewhere, since inductor's CPU kernel for it computed wrong rows on an AVX2 host (torch 2.13, up to 1.1
    off; `test_backends_agree_with_sdpa`), where the eager reference is right."""

    name = "flex"

    def bias(self, mask, n_heads):
        from torch.nn.attention.flex_attention import create_block_mask

        q_ids, kv_ids = mask.q_ids, mask.kv_ids

        def same_group(b, h, q, kv):
            return q_ids[b, q] == kv_ids[b, kv]

        B, Sq, Sk = q_ids.shape[0], q_ids.shape[1], kv_ids.shape[1]
        return create_block_mask(same_group, B, None, Sq, Sk, device=q_ids.device)

    def attend(self, q, k, v, bias):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if q.is_cuda:
            return _compiled_flex_attention()(q, k, v, block_mask=bias).transpose(1, 2)
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=bias).transpose(1, 2)


class XformersBackend(AttentionBackend):
    """xformers' memory_efficient_attention (if installed) with an additive bias, -inf where attention is barred."""

    name = "xformers"

    def bias(self, mask, n_heads):
        allowed = mask.q_ids[:, None, :, None] == mask.kv_ids[:, None, None, :]
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(~allowed, -math.inf)
        return bias.expand(-1, n_heads, -1, -1)  # xformers wants [B, H, Sq, Sk]

    def attend(self, q, k, v, bias):
        import xformers.ops as xops

        return xops.memory_efficient_attention(q, k, v, attn_bias=None if bias is None else bias.to(q.dtype))


# Every backend by the name `attn_backend` takes; the config accepts exactly these.
ATTN_BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (SdpaBackend(), FlexBackend(), XformersBackend())}


def build_attn_bias(mask: AttnMask | Segments | None, backend: str, n_heads: int):
    """Translates the group-id mask into what `backend` consumes; built once per forward, shared by all layers."""
    if mask is None or isinstance(mask, Segments):
        return mask
    return ATTN_BACKENDS[backend].bias(mask, n_heads)


def attention(q, k, v, bias, backend: str) -> torch.Tensor:
    """q: [B, Sq, H, Dh], k/v: [B, Sk, H, Dh] -> [B, Sq, H, Dh]."""
    if isinstance(bias, Segments):
        return segmented_attention(q, k, v, bias, backend)
    return ATTN_BACKENDS[backend].attend(q, k, v, bias)


def segmented_attention(q, k, v, segments: Segments, backend: str) -> torch.Tensor:
    """Unmasked attention within each segment. Equal segments fold into the batch ([B, n x L] -> [B n, L], a view,
    one kernel call); unequal ones are computed one after the other."""
    n = len(segments.q_lengths)
    if len(set(segments.q_lengths)) == 1 and len(set(segments.kv_lengths)) == 1:
        def fold(t):
            return t.reshape(t.shape[0] * n, t.shape[1] // n, *t.shape[2:])

        return attention(fold(q), fold(k), fold(v), None, backend).reshape(q.shape)
    parts = zip(q.split(segments.q_lengths, 1), k.split(segments.kv_lengths, 1), v.split(segments.kv_lengths, 1))
    return torch.cat([attention(*part, None, backend) for part in parts], 1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_seqlen-1, looked up per token."""

    def __init__(self, head_dim: int, max_seqlen: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seqlen, self.theta = head_dim, max_seqlen, theta
        self.register_buffer("cos", torch.empty(max_seqlen, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seqlen, head_dim // 2), persistent=False)

    def reset_parameters(self):
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        angles = torch.outer(torch.arange(self.max_seqlen, dtype=torch.float32), inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> (cos, sin), each [B, S, 1, head_dim // 2]."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotates the two halves of each head's features; x: [B, S, H, Dh]."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Multi-head attention of `x` over `context` (self-attention when context is x), RoPE on queries and keys."""

    def __init__(self, dim: int, n_heads: int, head_dim: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, context, q_rope, kv_rope, bias, backend: str) -> torch.Tensor:
        q, k = self.rotated_queries_keys(x, context, q_rope, kv_rope)
        v = self.wv(context).view(*context.shape[:2], self.n_heads, self.head_dim)
        return self.wo(attention(q, k, v, bias, backend).flatten(2))

    def rotated_queries_keys(self, x, context, q_rope, kv_rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [B, Sq, H, Dh] of x and keys [B, Sk, H, Dh] of context, RoPE applied."""
        q = self.wq(x).view(*x.shape[:2], self.n_heads, self.head_dim)
        k = self.wk(context).view(*context.shape[:2], self.n_heads, self.head_dim)
        return apply_rope(q, q_rope), apply_rope(k, kv_rope)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def profiled(region: str):
    """A range the profiler names (`record_function`) around the forward ops of a block's attention or MLP, entered
    only while a profiler runs (a range costs microseconds). Compiled, it is left out: a captured range survives
    neither AOT autograd's reordering nor Inductor (which removes it to fuse across it); the GPU acceptance's profile
    tells a compiled block's attention from its MLP by the matmuls' shapes instead."""
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return record_function(region)


class PreNormBlock(nn.Module):
    """RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual. Subclasses choose what is attended."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.backend = args.attn_backend
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, head_dim_of(args))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args.dim, args.ffn_multiple_of))


class SelfAttentionBlock(PreNormBlock):
    """Bidirectional self-attention then SwiGLU."""

    def forward(self, h, rope, bias) -> torch.Tensor:
        with profiled("attention"):
            x = self.attention_norm(h)
            h = h + self.attention(x, x, rope, rope, bias, self.backend)
        with profiled("mlp"):
            h = h + self.feed_forward(self.ffn_norm(h))
        return h


class CrossAttentionBlock(PreNormBlock):
    """Cross-attention from the queries to a context (no self-attention), then SwiGLU.

    The queries never see each other, so each query's output depends only on itself and the context.
    """

    def forward(self, h, context, q_rope, kv_rope, bias) -> torch.Tensor:
        with profiled("attention"):
            h = h + self.attention(self.attention_norm(h), context, q_rope, kv_rope, bias, self.backend)
        with profiled("mlp"):
            h = h + self.feed_forward(self.ffn_norm(h))
        return h


def init_weights(module: nn.Module, std: float) -> None:
    """Materialises a module built on the meta device: norms to one, RoPE tables computed, the rest trunc-normal."""
    for sub in module.modules():
        if isinstance(sub, (RMSNorm, RotaryEmbedding)):
            sub.reset_parameters()
        elif isinstance(sub, (nn.Linear, nn.Embedding)):
            trunc_normal_(sub.weight, std)
        elif isinstance(sub, Encoder) and sub.output_bias is not None:
            nn.init.zeros_(sub.output_bias)


def trunc_normal_(tensor: torch.Tensor, std: float) -> None:
    """In place. A sharded (FSDP) parameter gets the values one process would draw: the full tensor is drawn from the
    same seeded generator on every rank, which keeps its own shard, so weights do not depend on the world size."""
    if isinstance(tensor, DTensor):
        full = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device_mesh.device_type)
        trunc_normal_(full, std)
        tensor.copy_(distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None))
        return
    nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Encoder(nn.Module):
    """Token embedding, a stack of self-attention blocks, final RMSNorm. Output head: tied embedding (`logits`)."""

    def __init__(self, args: TransformerArgs, vocab_size: int):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(vocab_size, args.dim)
        self.rope = RotaryEmbedding(head_dim_of(args), args.max_seqlen, args.rope_theta)
        self.layers = nn.ModuleList(SelfAttentionBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output_bias = nn.Parameter(torch.empty(vocab_size)) if args.output_bias else None

    def forward(self, tokens, positions, mask: AttnMask | Segments | None = None, all_layers: bool = False):
        """tokens, positions: [B, S] -> final hidden states [B, S, D] after the final norm.

        With all_layers, a list of every block's output (the residual stream), the last one after the final norm.
        """
        h = self.embed(tokens)
        rope = self.rope(positions)
        bias = build_attn_bias(mask, self.args.attn_backend, self.args.n_heads)
        outputs = []
        for layer in self.layers:
            h = layer(h, rope, bias)
            outputs.append(h)
        outputs[-1] = self.norm(h)
        return outputs if all_layers else outputs[-1]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings as they enter the residual stream, times sqrt(dim) with scale_embeddings (unscaled,
        the blocks' outputs drown the token identities at init, which starves CrossBERT's predictor:
        docs/crossbert_slow_start.md)."""
        h = self.tok_embeddings(tokens)
        return h * math.sqrt(self.args.dim) if self.args.scale_embeddings else h

    def encode(self, tokens, pad_mask: torch.Tensor | None = None, all_layers: bool = False):
        """The full sequence at positions 0..S-1, padding (pad_mask False) hidden from the real tokens."""
        return self(tokens, default_positions(tokens), padding_mask(pad_mask), all_layers)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.tok_embeddings.weight, self.output_bias)

    def lm_loss(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross-entropy (and accuracy) of the tied head's predictions from h [..., D] against targets [...],
        head_chunk rows at a time, by the head_loss path: the [rows, vocab] logits never exist whole (head_chunk 0:
        they do, through autograd, the plain way, kept as the reference)."""
        with torch.profiler.record_function("head+loss"):
            if self.args.head_chunk == 0:
                return masked_lm_loss(self.logits(h), targets)
            return chunked_lm_loss(h, self.tok_embeddings.weight, targets, self.args.head_chunk, self.output_bias,
                                   self.args.head_loss)


def default_positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
