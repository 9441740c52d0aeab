"""CrossBERT: a deep encoder over the visible tokens and a shallow cross-attention predictor (paper sections 3, 5.1).

Each sequence of S tokens is split by a random permutation into a masked set of exactly M = round(mask_ratio * S)
positions and a visible set of the other S - M. The encoder sees only the visible tokens, gathered by index, each
keeping its original position through RoPE (no <mask> token ever enters it). The predictor places one learned mask
embedding at every masked position (RoPE with that position) and reads out the encoder through cross-attention only:
its queries never attend to each other, so it cannot reconstruct a token from the other masked tokens.

Complementary Masking Strategy (CMS, on by default): view A keeps the visible set and predicts the masked set, view B
keeps the masked set and predicts the visible set. Both views of a sequence are packed into one encoder row of S
tokens (A's S - M visible tokens, then B's M) and one row of S predictor queries (A's M, then B's S - M). Shapes are
static for any ratio, and every token of every sequence gets exactly one prediction per step. Nothing crosses
between the views: by default (`cms_attention: segments`) each view's attention is computed on its own, with no
mask (at ratio 0.5 the two halves of a row fold into two rows of S/2); `cms_attention: mask` computes attention over
the whole row with a dense view mask instead, which gives the same outputs at about twice the attention cost (kept
as the reference the tests compare against, and for the benchmark).
"""

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from lingua.app import AppModel, MaskedLMHead
from lingua.errors import UserError, at_least, require
from lingua.model.flops import (
    attention_flops,
    encoder_flops_per_token,
    non_embedding_params,
    output_head_flops,
    self_attention_flops_per_token,
)
from lingua.model.masking import check_mask_ratio, num_masked, random_positions
from lingua.model.transformer import (
    AttnMask,
    CrossAttentionBlock,
    Encoder,
    RMSNorm,
    RotaryEmbedding,
    Segments,
    TransformerArgs,
    build_attn_bias,
    check_sub_network,
    head_dim_of,
    quarter_depth,
    sub_network,
    trunc_normal_,
)


@dataclass
class PredictorArgs:
    """Unset fields follow the encoder: a quarter of its depth (at least one layer), its width and heads, its
    head_dim when width and heads are the encoder's (else dim // n_heads), and its RoPE base."""

    n_layers: int | None = None  # default: a quarter of the encoder's, at least 1
    dim: int | None = None  # default: the encoder's
    n_heads: int | None = None  # default: the encoder's
    head_dim: int | None = None  # default: the encoder's when dim and heads are, else dim // n_heads
    rope_theta: float | None = None  # default: the encoder's (docs/crossbert_slow_start.md: a lower base on bytes)

    ARCHITECTURE: ClassVar[tuple[str, ...]] = ("n_layers", "dim", "n_heads", "head_dim", "rope_theta")

    def __post_init__(self):
        at_least(self, 1, "n_layers", "dim", "n_heads", "head_dim", "rope_theta")


CMS_ATTENTION = ("segments", "mask")


class View(NamedTuple):
    """One view of a sequence: its visible tokens, which the encoder sees, and its masked ones, each one of the
    predictor's queries."""

    visible: int
    masked: int


@dataclass(frozen=True)
class RowLayout:
    """The static shapes of a step on sequences of seq_len S tokens (paper sections 3.2 and 5.1): view A masks a fixed
    count M = round(mask_ratio * S) of each sequence; with CMS the complementary view B masks the other S - M, and
    both views share one encoder row (A's S - M visible tokens, then B's M) and one predictor row (A's M queries, then
    B's S - M)."""

    views: tuple[View, ...]  # (A,), or with CMS (A, B)
    masking_ratio: float  # eq. 8's r over token-views: mask_ratio, or with CMS 1/2 (B's ratio is 1 - mask_ratio)

    @property
    def seq_len(self) -> int:
        return sum(self.views[0])

    @property
    def encoder_lengths(self) -> tuple[int, ...]:
        return tuple(view.visible for view in self.views)

    @property
    def query_lengths(self) -> tuple[int, ...]:
        return tuple(view.masked for view in self.views)


@dataclass
class CrossBertArgs:
    encoder: TransformerArgs = field(default_factory=TransformerArgs)
    predictor: PredictorArgs = field(default_factory=PredictorArgs)
    mask_ratio: float = 0.5  # the paper's CrossBERT
    cms: bool = True  # Complementary Masking: the inverse view is predicted in the same pass
    cms_attention: str = "segments"  # segments: each view attends on its own | mask: one dense view mask per row

    def __post_init__(self):
        check_mask_ratio(self.mask_ratio)
        require(self.cms_attention in CMS_ATTENTION, "cms_attention",
                f"must be one of {', '.join(CMS_ATTENTION)}, got '{self.cms_attention}'")
        check_sub_network("predictor", self.predictor_transformer)

    def predictor_transformer(self) -> TransformerArgs:
        """The predictor's block shapes and RoPE base; norms, init and attention backend are the encoder's."""
        pred = self.predictor
        return sub_network(self.encoder, pred.n_layers or quarter_depth(self.encoder), pred.dim, pred.n_heads,
                           pred.head_dim, pred.rope_theta)

    def layout(self, seq_len: int) -> RowLayout:
        """The views of sequences of seq_len tokens; a ratio that masks no token, or every token, is a UserError."""
        masked = num_masked(self.mask_ratio, seq_len)
        view = View(visible=seq_len - masked, masked=masked)
        if not self.cms:
            return RowLayout((view,), self.mask_ratio)
        return RowLayout((view, View(visible=masked, masked=seq_len - masked)), 0.5)


def predictor_flops_per_token(predictor: TransformerArgs, encoder_dim: int, seq_len: int) -> float:
    """The cross-attention predictor's analogue of eq. 7: 6 N_pred + 12 d L S, with S the sequence length (as the
    paper's table does, though each query attends to the S - M visible tokens only). N_pred counts the cross-attention
    and SwiGLU matrices plus, when the predictor is narrower or wider than the encoder, its two projections."""
    projections = 2 * encoder_dim * predictor.dim if predictor.dim != encoder_dim else 0
    return 6 * (non_embedding_params(predictor) + projections) + 12 * predictor.dim * predictor.n_layers * seq_len


def crossbert_flops_per_token_view(encoder: TransformerArgs, predictor: TransformerArgs, layout: RowLayout) -> float:
    """Eq. 8, F_N = F_enc (1 - r) + F_pred r, per token-view: a position of one view of a sequence, of which a fraction
    1 - r is encoded and r predicted. With CMS, view B has ratio 1 - r, so the average over both views is
    (F_enc + F_pred) / 2 for any r (equal to eq. 8 at the paper's r = 0.5): a step that consumes one sequence of S
    data tokens processes 2 S token-views, and C = F_N D holds with D counting token-views (Appendix J's Tokens
    column = Steps x BSZ, so BSZ counts token-views too: BSZ / (2 S) data sequences per step)."""
    r, seq_len = layout.masking_ratio, layout.seq_len
    f_enc = encoder_flops_per_token(encoder, seq_len)
    return f_enc * (1 - r) + predictor_flops_per_token(predictor, encoder.dim, seq_len) * r


def crossbert_hardware_flops_per_token_view(encoder: TransformerArgs, predictor: TransformerArgs, layout: RowLayout,
                                            vocab_size: int, per_view: bool) -> float:
    """What a step runs per token-view (`mfu_hw`): the encoder on each view's visible tokens; the predictor's keys and
    values of the encoder row, and its queries (their projections, SwiGLU and the tied head); attention over the
    visible tokens of the query's own view (`per_view`: CMS's segments) or of the whole encoder row (a dense mask)."""
    row = sum(layout.encoder_lengths)
    key_value = 2 * predictor.n_layers * predictor.dim * predictor.n_heads * head_dim_of(predictor)
    resize = encoder.dim * predictor.dim if predictor.dim != encoder.dim else 0  # projected in, and back out
    per_context_token = 6 * (key_value + resize)
    per_query = 6 * (non_embedding_params(predictor) - key_value + resize) + output_head_flops(encoder.dim, vocab_size)
    total = 0.0
    for view in layout.views:
        keys = view.visible if per_view else row
        total += view.visible * (self_attention_flops_per_token(encoder, keys) + per_context_token)
        total += view.masked * (per_query + attention_flops(predictor, keys))
    return total / (layout.seq_len * len(layout.views))


class Predictor(nn.Module):
    """Learned mask embedding at each query position, cross-attention blocks over the encoder output, final norm.

    When its width differs from the encoder's, the encoder output is projected in and the result projected back out
    to the encoder's width (for the tied output head); with equal widths (the paper) both are identities.
    """

    def __init__(self, args: TransformerArgs, encoder_dim: int):
        super().__init__()
        self.args = args
        self.mask_embedding = nn.Parameter(torch.empty(args.dim))
        self.rope = RotaryEmbedding(head_dim_of(args), args.max_seqlen, args.rope_theta)
        resize = args.dim != encoder_dim
        self.context_proj = nn.Linear(encoder_dim, args.dim, bias=False) if resize else nn.Identity()
        self.layers = nn.ModuleList(CrossAttentionBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output_proj = nn.Linear(args.dim, encoder_dim, bias=False) if resize else nn.Identity()

    def forward(self, context, context_positions, query_positions, mask: AttnMask | Segments | None) -> torch.Tensor:
        """context [B, Sk, D_enc] at context_positions [B, Sk]; queries at query_positions [B, Q] -> [B, Q, D_enc]."""
        h = self.mask_embedding.expand(*query_positions.shape, -1)
        context = self.context_proj(context)
        q_rope, kv_rope = self.rope(query_positions), self.rope(context_positions)
        bias = build_attn_bias(mask, self.args.attn_backend, self.args.n_heads)
        for layer in self.layers:
            h = layer(h, context, q_rope, kv_rope, bias)
        return self.output_proj(self.norm(h))


def view_ids(lengths: tuple[int, int], device) -> torch.Tensor:
    """[1, sum(lengths)]: 0 for the positions of view A's part of a CMS row, 1 for view B's."""
    return torch.cat([torch.full((n,), view, device=device) for view, n in enumerate(lengths)])[None]


class CrossBert(AppModel):
    masks_documents = True
    masked_lm = MaskedLMHead("cross_attention", "CrossBERT's predictor", network="predictor")

    def __init__(self, args: CrossBertArgs, vocab_size: int):
        super().__init__()
        self.args = args
        # Token-views per data sequence: with CMS each sequence is seen as two complementary views in one step.
        self.views_per_sequence = 2 if args.cms else 1
        self.encoder = Encoder(args.encoder, vocab_size)
        self.predictor = Predictor(args.predictor_transformer(), args.encoder.dim)

    def make_batch(self, tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Split each row into masked/visible sets and lay out the encoder and predictor rows (static shapes)."""
        B, S = tokens.shape
        n_masked = self.args.layout(S).views[0].masked
        perm = random_positions(B, S, generator, tokens.device)
        masked, visible = perm[:, :n_masked].sort(1).values, perm[:, n_masked:].sort(1).values
        if not self.args.cms:
            return self._rows(tokens, visible, masked)
        return self._rows(tokens, torch.cat([visible, masked], 1), torch.cat([masked, visible], 1))

    def _rows(self, tokens, encoder_positions, query_positions) -> dict[str, torch.Tensor]:
        return self.with_document_ids({
            "inputs": tokens.gather(1, encoder_positions),
            "positions": encoder_positions,
            "query_positions": query_positions,
            "targets": tokens.gather(1, query_positions),
        }, tokens)

    def forward(self, inputs, positions, query_positions, targets, document_ids=None):
        return self.encoder.lm_loss(self.predict(inputs, positions, query_positions, document_ids), targets)

    def predict(self, inputs, positions, query_positions, document_ids=None) -> torch.Tensor:
        """Predictor outputs [B, Q, D_enc] before the tied head; with CMS each view attends within itself only, and
        with `document_ids` each token (query) within its own document too."""
        encoder_mask, predictor_mask = self.attention_masks(positions, query_positions, document_ids)
        h = self.encoder(inputs, positions, encoder_mask)
        return self.predictor(h, positions, query_positions, predictor_mask)

    def attention_masks(self, positions, query_positions,
                        document_ids=None) -> tuple[AttnMask | Segments | None, AttnMask | Segments | None]:
        """The encoder's and the predictor's masks: CMS's views, the documents of the sequences' tokens
        (`document_ids` [B, S], gathered at the encoder's `positions` and the predictor's `query_positions`), or
        both. With documents the views become group ids too: `Segments` can mask nothing inside a view."""
        views = self.view_masks(*positions.shape, document_ids is not None) if self.args.cms else (None, None)
        if document_ids is None:
            return views
        encoder_documents = document_ids.gather(1, positions)
        documents = (AttnMask(encoder_documents, encoder_documents),
                     AttnMask(document_ids.gather(1, query_positions), encoder_documents))
        return tuple(mask if view is None else mask.within(view, 2) for mask, view in zip(documents, views))

    def view_masks(self, batch: int, seq_len: int,
                   group_ids: bool = False) -> tuple[AttnMask | Segments, AttnMask | Segments]:
        """The encoder's and the predictor's attention structure for CMS rows of seq_len tokens (as group ids with
        `cms_attention: mask`, or when asked)."""
        layout = self.args.layout(seq_len)
        encoder_lengths, query_lengths = layout.encoder_lengths, layout.query_lengths
        if self.args.cms_attention == "segments" and not group_ids:
            return Segments(encoder_lengths, encoder_lengths), Segments(query_lengths, encoder_lengths)
        encoder_views, query_views = (view_ids(lengths, self.predictor.mask_embedding.device).expand(batch, -1)
                                      for lengths in (encoder_lengths, query_lengths))
        return AttnMask(encoder_views, encoder_views), AttnMask(query_views, encoder_views)

    def flops_per_token_view(self, seq_len: int) -> float:
        return crossbert_flops_per_token_view(self.args.encoder, self.args.predictor_transformer(),
                                              self.args.layout(seq_len))

    def head_flops_per_token_view(self, seq_len: int) -> float:
        """The head runs on the predicted fraction r of the token-views (with CMS, every token once per two)."""
        head = output_head_flops(self.args.encoder.dim, self.encoder.tok_embeddings.num_embeddings)
        return head * self.args.layout(seq_len).masking_ratio

    def hardware_flops_per_token_view(self, seq_len: int) -> float:
        """Each view attends over its own tokens unless a dense mask spans the row (cms_attention: mask, documents)."""
        per_view = self.args.cms_attention == "segments" and self.document_start is None
        return crossbert_hardware_flops_per_token_view(self.args.encoder, self.args.predictor_transformer(),
                                                       self.args.layout(seq_len),
                                                       self.encoder.tok_embeddings.num_embeddings, per_view)

    def init_weights(self) -> None:
        super().init_weights()
        trunc_normal_(self.predictor.mask_embedding, self.args.encoder.init_std)

    def pooler_warm_start(self) -> tuple[TransformerArgs, dict[str, torch.Tensor]]:
        """The predictor re-used as a warm-started attention pooler (paper section 3, Appendix D): its block shapes,
        and its weights under the pooler's names (lingua/model/pooler.py; the mask embedding becomes the query). The
        pooler has the encoder's width, so a predictor of another width cannot start one."""
        predictor = self.predictor
        if predictor.args.dim != self.args.encoder.dim:
            raise UserError(f"the predictor's width ({predictor.args.dim}) is not the encoder's "
                            f"({self.args.encoder.dim}): it cannot warm-start a pooler of the encoder's width")
        state = {"query": predictor.mask_embedding,
                 **{f"layers.{k}": v for k, v in predictor.layers.state_dict().items()},
                 **{f"norm.{k}": v for k, v in predictor.norm.state_dict().items()}}
        return predictor.args, state


def build_crossbert(args: CrossBertArgs, tokenizer) -> CrossBert:
    return CrossBert(args, tokenizer.vocab_size)
