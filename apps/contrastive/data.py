"""Contrastive training data: JSONL triplets -> token rows [batch, 2 + n_negatives, seq_len].

Each line is `{"query": str, "positive": str, "negatives": [str, ...]}` (MS MARCO's layout; `python -m
lingua.eval.triplets` builds such a file from a BEIR folder). A row holds the query, its positive, then its first
`n_negatives` hard negatives, each text as `<s> text </s>` cut to seq_len tokens and padded with the tokenizer's pad
id. Lines that are not such an object (bad JSON or UTF-8, a number past Python's digit limit, absurd nesting), or have
fewer negatives, are left out and counted once (`malformed_lines`), with one warning for the file; a file with no
usable line is refused.

The file is indexed once at the start (byte offsets of the usable lines). Each epoch reads them in a seeded
permutation; a step takes the next batch_size x world_size lines, rank r its r-th slice. The state (epoch, lines
used) is the same on every rank, so resuming is exact on any number of ranks.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lingua.data.documents import SkippedRows
from lingua.data.tokenizer import TokenizerArgs
from lingua.errors import UserError, at_least
from lingua.files.untrusted import Malformed, parse_json

logger = logging.getLogger(__name__)


@dataclass
class TripletDataArgs:
    path: str = ""  # training triplets (JSONL: query, positive, negatives)
    valid_path: str = ""  # held-out triplets for validation (needed when validation.every > 0)
    n_negatives: int = 7  # hard negatives per query (lines with fewer are left out); 0: in-batch negatives only
    seq_len: int = 128  # tokens per text, <s> and </s> included (longer texts are cut)
    batch_size: int = 32  # queries per rank per micro-batch
    seed: int = 42  # the order of the lines in each epoch
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)

    def __post_init__(self):
        at_least(self, 0, "n_negatives", "seed")
        at_least(self, 3, "seq_len")
        at_least(self, 1, "batch_size")


def row_shape(args: TripletDataArgs) -> tuple[int, int]:
    return 2 + args.n_negatives, args.seq_len


def parse_triplet(line: bytes, n_negatives: int) -> list[str] | None:
    """[query, positive, negative_1..n] from one line, or None when it is not a usable triplet."""
    try:
        item = parse_json(line, dict)
    except Malformed:  # bad JSON or UTF-8, a number past the digit limit, absurd nesting, not an object
        return None
    texts = [item.get("query"), item.get("positive")]
    negatives = item.get("negatives", [])
    if not isinstance(negatives, list) or len(negatives) < n_negatives:
        return None
    texts += negatives[:n_negatives]
    return texts if all(isinstance(t, str) and t.strip() for t in texts) else None


def index_triplets(path: str, n_negatives: int, warn: bool = True) -> tuple[np.ndarray, int]:
    """Byte offsets of the usable lines of `path`, and the number of lines left out (one warning, if `warn`)."""
    if not path:
        raise UserError("data.path is empty: give a JSONL file of triplets (query, positive, negatives)")
    if not Path(path).is_file():
        raise UserError(f"triplet file not found: {path}")
    offsets, skipped, position = [], SkippedRows(), 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                if parse_triplet(line, n_negatives) is None:
                    skipped.add(f"line {number}")
                else:
                    offsets.append(position)
            position += len(line)
    if not offsets:
        raise UserError(f"{path} holds no usable triplet with {n_negatives} negatives ({skipped.count} lines left out)")
    if skipped.count and warn:
        logger.warning(skipped.warning(path, f"lines that are not triplets with {n_negatives} negatives"))
    return np.array(offsets, dtype=np.int64), skipped.count


def encode_texts(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """Each text as `<s> text </s>`, at most seq_len tokens, padded to seq_len."""
    rows = []
    for text in texts:
        ids = [tokenizer.bos_id, *tokenizer.encode(text)[:seq_len - 2], tokenizer.eos_id]
        rows.append(ids + [tokenizer.pad_id] * (seq_len - len(ids)))
    return rows


class TripletLoader:
    """Endless iterator of LongTensor [batch_size, 2 + n_negatives, seq_len]; state_dict() is where the next batch
    starts."""

    def __init__(self, args: TripletDataArgs, tokenizer, rank: int, world_size: int, state: dict | None = None):
        self.args, self.tokenizer, self.rank, self.world_size = args, tokenizer, rank, world_size
        # every rank indexes the whole file: rank 0 warns and counts (the loop sums the ranks' counts)
        self.offsets, skipped = index_triplets(args.path, args.n_negatives, warn=rank == 0)
        self.malformed_lines = skipped if rank == 0 else 0
        step_lines = args.batch_size * world_size
        if len(self.offsets) < step_lines:
            raise UserError(f"{args.path} has {len(self.offsets)} usable triplets, fewer than one step's "
                            f"{step_lines} (batch_size x processes)")
        self.epoch, self.position = (state["epoch"], state["position"]) if state else (0, 0)
        self.file = open(args.path, "rb")
        self.order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.args.seed, self.epoch]).permutation(len(self.offsets))

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        step_lines = self.args.batch_size * self.world_size
        if self.position + step_lines > len(self.order):  # the short tail of an epoch is dropped: static shapes
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._permutation()
        start = self.position + self.rank * self.args.batch_size
        lines = self.order[start:start + self.args.batch_size]
        self.position += step_lines
        return torch.tensor([self._row(i) for i in lines], dtype=torch.long)

    def _row(self, index: int) -> list[list[int]]:
        self.file.seek(int(self.offsets[index]))
        texts = parse_triplet(self.file.readline(), self.args.n_negatives)
        if texts is None:
            raise UserError(f"{self.args.path} changed while training (line at byte {self.offsets[index]})")
        return encode_texts(self.tokenizer, texts, self.args.seq_len)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def close(self) -> None:
        self.file.close()


def build_triplet_loader(args: TripletDataArgs, tokenizer, rank: int, world_size: int,
                         state: dict | None = None) -> TripletLoader:
    return TripletLoader(args, tokenizer, rank, world_size, state)


def load_triplet_validation(args: TripletDataArgs, tokenizer, n_rows: int) -> torch.Tensor:
    """The first n_rows usable triplets of valid_path, as rows."""
    if not args.valid_path:
        raise UserError("validation needs data.valid_path (held-out triplets), or set validation.every=0")
    offsets, _ = index_triplets(args.valid_path, args.n_negatives)
    if len(offsets) < n_rows:
        raise UserError(f"{args.valid_path} has {len(offsets)} usable triplets, validation.n_sequences is {n_rows}")
    rows = []
    with open(args.valid_path, "rb") as f:
        for offset in offsets[:n_rows]:
            f.seek(int(offset))
            rows.append(encode_texts(tokenizer, parse_triplet(f.readline(), args.n_negatives), args.seq_len))
    return torch.tensor(rows, dtype=torch.long)


def repartition_triplets(states: list[dict], world_size: int, args: TripletDataArgs) -> list[dict]:
    """Every rank holds the same state: the new ranks continue from it."""
    return [dict(states[0]) for _ in range(world_size)]
