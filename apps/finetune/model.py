"""GLUE fine-tuning: a pre-trained backbone, a pooled representation and a linear head, all trained (the paper's
Table 3, top block).

The pooled vector is the mean of the real tokens' final states (`pooling=mean`), the state of `<s>` (`first`), or an
attention pooler (`attention`: a learned query reading the states through cross-attention blocks,
lingua/model/pooler.py), warm-started from CrossBERT's predictor (the paper, section 3: the predictor "can be
effectively re-used as a warm-started module for downstream finetuning"), from a contrastive or fine-tuning run's
pooler, or cold. The head is one linear layer: cross-entropy over the task's classes, or mean squared error on the score
(STS-B). No dropout: `forward` makes no random draw (the app contract), and ModernBERT's GLUE recipes also use none.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from apps.finetune.data import decode_labels
from lingua.app import AppModel
from lingua.errors import at_least, require
from lingua.eval.features import mean_pool
from lingua.model.flops import encoder_flops_per_token
from lingua.model.pooler import AttentionPooler, PoolerArgs, pooler_transformer
from lingua.model.transformer import Encoder, TransformerArgs, check_sub_network

POOLINGS = ("mean", "first", "attention")


@dataclass
class FinetuneArgs:
    encoder: TransformerArgs = field(default_factory=TransformerArgs)  # with init_from: the pre-trained run's
    pooling: str = "mean"  # mean: of the real tokens | first: the <s> state | attention: an attention pooler
    pooler: PoolerArgs = field(default_factory=PoolerArgs)  # the attention pooler's depth, heads and warm start
    num_labels: int = 2  # set from the task: its classes, or 1 for a regression (STS-B)

    def __post_init__(self):
        require(self.pooling in POOLINGS, "pooling", f"must be one of {', '.join(POOLINGS)}, got '{self.pooling}'")
        at_least(self, 1, "num_labels")
        if self.pooling == "attention":
            check_sub_network("pooler", lambda: pooler_transformer(self.pooler, self.encoder))

    @property
    def regression(self) -> bool:
        return self.num_labels == 1


class Finetune(AppModel):
    evaluation_methods = ("encode", "logits")

    def __init__(self, args: FinetuneArgs, vocab_size: int, pad_id: int):
        super().__init__()
        self.args, self.pad_id = args, pad_id
        self.encoder = Encoder(args.encoder, vocab_size)
        attention = args.pooling == "attention"
        self.pooler = AttentionPooler(pooler_transformer(args.pooler, args.encoder)) if attention else None
        self.head = nn.Linear(args.encoder.dim, args.num_labels)

    def make_batch(self, rows: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"tokens": rows[:, 1:], "labels": decode_labels(rows[:, 0], self.args.regression)}

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor):
        logits = self.logits(tokens)
        if self.args.regression:
            return F.mse_loss(logits[:, 0], labels), {}
        return F.cross_entropy(logits, labels), {"accuracy": (logits.argmax(1) == labels).float().mean()}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, S] token rows (padded with the pad id) -> [B, num_labels] float32."""
        pad_mask = tokens != self.pad_id
        return self.head(self.pooled(self.encoder.encode(tokens, pad_mask), pad_mask)).float()

    def pooled(self, hidden: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        """[B, S, D] final states -> [B, D], what the head reads."""
        if self.args.pooling == "first":
            return hidden[:, 0].float()
        return mean_pool(hidden, pad_mask) if self.pooler is None else self.pooler.pooled(hidden, pad_mask)

    def attention_pooler(self) -> AttentionPooler | None:
        return self.pooler

    def classifier(self) -> tuple[nn.Linear, str]:
        return self.head, self.args.pooling

    def predicted_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["labels"].numel()  # one prediction per example: predicted_tokens_per_s is examples per second

    def flops_per_token_view(self, seq_len: int) -> float:
        """Eq. 7 of the backbone at the longest length (batches are often shorter); the pooler is left out."""
        return encoder_flops_per_token(self.args.encoder, seq_len)

    def head_flops_per_token_view(self, seq_len: int) -> float:
        return 6 * self.args.encoder.dim * self.args.num_labels / seq_len  # once per example

    def init_weights(self) -> None:
        super().init_weights()
        nn.init.zeros_(self.head.bias)


def build_finetune(args: FinetuneArgs, tokenizer) -> Finetune:
    return Finetune(args, tokenizer.vocab_size, tokenizer.pad_id)
