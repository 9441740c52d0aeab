"""Parameter counts and the paper's compute accounting.

N is the number of non-embedding parameters (attention and feed-forward matrices; norm weights and the tied
embedding excluded). FLOPs per token of a forward-backward pass, eq. 7: F_N = 6 N + 12 d L S; compute, eq. 6:
C = F_N D. An app combines these for its own model (CrossBERT's eq. 8 is in apps/crossbert/model.py).

The hardware count (`mfu_hw`) is what the kernels run instead: every matmul, heads included, and attention over the
keys each query actually sees (a CMS view's own tokens, not the S of eq. 7); activation recomputation left out.
"""

from torch import nn

from lingua.model.transformer import TransformerArgs, ffn_hidden_dim, head_dim_of


def count_params(model: nn.Module, embeddings: bool = True) -> int:
    """All parameters, or (embeddings=False) those outside nn.Embedding tables."""
    skip = set() if embeddings else {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def block_params(args: TransformerArgs) -> int:
    """Matrices of one attention (or cross-attention) + SwiGLU block."""
    attn = 4 * args.dim * args.n_heads * head_dim_of(args)
    ffn = 3 * args.dim * ffn_hidden_dim(args.dim, args.ffn_multiple_of)
    return attn + ffn


def non_embedding_params(args: TransformerArgs) -> int:
    return args.n_layers * block_params(args)


def encoder_flops_per_token(args: TransformerArgs, seq_len: int) -> float:
    """Eq. 7: 6N for the matrices, 12 d L S for attention scores and values (forward + backward)."""
    return 6 * non_embedding_params(args) + 12 * args.dim * args.n_layers * seq_len


def attention_flops(args: TransformerArgs, keys: int) -> float:
    """Per query, forward and backward, in all of args' layers: scores and weighted values over `keys` keys."""
    return 12 * args.n_heads * head_dim_of(args) * keys * args.n_layers


def self_attention_flops_per_token(args: TransformerArgs, keys: int) -> float:
    """The hardware count of a self-attention stack per token: every matrix, and attention over `keys` keys (eq. 7
    when keys is the sequence length and the heads span the width)."""
    return 6 * non_embedding_params(args) + attention_flops(args, keys)


def output_head_flops(dim: int, vocab_size: int) -> float:
    """Per predicted token, forward and backward: the tied head's [dim, vocab] matmul, which eq. 7 leaves out (the
    paper's convention) although it runs; at small widths it is a large share of a step."""
    return 6 * dim * vocab_size
