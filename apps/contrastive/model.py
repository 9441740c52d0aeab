"""Contrastive probing and fine-tuning (paper section 4.2 and 5.1, "Eval on MTEB"): a pre-trained encoder, a pooler,
and an InfoNCE loss.

Each row of a batch is a query, its positive passage and its hard negatives. Every text is encoded by the backbone
and pooled into a unit vector (lingua/model/pooler.py). With `loss: simclr` (the default; the SimCLR form of the paper's
reference [10], not eq. 5 as written) query i is scored against every passage of the step, its own hard negatives,
the other queries' positives and negatives (in-batch negatives) and, when distributed, those of every rank
(gathered with their gradients), by cosine similarity over a temperature:

    L = -1/N sum_i log( exp(cos(q_i, p_i) / t) / sum_{p in passages} exp(cos(q_i, p) / t) )

With `loss: eq5`, eq. 5 as the paper writes it: raw cosine (no temperature, so setting one is refused) and only the
query's own positive and hard negatives in the denominator. Logits in [-1, 1] bound the loss: with 1 positive and K
negatives it falls at best from ln(K + 1) to ln(1 + K e^-2) (K = 7: from 2.08 to 0.67), the positive's probability
never above 1 / (1 + K e^-2) (0.51).

`frozen: true` (the paper's frozen protocol) trains the pooler only: the backbone's states are computed without
gradient and its parameters do not require one. `frozen: false` fine-tunes everything.

The backbone comes from `init_from=` (any app's run or checkpoint): `configure` takes its encoder shape and
tokenizer, and `lingua.training.pretrained.load_pretrained` its weights, plus, for CrossBERT with `pooler.warm_start`,
the predictor's weights into the attention pooler (Appendix D), which must have the config's shape (`model.pooler`, the
same for every app compared).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_gather

from lingua.app import AppModel
from lingua.errors import require
from lingua.model.flops import encoder_flops_per_token
from lingua.model.pooler import AttentionPooler, PoolerArgs, mean_pool_normalised, pooler_transformer
from lingua.model.transformer import Encoder, TransformerArgs, check_sub_network, head_dim_of
from lingua.training.pretrained import adopt_pretrained

LOSSES = ("simclr", "eq5")
DEFAULT_TEMPERATURE = 0.05


@dataclass
class ContrastiveArgs:
    encoder: TransformerArgs = field(default_factory=TransformerArgs)  # with init_from: the pre-trained run's
    pooler: PoolerArgs = field(default_factory=PoolerArgs)
    loss: str = "simclr"  # simclr: over a temperature, every passage of the step | eq5: eq. 5 as written
    temperature: float = DEFAULT_TEMPERATURE  # simclr: cosine similarities are divided by it (eq5 has none)
    frozen: bool = True  # true: only the pooler trains (the frozen protocol) | false: full fine-tuning

    def __post_init__(self):
        require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        require(self.loss in LOSSES, "loss", f"must be one of {', '.join(LOSSES)}, got '{self.loss}'")
        require(self.loss != "eq5" or self.temperature == DEFAULT_TEMPERATURE, "temperature",
                f"is not used by loss=eq5 (raw cosine logits, eq. 5 as written), got {self.temperature}: unset it")
        if self.pooler.kind == "attention":
            check_sub_network("pooler", lambda: pooler_transformer(self.pooler, self.encoder))


def info_nce(queries: torch.Tensor, passages: torch.Tensor, targets: torch.Tensor, temperature: float):
    """InfoNCE over unit vectors: queries [N, D], passages [P, D], targets [N] (the index of each query's positive
    among the passages). Returns the mean loss and the share of queries whose positive scores highest."""
    logits = queries.float() @ passages.float().T / temperature
    return F.cross_entropy(logits, targets), (logits.argmax(1) == targets).float().mean()


def eq5_loss(vectors: torch.Tensor):
    """Eq. 5 as written, over unit vectors [B, T, D] (query, positive, hard negatives per row): raw cosine, the
    query's own passages only. Returns the mean loss and the share of queries whose positive scores highest."""
    scores = torch.einsum("bd,btd->bt", vectors[:, 0].float(), vectors[:, 1:].float())
    targets = torch.zeros(len(scores), dtype=torch.long, device=scores.device)
    return F.cross_entropy(scores, targets), (scores.argmax(1) == 0).float().mean()


class Contrastive(AppModel):

    def __init__(self, args: ContrastiveArgs, vocab_size: int, pad_id: int):
        super().__init__()
        self.args, self.pad_id = args, pad_id
        self.encoder = Encoder(args.encoder, vocab_size)
        attention = args.pooler.kind == "attention"
        self.pooler = AttentionPooler(pooler_transformer(args.pooler, args.encoder)) if attention else None
        if args.frozen:
            self.encoder.requires_grad_(False)

    def make_batch(self, rows: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"rows": rows}  # no random draw: the negatives are in the data

    def forward(self, rows: torch.Tensor):
        """rows [B, T, L]: query, positive, T - 2 negatives per row."""
        B, T, L = rows.shape
        vectors = self.embed(rows.reshape(B * T, L)).view(B, T, -1)
        if self.args.loss == "eq5":
            loss, accuracy = eq5_loss(vectors)
            return loss, {"accuracy": accuracy}
        passages = vectors[:, 1:].reshape(B * (T - 1), -1)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if world > 1:  # every rank's passages are negatives for every query; gradients flow back to their rank
            passages = torch.cat(all_gather(passages))
        targets = (rank * B + torch.arange(B, device=rows.device)) * (T - 1)
        loss, accuracy = info_nce(vectors[:, 0], passages, targets, self.args.temperature)
        return loss, {"accuracy": accuracy}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, L] token rows (padded with the pad id) -> [N, D] unit vectors."""
        pad_mask = tokens != self.pad_id
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.args.frozen):
            hidden = self.encoder.encode(tokens, pad_mask)
        return self.pool(hidden, pad_mask)

    def pool(self, hidden: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        return mean_pool_normalised(hidden, pad_mask) if self.pooler is None else self.pooler(hidden, pad_mask)

    def attention_pooler(self) -> AttentionPooler | None:
        return self.pooler

    def predicted_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["rows"].shape[0]  # one prediction per query: which passage is its positive

    def flops_per_token_view(self, seq_len: int) -> float:
        """Per padded token of a text: the backbone's eq. 7 (forward only when frozen: a third), plus the pooler's
        key and value projections of the token (forward and backward; its single query's cost is left out)."""
        backbone = encoder_flops_per_token(self.args.encoder, seq_len) / (3 if self.args.frozen else 1)
        if self.pooler is None:
            return backbone
        pooler = self.pooler.args
        return backbone + 6 * 2 * pooler.dim * pooler.n_heads * head_dim_of(pooler) * pooler.n_layers

    def head_flops_per_token_view(self, seq_len: int) -> float:
        return 0.0  # no output head


def build_contrastive(args: ContrastiveArgs, tokenizer) -> Contrastive:
    return Contrastive(args, tokenizer.vocab_size, tokenizer.pad_id)


def configure(config, start):
    """The pre-trained run's encoder and tokenizer (from `start`, lingua/training/resume.py: init_from or the resumed
    run); a warm start of the attention pooler must have the config's shape (lingua/training/pretrained.py)."""
    return adopt_pretrained(config, start, attention_pooler=config.model.pooler.kind == "attention")
