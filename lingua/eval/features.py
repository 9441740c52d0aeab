"""Features of texts from a model's frozen `encode`: shared by the GLUE probes, the embedding API and retrieval.

Texts are encoded RoBERTa style (`<s> a </s>`, pairs `<s> a </s></s> b </s>`), padded per batch (sorted by length),
and pooled per layer (mean over the real tokens by default, or any `pool(hidden, pad_mask)`). `FeatureCache` keeps
features on disk keyed by the model and the exact texts.
"""

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from lingua.errors import UserError
from lingua.files.safe import atomic_write

logger = logging.getLogger(__name__)

DEFAULT_MAX_LEN = 512  # tokens per text when neither the caller nor the model says

def encode_example(tokenizer, texts: tuple[str, ...], max_len: int) -> list[int]:
    """`<s> a </s>` or `<s> a </s></s> b </s>` (RoBERTa's pair format), at most max_len tokens."""
    ids = [tokenizer.encode(t) for t in texts]
    budget = max_len - 2 * len(ids)
    if len(ids) == 1:
        return [tokenizer.bos_id, *ids[0][:budget], tokenizer.eos_id]
    a, b = ids
    keep_a = min(len(a), max(budget - len(b), budget // 2))  # shorten the longer sentence first
    keep_b = min(len(b), budget - keep_a)
    return [tokenizer.bos_id, *a[:keep_a], tokenizer.eos_id, tokenizer.eos_id, *b[:keep_b], tokenizer.eos_id]


def mean_pool(hidden: Tensor, pad_mask: Tensor) -> Tensor:
    """[B, S, D] averaged over the real tokens (pad_mask True) -> [B, D] in float32."""
    mask = pad_mask.unsqueeze(-1).to(torch.float32)
    return (hidden.float() * mask).sum(1) / mask.sum(1).clamp_min(1)


def count_layers(model, tokenizer, device: torch.device) -> int:
    tokens = torch.tensor([[tokenizer.bos_id, tokenizer.eos_id]], device=device)
    with torch.no_grad():
        return len(model.encode(tokens, torch.ones_like(tokens, dtype=torch.bool), all_layers=True))


def resolve_layers(spec: str, model, tokenizer, device: torch.device) -> list[str]:
    """Layer names from "last", "all" or "0,5,last": "last" or the index (>= 0) into encode(all_layers=True)."""
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if parts == ["last"]:
        return parts
    n_layers = count_layers(model, tokenizer, device)
    names: list[str] = []
    for part in parts:
        if part == "all":
            names += [str(i) for i in range(n_layers)]
        elif part == "last":
            names.append(part)
        else:
            try:
                index = int(part)
            except ValueError:
                raise UserError(f"layers: expected 'last', 'all' or layer numbers, got '{part}'") from None
            if not -n_layers <= index < n_layers:
                raise UserError(f"layers: {index} is out of range, the model has {n_layers} layers")
            names.append(str(index % n_layers))
    return list(dict.fromkeys(names))


@torch.no_grad()
def extract_features(model, tokenizer, texts: list[tuple[str, ...]], layers: list[str], max_len: int,
                     batch_size: int, device: torch.device, desc: str = "",
                     pool: Callable[[Tensor, Tensor], Tensor] = mean_pool) -> dict[str, Tensor]:
    """Pooled features [N, D] (float32, on CPU) per layer, in the order of `texts`; `pool(hidden, pad_mask)`
    turns a batch's [B, S, D] states into [B, D] (default: the mean over the real tokens).

    Examples are sorted by length (longest first, so memory problems show at once) to keep padding small, and
    put back in order at the end. The caller sets eval mode.
    """
    seqs = [encode_example(tokenizer, t, max_len) for t in texts]
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    per_layer: dict[str, list[Tensor]] = {layer: [] for layer in layers}
    every, start = max(1, len(batches) // 10), time.perf_counter()
    logger.info(f"{desc}: encoding {len(seqs)} examples in {len(batches)} batches")
    for b, batch in enumerate(batches):
        tokens, pad_mask = pad_batch([seqs[i] for i in batch], tokenizer.pad_id, device)
        for layer, hidden in _layer_outputs(model, tokens, pad_mask, layers).items():
            per_layer[layer].append(pool(hidden, pad_mask).float().cpu())
        if (b + 1) % every == 0 and b + 1 < len(batches):
            logger.info(f"{desc}: {b + 1}/{len(batches)} batches, {time.perf_counter() - start:.1f}s")
    logger.info(f"{desc}: done in {time.perf_counter() - start:.1f}s")
    position = torch.empty(len(order), dtype=torch.long)
    position[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return {layer: torch.cat(parts)[position] for layer, parts in per_layer.items()}


def pad_batch(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    lengths = torch.tensor([len(seq) for seq in seqs])
    tokens = torch.full((len(seqs), int(lengths.max())), pad_id, dtype=torch.long)
    for row, seq in enumerate(seqs):
        tokens[row, :len(seq)] = torch.tensor(seq)
    pad_mask = torch.arange(tokens.shape[1]) < lengths[:, None]
    return tokens.to(device), pad_mask.to(device)


def _layer_outputs(model, tokens: Tensor, pad_mask: Tensor, layers: list[str]) -> dict[str, Tensor]:
    """One forward pass; all_layers only when a numbered layer is wanted (its last entry is the final output)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=tokens.device.type == "cuda"):
        if layers == ["last"]:
            return {"last": model.encode(tokens, pad_mask)}
        outputs = model.encode(tokens, pad_mask, all_layers=True)
    return {layer: outputs[-1 if layer == "last" else int(layer)] for layer in layers}


class FeatureCache:
    """Features on disk, one file per (model, task, split, layer, max_len, exact list of texts).

    `model_id` must change whenever the weights do (the CLI uses the checkpoint's path, sizes and mtimes); the texts
    are hashed into the key, so a different data source, training cap or seed never reuses stale features.
    """

    def __init__(self, directory: str | Path, model_id: str):
        self.directory, self.model_id = Path(directory), model_id

    def path(self, task: str, split: str, layer: str, max_len: int, texts: list[tuple[str, ...]]) -> Path:
        digest = hashlib.sha1(json.dumps([self.model_id, max_len, texts]).encode()).hexdigest()[:16]
        return self.directory / f"{task}.{split}.layer-{layer}.{digest}.pt"

    def load(self, path: Path, rows: int) -> Tensor | None:
        """The cached features of `rows` examples, or None when absent or not intact (a file torn by a crash or
        altered is removed and recomputed)."""
        if not path.is_file():
            return None
        try:
            saved = torch.load(path, weights_only=True)
            features = saved["features"]
            intact = features.ndim == 2 and len(features) == rows and saved["sha256"] == _checksum(features)
        except Exception:  # truncated zip, bad pickle, another layout: any failure means "recompute"
            intact = False
        if intact:
            return features
        logger.warning(f"feature cache file {path.name} is not intact: recomputing it")
        path.unlink(missing_ok=True)
        return None

    def save(self, path: Path, features: Tensor) -> None:
        saved = {"features": features, "sha256": _checksum(features)}
        try:
            atomic_write(path, lambda file: torch.save(saved, file))
        except (OSError, RuntimeError) as e:  # a full disk (torch.save says RuntimeError): the cache only saves time
            logger.warning(f"could not cache features in {path.parent}: {e}")


def _checksum(features: Tensor) -> str:
    return hashlib.sha256(features.contiguous().numpy().tobytes()).hexdigest()


