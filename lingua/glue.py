"""Frozen evaluation on GLUE (paper section 4.1, "Eval on GLUE" in 5.1): linear (ridge) and kNN probes on mean-pooled
encoder features. Used by `python -m apps.eval.glue` and, through `run_glue_probes`, by the training loop.

Protocol, and the choices the paper leaves open:
- Features: the chosen layer's outputs averaged over the real tokens (padding excluded), one forward pass per split
  in eval mode without gradients. "last" is the model's final output (after the final norm); a number selects that
  entry of `encode(all_layers=True)` (0 = first block); `layers=all` probes every block (the paper's Table 1).
- Inputs are encoded RoBERTa style: `<s> a </s>` and, for sentence pairs, `<s> a </s></s> b </s>`, truncated to
  `max_len` tokens (the longer sentence of a pair is shortened first).
- Training examples: one seeded permutation of the train split, capped at `max_train`; the nested subsets of sizes
  1, 10, 100, ... are its prefixes. Scores are on the validation split (MNLI: dev_matched), in percent.
- Linear probe: ridge on one-hot targets (arg-max) or on the STS-B score, standardised features and an unregularised
  intercept (see lingua/probes.py), for log-spaced λ in [1, 1e4]. The reported score is the best over λ at the
  largest training size, i.e. λ is chosen on the validation split, as in the paper; the full curve is kept.
- kNN probe: majority vote (STS-B: mean score) of the k nearest training examples on the raw features, for L2 and
  cosine and k in {1, 3, 10, 30}; the reported score is the best over k and distance (again chosen on validation).
- One number per task (the `headline` metric): accuracy for MNLI, QNLI, QQP, RTE, SST-2 and MRPC, Matthews
  correlation for CoLA, Spearman correlation for STS-B. F1 (QQP, MRPC) and Pearson (STS-B) are kept alongside.
"""

import csv
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from lingua import probes
from lingua.args import UserError, at_least
from lingua.files import atomic_write

logger = logging.getLogger(__name__)

HF_GLUE = "nyu-mll/glue"
PROBES = ("linear", "knn")
DEFAULT_MAX_LEN = 512


@dataclass(frozen=True)
class GlueTask:
    name: str  # config and results key, and the HF hub's configuration name
    title: str  # column name in the paper's tables
    folder: str  # folder in the original GLUE layout
    text_columns: tuple[str, ...]  # one sentence, or a pair
    label_column: str
    labels: tuple[str, ...]  # label strings in the HF hub's label order; empty for regression (STS-B)
    metrics: tuple[str, ...]
    headline: str  # the table's single number for this task
    hf_text_columns: tuple[str, ...]
    dev_file: str = "dev"  # validation split's file name, without .tsv
    columns: tuple[str, ...] = ()  # column names of a file without a header line (CoLA)

    @property
    def regression(self) -> bool:
        return not self.labels


ENTAILMENT = ("entailment", "not_entailment")
PAIR = ("sentence1", "sentence2")
TASKS = {task.name: task for task in [  # in the paper's column order
    GlueTask(name="mnli", title="MNLI", folder="MNLI", dev_file="dev_matched", text_columns=PAIR,
             label_column="gold_label", labels=("entailment", "neutral", "contradiction"), metrics=("acc",),
             headline="acc", hf_text_columns=("premise", "hypothesis")),
    GlueTask(name="qnli", title="QNLI", folder="QNLI", text_columns=("question", "sentence"), label_column="label",
             labels=ENTAILMENT, metrics=("acc",), headline="acc", hf_text_columns=("question", "sentence")),
    GlueTask(name="qqp", title="QQP", folder="QQP", text_columns=("question1", "question2"),
             label_column="is_duplicate", labels=("0", "1"), metrics=("acc", "f1"), headline="acc",
             hf_text_columns=("question1", "question2")),
    GlueTask(name="rte", title="RTE", folder="RTE", text_columns=PAIR, label_column="label", labels=ENTAILMENT,
             metrics=("acc",), headline="acc", hf_text_columns=PAIR),
    GlueTask(name="sst2", title="SST2", folder="SST-2", text_columns=("sentence",), label_column="label",
             labels=("0", "1"), metrics=("acc",), headline="acc", hf_text_columns=("sentence",)),
    GlueTask(name="mrpc", title="MRPC", folder="MRPC", text_columns=("#1 String", "#2 String"),
             label_column="Quality", labels=("0", "1"), metrics=("acc", "f1"), headline="acc", hf_text_columns=PAIR),
    GlueTask(name="cola", title="CoLA", folder="CoLA", text_columns=("sentence",), label_column="label",
             labels=("0", "1"), metrics=("mcc",), headline="mcc", hf_text_columns=("sentence",),
             columns=("source", "label", "original_mark", "sentence")),
    GlueTask(name="stsb", title="STSB", folder="STS-B", text_columns=PAIR, label_column="score", labels=(),
             metrics=("pearson", "spearman"), headline="spearman", hf_text_columns=PAIR),
]}


@dataclass
class GlueEvalArgs:
    data: str = ""  # a folder in the original GLUE TSV layout (SST-2/train.tsv, ...), or "hf" for the HF hub
    tasks: list[str] = field(default_factory=lambda: list(TASKS))  # comma-separated GLUE task names
    probes: list[str] = field(default_factory=lambda: list(PROBES))  # linear (ridge) and/or knn
    layers: str = "last"  # "last", "all", or comma-separated indices into encode(all_layers=True), e.g. "0,5,last"
    max_train: int = 10_000  # training examples per task (a seeded random subset); the largest probe size
    max_len: int = 0  # tokens per example; 0: the model's training seq_len when known, else 512
    batch_size: int = 32  # sequences per forward pass
    num_lambdas: int = 9  # log-spaced ridge strengths from 1 to 1e4
    ridge_solver: str = "eigh"  # eigh: one eigendecomposition per training size | solve: torch.linalg.solve per λ
    knn_k: list[int] = field(default_factory=lambda: [1, 3, 10, 30])  # neighbour counts tried (best on dev)
    seed: int = 0  # the permutation that picks and orders the training examples
    every: int = 0  # training loop only: run the probes every N steps (0: never)

    def __post_init__(self):
        at_least(self, 0, "every", "seed")


# ---------------------------------------------------------------------------------------------------------- data


class MissingSplit(Exception):
    """A split that is not available; the task is skipped with this message."""


@dataclass
class GlueSplit:
    texts: list[tuple[str, ...]]  # one tuple per example: (sentence,) or (sentence_a, sentence_b)
    labels: Tensor  # class indices (long) or scores (float)
    skipped: int = 0  # malformed lines left out

    def subset(self, index: Tensor) -> "GlueSplit":
        return GlueSplit([self.texts[i] for i in index.tolist()], self.labels[index], self.skipped)


def read_glue_tsv(path: str | Path, task: GlueTask) -> GlueSplit:
    """One split in the original GLUE TSV format.

    No quote handling (some sentences start with a lone `"`); MRPC's header starts with a byte-order mark; CoLA has
    no header; MNLI has extra columns (parses, several annotator labels). Lines whose field count differs from the
    header's (QQP has some) or whose label is not a known one are skipped and counted.
    """
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return _read_rows(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), task, path)
    except (UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"{path} is not a GLUE TSV file ({e})") from None


def _read_rows(rows, task: GlueTask, path: str | Path) -> GlueSplit:
    header = list(task.columns) or next(rows, [])
    missing = [c for c in (*task.text_columns, task.label_column) if c not in header]
    if missing:
        raise UserError(f"{path}: no column {missing[0]!r} in header {header} (is this {task.title}?)")
    text_idx = [header.index(c) for c in task.text_columns]
    label_idx = header.index(task.label_column)
    texts, labels, skipped = [], [], 0
    for row in rows:
        label = _parse_label(task, row[label_idx]) if len(row) == len(header) else None
        if label is None:
            skipped += 1
            continue
        texts.append(tuple(row[i] for i in text_idx))
        labels.append(label)
    return GlueSplit(texts, _label_tensor(task, labels), skipped)


def _parse_label(task: GlueTask, value: str) -> float | int | None:
    if task.regression:
        try:
            score = float(value)
        except ValueError:
            return None
        return score if math.isfinite(score) else None  # "nan" and "inf" parse, but are no score
    return task.labels.index(value) if value in task.labels else None


def _label_tensor(task: GlueTask, labels: list) -> Tensor:
    return torch.tensor(labels, dtype=torch.float32 if task.regression else torch.long)


def split_from_hf_rows(task: GlueTask, rows) -> GlueSplit:
    """A split from HF `nyu-mll/glue` rows (dicts); their integer labels already follow `task.labels`' order."""
    texts, labels, skipped = [], [], 0
    for row in rows:
        label = row["label"]
        valid = math.isfinite(label) if task.regression else 0 <= label < len(task.labels)  # -1: unlabelled
        if not valid:
            skipped += 1
            continue
        texts.append(tuple(row[c] for c in task.hf_text_columns))
        labels.append(label)
    return GlueSplit(texts, _label_tensor(task, labels), skipped)


def load_hf_split(task: GlueTask, split: str) -> GlueSplit:
    try:
        import datasets
    except ImportError:
        raise UserError("data=hf needs the HuggingFace `datasets` package (pip install datasets); "
                        "or pass data=GLUE_DIR, a folder in the original GLUE TSV layout") from None
    hf_split = "train" if split == "train" else ("validation_matched" if task.name == "mnli" else "validation")
    try:
        rows = datasets.load_dataset(HF_GLUE, task.name, split=hf_split)
    except Exception as e:  # network, hub or cache errors of any kind: the task cannot be loaded
        raise MissingSplit(f"{HF_GLUE}/{task.name} {hf_split}: {str(e).splitlines()[0] if str(e) else e!r}")
    return split_from_hf_rows(task, rows)


def load_split(task: GlueTask, split: str, data: str) -> GlueSplit:
    """The "train" or "dev" split of `task` from a GLUE folder or, with data="hf", from the HF hub."""
    if data == "hf":
        result = load_hf_split(task, split)
    else:
        path = Path(data) / task.folder / f"{'train' if split == 'train' else task.dev_file}.tsv"
        if not path.is_file():
            raise MissingSplit(f"no {split} split, {path} not found")
        result = read_glue_tsv(path, task)
    if result.skipped:
        logger.warning(f"{task.title} {split}: skipped {result.skipped} malformed lines")
    if not result.texts:
        raise MissingSplit(f"the {split} split has no usable example")
    return result


# ------------------------------------------------------------------------------------------------------ features


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
                     batch_size: int, device: torch.device, desc: str = "") -> dict[str, Tensor]:
    """Mean-pooled features [N, D] (float32, on CPU) per layer, in the order of `texts`.

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
        tokens, pad_mask = _pad([seqs[i] for i in batch], tokenizer.pad_id, device)
        for layer, hidden in _layer_outputs(model, tokens, pad_mask, layers).items():
            per_layer[layer].append(mean_pool(hidden, pad_mask).cpu())
        if (b + 1) % every == 0 and b + 1 < len(batches):
            logger.info(f"{desc}: {b + 1}/{len(batches)} batches, {time.perf_counter() - start:.1f}s")
    logger.info(f"{desc}: done in {time.perf_counter() - start:.1f}s")
    position = torch.empty(len(order), dtype=torch.long)
    position[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return {layer: torch.cat(parts)[position] for layer, parts in per_layer.items()}


def _pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
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


def split_features(model, tokenizer, task: GlueTask, split: str, data: GlueSplit, layers: list[str],
                   args: GlueEvalArgs, device: torch.device, cache: FeatureCache | None) -> dict[str, Tensor]:
    """Cached features where present; one forward pass for the layers that are missing."""
    max_len = args.max_len or DEFAULT_MAX_LEN
    paths = {layer: cache.path(task.name, split, layer, max_len, data.texts) for layer in layers} if cache else {}
    found = {layer: cache.load(paths[layer], len(data.texts)) for layer in layers} if cache else {}
    features = {layer: x for layer, x in found.items() if x is not None}
    missing = [layer for layer in layers if layer not in features]
    if missing:
        computed = extract_features(model, tokenizer, data.texts, missing, max_len, args.batch_size, device,
                                    f"{task.name}/{split}")
        for layer, x in computed.items():
            if cache:
                cache.save(paths[layer], x)
        features.update(computed)
    return features


# -------------------------------------------------------------------------------------------------------- probes


def task_scores(task: GlueTask, pred: Tensor, gold: Tensor) -> dict[str, float]:
    """Every metric of `task` in percent, from predicted classes or scores."""
    return {m: 100 * probes.METRICS[m](pred.cpu(), gold.cpu()) for m in task.metrics}


def linear_probe(task: GlueTask, x_train: Tensor, y_train: Tensor, x_dev: Tensor, y_dev: Tensor,
                 args: GlueEvalArgs, device: torch.device) -> dict:
    sizes = probes.subset_sizes(len(x_train), args.max_train)
    lambdas = probes.lambda_grid(args.num_lambdas)
    targets = y_train.float() if task.regression else torch.nn.functional.one_hot(y_train, len(task.labels))
    sweep = probes.ridge_sweep if args.ridge_solver == "eigh" else probes.ridge_solve_sweep
    x_train, targets, x_dev = x_train.to(device), targets.to(device), x_dev.to(device)
    curve = {m: [] for m in task.metrics}
    for size in sizes:
        preds = sweep(x_train[:size], targets[:size], x_dev, lambdas)  # [λ, N_dev, classes or 1]
        scores = [task_scores(task, p[:, 0] if task.regression else p.argmax(1), y_dev) for p in preds]
        for m in task.metrics:
            curve[m].append([s[m] for s in scores])
    best = max(range(len(lambdas)), key=lambda i: curve[task.headline][-1][i])
    return {"score": curve[task.headline][-1][best],
            "metrics": {m: curve[m][-1][best] for m in task.metrics},
            "best": {"lambda": lambdas[best].item(), "train_size": sizes[-1]},
            "curve": {"train_sizes": sizes, "lambdas": lambdas.tolist(), "scores": curve}}


def knn_probe(task: GlueTask, x_train: Tensor, y_train: Tensor, x_dev: Tensor, y_dev: Tensor,
              args: GlueEvalArgs, device: torch.device) -> dict:
    num_classes = None if task.regression else len(task.labels)
    grid = {}
    for distance in ("l2", "cosine"):
        preds = probes.knn_predict(x_train.to(device), y_train.to(device), x_dev, args.knn_k, distance, num_classes)
        grid[distance] = {str(k): task_scores(task, p, y_dev) for k, p in preds.items()}
    distance, k = max(((d, k) for d in grid for k in grid[d]), key=lambda dk: grid[dk[0]][dk[1]][task.headline])
    return {"score": grid[distance][k][task.headline], "metrics": grid[distance][k],
            "best": {"distance": distance, "k": int(k), "train_size": len(x_train)}, "grid": grid}


PROBE_FNS = {"linear": linear_probe, "knn": knn_probe}


# ---------------------------------------------------------------------------------------------------- evaluation


def check_args(args: GlueEvalArgs) -> list[GlueTask]:
    """The tasks to run, in the paper's order; a UserError for any invalid setting."""
    if not args.data:
        raise UserError("data= is required: a folder in the original GLUE TSV layout, or 'hf' for the HF hub")
    if args.data != "hf" and not Path(args.data).is_dir():
        raise UserError(f"GLUE data folder not found: {args.data}")
    names = {name.lower().replace("-", "") for name in args.tasks}
    unknown = sorted(names - set(TASKS))
    if unknown:
        raise UserError(f"unknown GLUE task '{unknown[0]}' (valid: {', '.join(TASKS)})")
    bad = [p for p in args.probes if p not in PROBES]
    if bad or not args.probes:
        raise UserError(f"unknown probe '{bad[0] if bad else ''}' (valid: {', '.join(PROBES)})")
    if args.ridge_solver not in ("eigh", "solve"):
        raise UserError(f"ridge_solver must be 'eigh' or 'solve', got '{args.ridge_solver}'")
    if not args.knn_k or min(args.max_train, args.batch_size, args.num_lambdas, *args.knn_k) < 1:
        raise UserError("max_train, batch_size, num_lambdas and every knn_k must be >= 1")
    if args.max_len and args.max_len < 6 or args.max_len < 0:
        raise UserError(f"max_len must be 0 (automatic) or at least 6 (a pair's special tokens), got {args.max_len}")
    return [task for name, task in TASKS.items() if name in names]


def evaluate_glue(model, tokenizer, args: GlueEvalArgs, device: torch.device,
                  cache: FeatureCache | None = None) -> dict:
    """Probes every task of `args`; returns the results (per task, layer and probe) and a summary per layer.

    The model is put in eval mode and restored to its previous mode afterwards.
    """
    tasks = check_args(args)
    was_training = model.training
    model.eval()
    try:
        layers = resolve_layers(args.layers, model, tokenizer, device)
        results: dict = {"layers": layers, "tasks": {}, "skipped": {}}
        for task in tasks:
            try:
                results["tasks"][task.name] = evaluate_task(model, tokenizer, task, layers, args, device, cache)
            except MissingSplit as e:
                logger.warning(f"{task.title}: skipped, {e}")
                results["skipped"][task.name] = str(e)
    finally:
        model.train(was_training)
    results["summary"] = summarize(results, args.probes)
    return results


def evaluate_task(model, tokenizer, task: GlueTask, layers: list[str], args: GlueEvalArgs, device: torch.device,
                  cache: FeatureCache | None) -> dict:
    train = load_split(task, "train", args.data)
    dev = load_split(task, "dev", args.data)
    permutation = torch.randperm(len(train.texts), generator=torch.Generator().manual_seed(args.seed))
    train = train.subset(permutation[:args.max_train])
    x_train = split_features(model, tokenizer, task, "train", train, layers, args, device, cache)
    x_dev = split_features(model, tokenizer, task, "dev", dev, layers, args, device, cache)
    out = {"n_train": len(train.texts), "n_dev": len(dev.texts),
           "skipped_lines": {"train": train.skipped, "dev": dev.skipped}, "layers": {}}
    for layer in layers:
        out["layers"][layer] = {probe: PROBE_FNS[probe](task, x_train[layer], train.labels, x_dev[layer],
                                                        dev.labels, args, device) for probe in args.probes}
        scores = ", ".join(f"{p} {r['score']:.1f}" for p, r in out["layers"][layer].items())
        logger.info(f"{task.title} layer {layer}: {task.headline} {scores}")
    return out


def summarize(results: dict, probe_names: list[str]) -> dict:
    """{layer: {probe: {task: headline score, ..., "avg": mean over the evaluated tasks}}}; empty if none was."""
    if not results["tasks"]:
        return {}
    summary: dict = {}
    for layer in results["layers"]:
        summary[layer] = {}
        for probe in probe_names:
            scores = {name: r["layers"][layer][probe]["score"] for name, r in results["tasks"].items()}
            summary[layer][probe] = {**scores, "avg": sum(scores.values()) / len(scores)}
    return summary


def flat_metrics(results: dict) -> dict[str, float]:
    """`glue/<task>/<probe>` (and `glue/avg/<probe>`), with a `/layer<i>` suffix for layers other than "last"."""
    flat = {}
    for layer, per_probe in results["summary"].items():
        suffix = "" if layer == "last" else f"/layer{layer}"
        for probe, scores in per_probe.items():
            flat.update({f"glue/{name}/{probe}{suffix}": score for name, score in scores.items()})
    return flat


def run_glue_probes(model, tokenizer, args: GlueEvalArgs, device: torch.device) -> dict[str, float]:
    """The training loop's hook: probes the current weights and returns flat metrics for metrics.jsonl.

    Features are computed afresh at every call (never cached on disk: the weights change between calls) and the
    model goes back to its previous (training) mode afterwards.
    """
    return flat_metrics(evaluate_glue(model, tokenizer, args, device))


def format_table(results: dict) -> str:
    """The paper's layout (one row per probe and layer, the tasks in its column order, their average), preceded,
    for a single layer, by one row per task with its other metrics and the chosen λ or k."""
    lines = []
    if len(results["layers"]) == 1:
        lines += _task_rows(results, results["layers"][0])
    lines.append(f"{'probe':<16}" + "".join(f"{t.title:>6}" for t in TASKS.values()) + f"{'Avg.':>6}")
    for layer, per_probe in results["summary"].items():
        for probe, scores in per_probe.items():
            cells = "".join(f"{scores[name]:>6.1f}" if name in scores else f"{'-':>6}" for name in TASKS)
            lines.append(f"{probe + ('' if layer == 'last' else f' L{layer}'):<16}{cells}{scores['avg']:>6.1f}")
    if results["skipped"]:
        lines.append(f"Avg. over the {len(results['tasks'])} tasks evaluated; skipped: "
                     + "; ".join(f"{TASKS[name].title} ({why})" for name, why in results["skipped"].items()))
    return "\n".join(lines)


def _task_rows(results: dict, layer: str) -> list[str]:
    probe_names = list(results["summary"][layer])
    lines = [f"GLUE frozen probes, layer {layer}: validation scores in %",
             f"{'task':<6} {'metric':<9} {'train':>6} {'dev':>6}" + "".join(f"{p:>8}" for p in probe_names)
             + "  details"]
    for name, r in results["tasks"].items():
        task, per_probe = TASKS[name], r["layers"][layer]
        details = "; ".join(f"{p}: " + ", ".join([f"{m} {v:.1f}" for m, v in per_probe[p]["metrics"].items()
                                                  if m != task.headline] + [_best(per_probe[p]["best"])])
                            for p in probe_names)
        lines.append(f"{task.title:<6} {task.headline:<9} {r['n_train']:>6} {r['n_dev']:>6}"
                     + "".join(f"{per_probe[p]['score']:>8.1f}" for p in probe_names) + f"  {details}")
    return lines + [""]


def _best(best: dict) -> str:
    if "lambda" in best:
        return f"λ={best['lambda']:.3g}"
    return f"k={best['k']} {best['distance']}"
