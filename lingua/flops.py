"""Parameter counts and the paper's compute accounting.

N is the number of non-embedding parameters (attention and feed-forward matrices; norm weights and the tied
embedding excluded). FLOPs per token of a forward-backward pass, eq. 7: F_N = 6 N + 12 d L S; compute, eq. 6:
C = F_N D. CrossBERT interpolates its encoder's and predictor's F_N with the mask ratio r (eq. 8).
"""

from torch import nn

from lingua.transformer import TransformerArgs, ffn_hidden_dim, head_dim_of


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


def compute_budget(flops_per_token: float, tokens: float) -> float:
    """Eq. 6."""
    return flops_per_token * tokens


def predictor_flops_per_token(predictor: TransformerArgs, encoder_dim: int, seq_len: int) -> float:
    """The cross-attention predictor's analogue of eq. 7: 6 N_pred + 12 d L S, with S the sequence length (as the
    paper's table does, though each query attends to the S - M visible tokens only). N_pred counts the cross-attention
    and SwiGLU matrices plus, when the predictor is narrower or wider than the encoder, its two projections."""
    projections = 2 * encoder_dim * predictor.dim if predictor.dim != encoder_dim else 0
    return 6 * (non_embedding_params(predictor) + projections) + 12 * predictor.dim * predictor.n_layers * seq_len


def crossbert_flops_per_token_view(
    encoder: TransformerArgs, predictor: TransformerArgs, mask_ratio: float, seq_len: int, cms: bool
) -> float:
    """Eq. 8, F_N = F_enc (1 - r) + F_pred r, per token-view: a position of one view of a sequence, of which a fraction
    1 - r is encoded and r predicted. With CMS, view B has ratio 1 - r, so the average over both views is
    (F_enc + F_pred) / 2 for any r (equal to eq. 8 at the paper's r = 0.5): a step that consumes one sequence of S
    data tokens processes 2 S token-views, and C = F_N D holds with D counting token-views (Appendix J's Tokens
    column = Steps x BSZ, so BSZ counts token-views too: BSZ / (2 S) data sequences per step)."""
    r = 0.5 if cms else mask_ratio
    f_enc = encoder_flops_per_token(encoder, seq_len)
    return f_enc * (1 - r) + predictor_flops_per_token(predictor, encoder.dim, seq_len) * r
