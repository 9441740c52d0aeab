"""Frozen evaluation on GLUE (paper section 4.1, "Eval on GLUE" in 5.1): linear (ridge) and kNN probes on mean-pooled
encoder features. Used by `python -m tools.eval.glue` and, through `run_glue_probes`, by the probes during training
(lingua/training/validation.py).

Protocol, and the choices the paper leaves open:
- Features: the chosen layer's outputs averaged over the real tokens (padding excluded), one forward pass per split
  in eval mode without gradients. "last" is the model's final output (after the final norm); a number selects that
  entry of `encode(all_layers=True)` (0 = first block); `layers=all` probes every block (the paper's Table 1).
- Inputs are encoded RoBERTa style: `<s> a </s>` and, for sentence pairs, `<s> a </s></s> b </s>`, truncated to
  `max_len` tokens (the longer sentence of a pair is shortened first).
- Training examples: one seeded permutation of the train split, capped at `max_train`; the nested subsets of sizes
  1, 10, 100, ... are its prefixes. Scores are on the validation split (MNLI: dev_matched), in percent.
- Linear probe: ridge on one-hot targets (arg-max) or on the STS-B score, standardised features and an unregularised
  intercept (see lingua/eval/probes.py), for log-spaced λ in [1, 1e4]. The reported score is the best over λ at the
  largest training size, i.e. λ is chosen on the validation split, as in the paper; the full curve is kept.
- kNN probe: majority vote (STS-B: mean score) of the k nearest training examples on the raw features, for L2 and
  cosine and k in {1, 3, 10, 30}; the reported score is the best over k and distance (again chosen on validation).
- One number per task (the `headline` metric): accuracy for MNLI, QNLI, QQP, RTE, SST-2 and MRPC, Matthews
  correlation for CoLA, Spearman correlation for STS-B. F1 (QQP, MRPC) and Pearson (STS-B) are kept alongside.

The tasks and the reading of their splits are lingua/eval/glue_data.py's.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from lingua.errors import UserError, at_least
from lingua.eval import probes
from lingua.eval.features import DEFAULT_MAX_LEN, FeatureCache, extract_features, resolve_layers
from lingua.eval.glue_data import TASKS, GlueSplit, GlueTask, MissingSplit, SkippedLinesReport, load_split

logger = logging.getLogger(__name__)

PROBES = ("linear", "knn")


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


# ------------------------------------------------------------------------------------------------------ features


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
        raise UserError(f"GLUE data folder not found: {Path(args.data).absolute()} (give a folder in GLUE's TSV "
                        "layout, SST-2/train.tsv, ..., or data=hf to read GLUE from the HF hub)")
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


def evaluate_glue(model, tokenizer, args: GlueEvalArgs, device: torch.device, cache: FeatureCache | None = None,
                  report: SkippedLinesReport | None = None) -> dict:
    """Probes every task of `args`; returns the results (per task, layer and probe) and a summary per layer.
    Malformed lines are reported through `report` (see load_split).

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
                results["tasks"][task.name] = evaluate_task(model, tokenizer, task, layers, args, device, cache,
                                                            report)
            except MissingSplit as e:
                logger.warning(f"{task.title}: skipped, {e}")
                results["skipped"][task.name] = str(e)
    finally:
        model.train(was_training)
    results["summary"] = summarize(results, args.probes)
    return results


def evaluate_task(model, tokenizer, task: GlueTask, layers: list[str], args: GlueEvalArgs, device: torch.device,
                  cache: FeatureCache | None, report: SkippedLinesReport | None = None) -> dict:
    train = load_split(task, "train", args.data, report=report)
    dev = load_split(task, "dev", args.data, report=report)
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


def run_glue_probes(model, tokenizer, args: GlueEvalArgs, device: torch.device,
                    report: SkippedLinesReport | None = None) -> dict[str, float]:
    """Probes the current weights (the evaluation during training) and returns flat metrics for metrics.jsonl.

    Features are computed afresh at every call (never cached on disk: the weights change between calls) and the
    model goes back to its previous (training) mode afterwards.
    """
    return flat_metrics(evaluate_glue(model, tokenizer, args, device, report=report))


def probe_length(args: GlueEvalArgs, seq_len: int, max_seqlen: int) -> int:
    """The probes' tokens per example for a model trained on `seq_len` tokens: `max_len`, else `seq_len`, and never
    past the model's position table."""
    return min(args.max_len or seq_len, max_seqlen)
