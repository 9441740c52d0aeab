"""ELECTRA: replaced-token detection (Clark et al., 2020), the paper's third model (section 5.1, Table 3).

A small generator (a masked language model over the shared backbone's blocks) fills each masked position with a
token sampled from its own prediction; the discriminator, the encoder that evaluation probes, labels every token of
the corrupted sequence original or replaced. Loss = MLM loss of the generator + rtd_weight x RTD loss.

- Token embeddings are shared: the generator reads them and its output head is tied to them.
- Masking has static shapes (exactly round(mask_ratio * S) positions per row, by random permutation), and the
  sampling is inverse-CDF sampling with one uniform number per masked position, drawn in `make_batch` from the
  loop's generator: `forward` makes no random draw (exact resume, fullgraph compile), and no gradient flows through
  the sampling.
- A sampled token equal to the original counts as original.
"""

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from lingua.app import AppModel, MaskedLMHead
from lingua.errors import at_least, require
from lingua.model.flops import encoder_flops_per_token, output_head_flops, self_attention_flops_per_token
from lingua.model.masking import check_mask_ratio, gather_tokens, masked_lm_loss, masked_positions, num_masked
from lingua.model.transformer import (
    AttnMask,
    Encoder,
    RMSNorm,
    RotaryEmbedding,
    SelfAttentionBlock,
    TransformerArgs,
    build_attn_bias,
    check_sub_network,
    default_positions,
    document_mask,
    head_dim_of,
    quarter_depth,
    sub_network,
)


@dataclass
class GeneratorArgs:
    """The generator has the discriminator's width (it reads the shared embeddings) and its own depth and heads."""

    n_layers: int | None = None  # default: a quarter of the discriminator's depth, at least one layer
    n_heads: int | None = None  # default: the discriminator's

    ARCHITECTURE: ClassVar[tuple[str, ...]] = ("n_layers", "n_heads")

    def __post_init__(self):
        at_least(self, 1, "n_layers", "n_heads")


@dataclass
class ElectraArgs:
    encoder: TransformerArgs = field(default_factory=TransformerArgs)  # the discriminator
    generator: GeneratorArgs = field(default_factory=GeneratorArgs)
    mask_ratio: float = 0.15  # ELECTRA's
    rtd_weight: float = 50.0  # λ: the RTD loss is per token and easy, so it is weighted up (ELECTRA's value)

    def __post_init__(self):
        check_mask_ratio(self.mask_ratio)
        require(self.rtd_weight >= 0, "rtd_weight", f"must be >= 0, got {self.rtd_weight}")
        check_sub_network("generator", self.generator_transformer)

    def generator_transformer(self) -> TransformerArgs:
        return sub_network(self.encoder, self.generator.n_layers or quarter_depth(self.encoder),
                           n_heads=self.generator.n_heads)


class Generator(nn.Module):
    """Self-attention blocks and a final norm over embeddings it is given (the discriminator's)."""

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.rope = RotaryEmbedding(head_dim_of(args), args.max_seqlen, args.rope_theta)
        self.layers = nn.ModuleList(SelfAttentionBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, mask: AttnMask | None = None) -> torch.Tensor:
        rope = self.rope(positions)
        bias = build_attn_bias(mask, self.args.attn_backend, self.args.n_heads)
        for layer in self.layers:
            h = layer(h, rope, bias)
        return self.norm(h)


def sample_replacements(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per position from softmax(logits) [B, M, V], by inverse CDF at uniforms [B, M] in [0, 1): the first
    token whose cumulative probability exceeds u (so a token of probability zero is never picked). Computed in fp32
    (bf16 logits under autocast shift the distribution by under 1%)."""
    cdf = logits.float().softmax(-1).cumsum(-1)
    scaled = uniforms.unsqueeze(-1) * cdf[..., -1:]  # the float sum may end just below 1: stay inside it
    return torch.searchsorted(cdf, scaled, right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)


def corrupt(tokens: torch.Tensor, mask_idx: torch.Tensor, sampled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The discriminator's input and its labels (1: replaced); a sampled token equal to the original is original."""
    corrupted = tokens.scatter(1, mask_idx, sampled)
    return corrupted, (corrupted != tokens).float()


class Electra(AppModel):
    backbone_name = "discriminator"  # what evaluation reads, on the uncorrupted sequence
    masks_documents = True
    masked_lm = MaskedLMHead("self_attention", "ELECTRA's generator", network="generator",
                             output_bias=False)  # the generator's tied head has no bias

    def __init__(self, args: ElectraArgs, vocab_size: int, mask_id: int):
        super().__init__()
        self.args, self.mask_id = args, mask_id
        self.discriminator = Encoder(args.encoder, vocab_size)
        self.generator = Generator(args.generator_transformer())
        self.rtd_head = nn.Linear(args.encoder.dim, 1, bias=False)

    def make_batch(self, tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        mask_idx = masked_positions(tokens, self.args.mask_ratio, generator)
        return self.with_document_ids({
            "tokens": tokens,
            "inputs": tokens.scatter(1, mask_idx, self.mask_id),
            "mask_idx": mask_idx,
            "uniforms": torch.rand(mask_idx.shape, generator=generator, device=tokens.device),  # for the sampling
        }, tokens)

    def forward(self, tokens, inputs, mask_idx, uniforms,
                document_ids=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mlm_loss, rtd_loss, stats = self.losses(tokens, inputs, mask_idx, uniforms, document_ids)
        return mlm_loss + self.args.rtd_weight * rtd_loss, stats

    def losses(self, tokens, inputs, mask_idx, uniforms, document_ids=None):
        """The generator's MLM loss, the discriminator's RTD loss (gradients reach the generator only through the
        first: the sampling is not differentiated) and the logged stats. Both networks keep each token to its
        document of the original rows (`document_ids`, never read from the corrupted ones: a sampled token may be
        a <s>)."""
        positions, documents = default_positions(tokens), document_mask(document_ids)
        hidden = self.generator(self.discriminator.embed(inputs), positions, documents)
        logits = F.linear(gather_tokens(hidden, mask_idx), self.discriminator.tok_embeddings.weight)
        targets = tokens.gather(1, mask_idx)
        mlm_loss, mlm_stats = masked_lm_loss(logits, targets)
        with torch.no_grad():
            corrupted, labels = corrupt(tokens, mask_idx, sample_replacements(logits, uniforms))
        rtd_logits = self.rtd_head(self.discriminator(corrupted, positions, documents)).squeeze(-1).float()
        rtd_loss = F.binary_cross_entropy_with_logits(rtd_logits, labels)
        stats = {"accuracy": ((rtd_logits > 0).float() == labels).float().mean().detach(),
                 "mlm_loss": mlm_loss.detach(), "rtd_loss": rtd_loss.detach(),
                 "generator_accuracy": mlm_stats["accuracy"], "replaced": labels.mean()}
        return mlm_loss, rtd_loss, stats

    def predicted_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["tokens"].numel()  # the discriminator labels every token

    def flops_per_token_view(self, seq_len: int) -> float:
        """Eq. 7 for the discriminator and for the generator (both process every token); their output heads are left
        out, as eq. 7-8 leave BERT's and CrossBERT's out, so the three apps count alike."""
        return (encoder_flops_per_token(self.args.encoder, seq_len)
                + encoder_flops_per_token(self.args.generator_transformer(), seq_len))

    def head_flops_per_token_view(self, seq_len: int) -> float:
        """The generator's tied output head on its masked share of the tokens (6 d V r per token: a large share of a
        small generator's cost) and the RTD head on every token; with them the single-scale config gives Table 3's
        7.5e19 FLOPs."""
        dim, vocab = self.args.encoder.dim, self.discriminator.tok_embeddings.num_embeddings
        return output_head_flops(dim, vocab) * self.args.mask_ratio + output_head_flops(dim, 1)

    def hardware_flops_per_token_view(self, seq_len: int) -> float:
        """Generator and discriminator on every token over the whole row, the generator's tied head on its masked
        positions, the RTD head on every token."""
        dim, vocab = self.args.encoder.dim, self.discriminator.tok_embeddings.num_embeddings
        masked_share = num_masked(self.args.mask_ratio, seq_len) / seq_len
        return (self_attention_flops_per_token(self.args.encoder, seq_len)
                + self_attention_flops_per_token(self.args.generator_transformer(), seq_len)
                + output_head_flops(dim, vocab) * masked_share + output_head_flops(dim, 1))


def build_electra(args: ElectraArgs, tokenizer) -> Electra:
    return Electra(args, tokenizer.vocab_size, tokenizer.mask_id)
