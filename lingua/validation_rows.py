"""Fixed validation rows: each source's valid.jsonl packed like training rows, split over the ranks.

Its own file because the validation rows are read once, from the start of each source's file, apart from the
endless, sharded and resumable training stream (lingua/data.py); lingua/validation.py reports the loss on them.
"""

import logging
import os
from dataclasses import dataclass, field

import torch

from lingua.args import UserError
from lingua.data import DataArgs, check_args
from lingua.documents import SkippedRows, document

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationRows:
    """Fixed validation rows, the batch first, and how many come from each source ({source: rows}, in row order;
    empty when the rows are of one kind), from which lingua.validation reports each source's loss."""

    tokens: torch.Tensor
    source_rows: dict[str, int] = field(default_factory=dict)


def load_validation(args: DataArgs, tokenizer, n_sequences: int, rank: int = 0, world_size: int = 1) -> ValidationRows:
    """Fixed validation rows [n_sequences, seq_len] from each source's valid.jsonl, packed like training rows.

    Sources (sorted by name) get n_sequences * weight rows (largest remainder); a source's rows are packed from its
    own file from the start, and rank r takes rows [r*k, (r+1)*k) of them, so ranks are disjoint. Too little text
    raises UserError rather than returning fewer rows: a silently smaller set would make losses incomparable. The
    rows come source after source, counted per source in `source_rows`. `validation_sources`, when given, stands for
    the training's sources here.
    """
    check_args(args)
    rows, source_rows = [], {}
    for name, k in _split_by_weight(n_sequences, args.validation_sources or args.sources).items():
        if k == 0:
            continue
        source_rows[name] = k
        path = os.path.join(args.root_dir, name, "valid.jsonl")
        if not os.path.isfile(path):
            raise UserError(f"validation file not found: '{path}'")
        need = world_size * k * args.seq_len
        tokens, skipped = _read_tokens(path, tokenizer, need)
        if len(tokens) < need:
            raise UserError(f"'{path}' has {len(tokens) // args.seq_len} rows of {args.seq_len} tokens, "
                            f"{k} per rank x {world_size} ranks needed ({skipped.count} malformed lines skipped)")
        if skipped.count:
            logger.warning(skipped.warning(path, "malformed lines"))
        mine = tokens[rank * k * args.seq_len : (rank + 1) * k * args.seq_len]
        rows.append(torch.tensor(mine, dtype=torch.long).view(k, args.seq_len))
    return ValidationRows(torch.cat(rows), source_rows)


def _split_by_weight(n: int, weights: dict[str, float]) -> dict[str, int]:
    names = sorted(weights)
    exact = [n * weights[s] / sum(weights.values()) for s in names]
    counts = [int(x) for x in exact]
    # stable sort: ties go to the source first in name order
    for i in sorted(range(len(names)), key=lambda i: counts[i] - exact[i])[: n - sum(counts)]:
        counts[i] += 1
    return dict(zip(names, counts))


def _read_tokens(path: str, tokenizer, limit: int) -> tuple[list[int], SkippedRows]:
    """The documents' tokens from the start of `path` until there are `limit`, and the malformed lines skipped."""
    out: list[int] = []
    skipped = SkippedRows()
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if len(out) >= limit:
                break
            doc = document(tokenizer, line)
            if doc is None:
                skipped.add(f"line {number}")
            out += doc or []
    return out, skipped
