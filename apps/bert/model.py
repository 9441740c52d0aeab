"""BERT baseline: a flat encoder trained with masked language modelling (paper section 2, eq. 1).

Masking has a static shape: exactly round(mask_ratio * seq_len) positions per row, picked by a batched random
permutation (argsort of uniform noise) and replaced by <mask>. The loss is computed only at those positions,
gathered by index, so no tensor shape depends on the random draw and torch.compile sees static shapes.
"""

from dataclasses import dataclass, field

import torch

from lingua.app import AppModel, MaskedLMHead
from lingua.model.flops import encoder_flops_per_token, output_head_flops, self_attention_flops_per_token
from lingua.model.masking import check_mask_ratio, gather_tokens, masked_positions, num_masked
from lingua.model.transformer import Encoder, TransformerArgs, default_positions, document_mask


@dataclass
class BertArgs:
    encoder: TransformerArgs = field(default_factory=TransformerArgs)
    mask_ratio: float = 0.2  # the paper's BERT

    def __post_init__(self):
        check_mask_ratio(self.mask_ratio)


class Bert(AppModel):
    masks_documents = True
    masked_lm = MaskedLMHead("encoder", "BERT's masked-LM head")

    def __init__(self, args: BertArgs, vocab_size: int, mask_id: int):
        super().__init__()
        self.args, self.mask_id = args, mask_id
        self.encoder = Encoder(args.encoder, vocab_size)

    def make_batch(self, tokens: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        mask_idx = masked_positions(tokens, self.args.mask_ratio, generator)
        return self.with_document_ids({
            "inputs": tokens.scatter(1, mask_idx, self.mask_id),
            "mask_idx": mask_idx,
            "targets": tokens.gather(1, mask_idx),
        }, tokens)

    def forward(self, inputs, mask_idx, targets, document_ids=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.encoder(inputs, default_positions(inputs), document_mask(document_ids))
        return self.encoder.lm_loss(gather_tokens(h, mask_idx), targets)

    def flops_per_token_view(self, seq_len: int) -> float:
        return encoder_flops_per_token(self.args.encoder, seq_len)

    def head_flops_per_token_view(self, seq_len: int) -> float:
        return output_head_flops(self.args.encoder.dim, self.encoder.tok_embeddings.num_embeddings) * \
            self.args.mask_ratio

    def hardware_flops_per_token_view(self, seq_len: int) -> float:
        """Every token through the encoder, attending over the whole row; the tied head on the masked ones only."""
        head = output_head_flops(self.args.encoder.dim, self.encoder.tok_embeddings.num_embeddings)
        return self_attention_flops_per_token(self.args.encoder, seq_len) + \
            head * num_masked(self.args.mask_ratio, seq_len) / seq_len


def build_bert(args: BertArgs, tokenizer) -> Bert:
    return Bert(args, tokenizer.vocab_size, tokenizer.mask_id)
