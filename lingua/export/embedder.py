"""Sentence embeddings from any checkpoint of this library:

    from lingua.export.embedder import load_embedder
    embedder = load_embedder("dump/contrastive_debug")       # a run, a checkpoint folder or a consolidated.pt
    vectors = embedder.encode(["a sentence", "another one"])  # float32 [2, D], unit rows

A contrastive run's checkpoint embeds with its trained pooler (attention or mean); a pre-training run's (BERT,
CrossBERT, ELECTRA) with the mean of its final states over the real tokens. Texts are encoded as in training and
evaluation, `<s> text </s>`, cut to `max_len` tokens (default: the run's training length).
"""

from dataclasses import dataclass

import torch

from lingua.app import load_model
from lingua.checkpoint.store import Checkpoint
from lingua.distributed import resolve_device
from lingua.errors import UserError
from lingua.eval.features import extract_features
from lingua.model.pooler import mean_pool_normalised
from lingua.run_folder import CONSOLIDATED, RunFolder

POOLINGS = ("auto", "mean")


@dataclass
class Embedder:
    model: torch.nn.Module  # in eval mode
    tokenizer: object
    max_len: int  # tokens per text, <s> and </s> included
    device: torch.device
    name: str  # for reports: the checkpoint's run folder name
    pooling: str = "auto"  # auto: the model's trained pooler if it has one, else mean | mean: always the mean

    @property
    def dim(self) -> int:
        return self.model.backbone.args.dim

    def pool(self, hidden: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        pooler = self.model.attention_pooler() if self.pooling == "auto" else None
        return mean_pool_normalised(hidden, pad_mask) if pooler is None else pooler(hidden.float(), pad_mask)

    @torch.no_grad()
    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        """[len(texts), dim] float32 unit vectors on the CPU, in the order of `texts`."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("encode takes a list of strings")
        if not texts:
            return torch.empty(0, self.dim)
        return extract_features(self.model, self.tokenizer, [(t,) for t in texts], ["last"], self.max_len, batch_size,
                                self.device, f"embedding {len(texts)} texts", pool=self.pool)["last"]


def load_embedder(path: str, device: str = "auto", pooling: str = "auto", max_len: int = 0,
                  app: str | None = None) -> Embedder:
    """An Embedder for the checkpoint at `path` (a run's dump_dir, a checkpoint folder or a consolidated.pt); `app`:
    the app the user named, trusted to rebuild it beside this code's own (`Checkpoint.open`)."""
    if pooling not in POOLINGS:
        raise UserError(f"pooling must be one of {', '.join(POOLINGS)}, got '{pooling}'")
    opened = Checkpoint.open(path, app)
    resolved = resolve_device(device)
    model, config, tokenizer = load_model(opened, resolved)
    checkpoint = opened.path
    longest = config.model.encoder.max_seqlen
    if max_len < 0 or max_len > longest or 0 < max_len < 3:
        raise UserError(f"max_len must be 0 (the run's training length) or 3..{longest}, got {max_len}")
    max_len = max_len or min(config.data.seq_len, longest)
    of_run = checkpoint.is_dir() or checkpoint.name == CONSOLIDATED  # named after its run, another file after itself
    name = RunFolder.of(checkpoint).root.name if of_run else checkpoint.stem
    return Embedder(model, tokenizer, max_len, resolved, name, pooling)
