"""Scaling laws: plan a compute-optimal run, fit the hyper-parameter power laws, plot a sweep.

    python -m tools.scaling plan app=crossbert compute=1e19 gpus=16 [micro_batch=128] [out=CONFIG.yaml]
    python -m tools.scaling fit runs=SWEEP_DIR[,SWEEP_DIR...] [keep=3]
    python -m tools.scaling plot kind=KIND runs=SWEEP_DIR[,...] out=PLOT.png [probe=linear|knn] [fit=true] [keep=3]
    python -m tools.scaling table runs=SWEEP_DIR[,...] [probe=linear|knn]

plan: the shape from the app's family (the configs `shapes`, by default apps/<app>/configs/scaling_*.yaml, the
paper's Appendix J) whose F_N is nearest sqrt(C / ratio); D = C / F_N token-views; BSZ and LR from the app's power
laws (section 5.1); steps, per-GPU batch and gradient accumulation for `gpus`. fit: from a sweep over sizes, learning
rates and batch sizes, the best `keep` runs per size by final validation loss, and the LR and BSZ power laws of C
fitted by log-log least squares (Appendix H). plot: validation-loss curves against compute (curves), final
validation loss against compute with its fitted law (loss), both a panel per app, and the frozen scores against
compute per app (probes, the paper's Figure 1): a GLUE panel (the probe averages of each run's glue_eval results)
and a panel per MTEB benchmark (the Avg. of each run's mteb_eval results); the frozen probe scores over training
(training, the paper's Figure 6): the `glue/<task>/<probe>` records the loop logs every eval.every steps, against the
compute spent so far, a line per run, a panel for the GLUE average and one per task; the frozen scores per task
against compute, the apps side by side, a panel per GLUE task (glue_tasks, Figure 4) or per task type of an MTEB
benchmark (mteb_types, Figure 3); the validation loss on each source against compute, a panel per source and app,
with the power law of the runs' final losses (sources, Figure 5 / Appendix F); a sweep's final validation loss per
learning rate and batch size, a heatmap per model size, the best `keep` of each marked, then the LR and BSZ laws
fitted to them (heatmaps, Appendix H). fit=true draws each app's power law in the score plots. runs= takes patterns
too (DIR/*/pretrain). table: a Markdown table of the runs by app and compute, with their final validation loss and
frozen GLUE scores per task.
"""

import contextlib
import copy
import glob
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import yaml

from apps import registered_apps
from lingua.app import App, load_app, short_name
from lingua.args import UserError, command_line, load_config, read_yaml, require
from lingua.checkpoint import Checkpoint
from lingua.files import atomic_write
from lingua.metrics import read_metrics
from lingua.run_folder import METRICS, RunFolder
from lingua.scaling import (
    TOKENS_PER_FLOP_PER_TOKEN,
    best_per_group,
    fit_power_law,
    nearest_shape,
    optimal_flops_per_token,
    plan_batch,
)
from tools.eval.mteb import benchmark_of


@dataclass
class PlanArgs:
    app: str = "crossbert"  # any app with scaling laws (App.scaling): bert, crossbert, electra
    compute: float = 1e19  # C: training FLOPs as the paper counts them (eq. 6-8)
    gpus: int = 1
    micro_batch: int = 128  # most sequences per GPU per micro-step; sets the gradient accumulation
    grad_acc: int | None = None  # accumulation steps (default: the fewest that respect micro_batch)
    ratio: float = TOKENS_PER_FLOP_PER_TOKEN  # D / F_N: token-views per FLOP per token-view (Appendix J: 20)
    shapes: str = ""  # a glob of configs, the family of shapes (default: the app's configs/scaling_*.yaml, or those
    # of the app its laws name)
    seq_len: int = 512
    out: str = ""  # write the planned config here
    dump_dir: str = ""  # of the written config (default: dump/<app>_<compute>)


@dataclass
class FitArgs:
    runs: str = ""  # comma-separated sweep folders (or dump_dirs)
    keep: int = 3  # best runs per model size kept for the fit (the paper: 3)


PROBES = ("linear", "knn")


def require_probe(probe: str) -> None:
    require(probe in PROBES, "probe", f"must be linear or knn, got '{probe}'")


PLOT_KINDS = ("curves", "loss", "probes", "training", "glue_tasks", "mteb_types", "sources", "heatmaps")


@dataclass
class PlotArgs:
    kind: str = "curves"  # curves | loss | probes | training | glue_tasks | mteb_types | sources | heatmaps
    runs: str = ""  # comma-separated sweep folders (or dump_dirs)
    out: str = "plot.png"
    probe: str = "linear"  # probes, training and glue_tasks: linear | knn
    benchmark: str = "MTEB(eng, v2)"  # mteb_types: the benchmark whose task types are drawn
    fit: bool = False  # probes, glue_tasks and mteb_types: each app's power law fitted to its scores
    keep: int = 3  # heatmaps: the best runs per model size the LR and BSZ laws are fitted to (the paper: 3)

    def __post_init__(self):
        require_probe(self.probe)
        require(self.kind in PLOT_KINDS, "kind", f"must be one of {', '.join(PLOT_KINDS)}, got '{self.kind}'")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")


@dataclass
class TableArgs:
    runs: str = ""  # comma-separated sweep folders (or dump_dirs)
    probe: str = "linear"  # linear | knn

    def __post_init__(self):
        require_probe(self.probe)


# ------------------------------------------------------------------------------------------------ plan


def family(app: App, pattern: str = "") -> dict[str, dict[str, Any]]:
    """{config path: its config (a nested dict)} of the app's shapes."""
    source = load_app(app.scaling.shapes_of) if app.scaling.shapes_of else app
    default = source.folder / "configs" / "scaling_*.yaml"
    paths = sorted(glob.glob(pattern or str(default)))
    if not paths:
        raise UserError(f"no config matches shapes={pattern or default}")
    return {path: read_yaml(path) for path in paths}


def shape_config(app: App, path: str, config: dict[str, Any]) -> dict[str, Any]:
    """The family config as a config of `app`: another app's config lends only its backbone."""
    if Path(path).resolve().parents[1] == app.folder.resolve():
        return config
    return {key: value for key, value in config.items() if key != "model"} | {
        "model": {"encoder": config["model"]["encoder"]}}


def flops_and_views(app: App, config: dict[str, Any], seq_len: int) -> tuple[float, int]:
    """(F_N per token-view, token-views per sequence) of the config's model, built on the meta device."""
    args = load_config(app.args_cls, [], base={**config, "dump_dir": config.get("dump_dir") or "unused"})
    with torch.device("meta"):
        model = app.build_model(args.model, SimpleNamespace(vocab_size=50261, mask_id=50260, pad_id=50259))
    return model.flops_per_token_view(seq_len), model.views_per_sequence


def plan(args: PlanArgs):
    app = load_app(args.app)
    if app.scaling is None:
        known = ", ".join(a.short_name for a in registered_apps() if a.scaling is not None)
        raise UserError(f"no scaling laws for app '{args.app}' (known: {known}; an app gives them as App.scaling)")
    configs = {path: shape_config(app, path, config) for path, config in family(app, args.shapes).items()}
    measured = {path: flops_and_views(app, config, args.seq_len) for path, config in configs.items()}
    chosen = nearest_shape(optimal_flops_per_token(args.compute, args.ratio),
                           {path: flops for path, (flops, _) in measured.items()})
    flops, views = measured[chosen]
    laws = app.scaling
    result = plan_batch(args.compute, flops, laws.bsz(args.compute), laws.lr(args.compute),
                        views * args.seq_len, args.gpus, args.micro_batch, args.grad_acc)
    return chosen, configs[chosen], result


def planned_config(args: PlanArgs, config: dict[str, Any], result) -> dict[str, Any]:
    name = f"{args.app}_{args.compute:.3g}".replace("+", "")
    config = copy.deepcopy(config)
    config |= {"name": name, "dump_dir": args.dump_dir or f"dump/{name}", "steps": result.steps,
               "grad_acc_steps": result.grad_acc_steps}
    config.setdefault("data", {}).update(batch_size=result.batch_size, seq_len=args.seq_len)
    config.setdefault("optim", {})["lr"] = float(f"{result.lr:.3g}")
    return config


def format_plan(args: PlanArgs, chosen: str, config: dict[str, Any], result) -> str:
    encoder = config["model"]["encoder"]
    predictor = config["model"].get("predictor")
    shape = f"dim {encoder['dim']}, {encoder['n_layers']} layers, {encoder['n_heads']} heads" + (
        f"; predictor {predictor.get('n_layers')} layers" if predictor else "")
    return "\n".join([
        f"{args.app} at C = {args.compute:.3g} FLOPs (paper counting, eq. 6-8):",
        f"  shape      {shape} (from {Path(chosen).name}), F_N = {result.flops_per_token_view:.4g} FLOPs/token-view",
        f"  data       D = C / F_N = {result.token_views / 1e9:.4g}B token-views (D / F_N = "
        f"{result.token_views / result.flops_per_token_view:.3g})",
        f"  batch      BSZ = {result.batch_token_views:,} token-views = {result.sequences_per_step} sequences of "
        f"{args.seq_len} = {result.batch_size} per GPU x {result.gpus} GPU(s) x {result.grad_acc_steps} accumulation",
        f"  steps      {result.steps:,}",
        f"  lr         {result.lr:.3g}",
    ])


def plan_command(argv: list[str]) -> None:
    args = load_config(PlanArgs, argv)
    chosen, config, result = plan(args)
    print(format_plan(args, chosen, config, result))
    if args.out:
        atomic_write(args.out, yaml.safe_dump(planned_config(args, config, result), sort_keys=False))
        print(f"config: {args.out}")


# ------------------------------------------------------------------------------------------------ runs


def run_dirs(spec: str) -> list[Path]:
    """Every dump_dir under the given sweep folders (those holding a metrics.jsonl), or the dump_dirs themselves;
    a pattern (dump/pipelines/figure1/*/pretrain) stands for the folders it matches."""
    folders = [Path(p) for part in spec.split(",") if part.strip()
               for p in (sorted(glob.glob(part.strip())) if glob.has_magic(part) else [part.strip()])]
    if not folders:
        raise UserError("runs= is required: sweep folders or dump_dirs, comma-separated")
    found = []
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"{folder} is not a folder")
        found += [folder] if RunFolder(folder).metrics.exists() else sorted(
            p.parent for p in folder.glob(f"*/{METRICS}"))
    if not found:
        raise UserError(f"no run (a folder with metrics.jsonl) in {spec}")
    return found


def read_run(dump_dir: Path) -> dict[str, Any]:
    """What the fits and plots need from one run's dump_dir."""
    config = yaml.safe_load(RunFolder(dump_dir).config.read_text())
    train, val, probed = [], [], []
    for record in read_metrics(RunFolder(dump_dir).metrics):
        is_probe = any(key.startswith("glue/") for key in record)
        (val if "val/loss" in record else train if "loss" in record else probed if is_probe else []).append(record)
    if not train:
        raise UserError(f"{dump_dir} has no training metrics yet")
    last = train[-1]
    flops_per_step = last["compute_flops"] / last["step"]
    views_per_token = last["token_views_per_s"] / last["data_tokens_per_s"]
    encoder = config["model"]["encoder"]
    return {
        "dir": dump_dir, "app": _app_of(dump_dir), "lr": config["optim"]["lr"],
        "bsz": round(last["data_tokens"] / last["step"] * views_per_token),  # views per token: 1 or 2 (CMS)
        "size": f"{encoder['dim']}x{encoder['n_layers']}", "compute": last["compute_flops"],
        "val_curve": [(r["step"] * flops_per_step, r["val/loss"]) for r in val],
        "source_curves": source_curves(val, flops_per_step),
        "final_val_loss": val[-1]["val/loss"] if val else None,
        "probes": _probe_results(dump_dir),
        "mteb": _mteb_results(dump_dir),
        "probe_curve": [(r["step"] * flops_per_step, r) for r in probed],
    }


def source_curves(val: list[dict], flops_per_step: float) -> dict[str, list[tuple[float, float]]]:
    """{source: [(compute, loss)]} of the validation records' per-source losses (val/loss/SOURCE)."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for record in val:
        for key, loss in record.items():
            if key.startswith("val/loss/"):
                curves.setdefault(key.removeprefix("val/loss/"), []).append((record["step"] * flops_per_step, loss))
    return curves


def probe_curves(run: dict[str, Any], probe: str) -> dict[str, list[tuple[float, float]]]:
    """{task or "avg": [(compute, score)]} of the last layer's `probe` scores logged during the run's training."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for compute, record in run["probe_curve"]:
        for key, score in record.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "glue" and parts[2] == probe:
                curves.setdefault(parts[1], []).append((compute, score))
    return curves


def _app_of(dump_dir: Path) -> str:
    """The short name of the app that trained the run: from stool's job record, else its newest checkpoint or
    export, else the first line of its log ("MODULE: N parameters ...")."""
    job = RunFolder(dump_dir).job_record
    if job.exists():
        return short_name(json.loads(job.read_text())["script"])
    with contextlib.suppress(UserError):
        return short_name(Checkpoint.open(dump_dir).app_name)
    log = RunFolder(dump_dir).log.read_text(errors="replace") if RunFolder(dump_dir).log.exists() else ""
    found = re.search(r" (\S+): [\d,]+ parameters", log)
    return short_name(found.group(1)) if found else "?"


def _probe_results(dump_dir: Path) -> dict[str, dict[str, float]]:
    """{probe: {task: score, "avg": GLUE average}} of the newest frozen evaluation of the run's final weights."""
    results = sorted(RunFolder(dump_dir).evaluation_results("glue"), key=lambda p: p.stat().st_mtime)
    if not results:
        return {}
    return json.loads(results[-1].read_text())["summary"].get("last", {})


def _mteb_results(dump_dir: Path) -> dict[str, dict[str, float]]:
    """{benchmark: its summary (a score per task type, Avg., Overall)} of the newest MTEB evaluation per benchmark
    filed with the run (DUMP_DIR/mteb_eval/*/: the contrastive model trained from it, evaluated with tools.eval.mteb
    out=DUMP_DIR/mteb_eval/NAME)."""
    found: dict[str, dict[str, float]] = {}
    for path in sorted(RunFolder(dump_dir).evaluation_results("mteb"), key=lambda p: p.stat().st_mtime):
        results = json.loads(path.read_text())
        found[benchmark_of(results)] = results["summary"]
    return found


def fitted_hyperparameters(runs: list[dict[str, Any]], keep: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the best `keep` runs per model size by final validation loss, {"lr": Fit, "bsz": Fit}: the power laws of
    compute fitted to them by log-log least squares, section 5.1)."""
    if len({run["size"] for run in runs}) < 2:
        raise UserError("fitting needs finished runs with a validation loss at two or more model sizes")
    kept = best_per_group(runs, "size", "final_val_loss", keep)
    try:
        return kept, {name: fit_power_law([run["compute"] for run in kept], [run[name] for run in kept])
                      for name in ("lr", "bsz")}
    except ValueError as e:
        raise UserError(f"the kept runs cannot be fitted: {e}") from None


def validated_runs(spec: str) -> list[dict[str, Any]]:
    """The runs of `spec` that have a validation loss (what the fits read)."""
    return [run for run in map(read_run, run_dirs(spec)) if run["final_val_loss"] is not None]


def fit_command(argv: list[str]) -> None:
    args = load_config(FitArgs, argv)
    runs = validated_runs(args.runs)
    kept, fits = fitted_hyperparameters(runs, args.keep)
    print(f"{len(runs)} runs with a validation loss, {len({r['size'] for r in runs})} sizes; kept the best "
          f"{args.keep} per size: {len(kept)}")
    for name, fit in fits.items():
        print(f"{name.upper()}(C) = {fit.law.coefficient:.4g} x C^{fit.law.exponent:.3f}   (exponent ± "
              f"{fit.exponent_stderr:.3f}, log10 coefficient ± {fit.coefficient_log10_stderr:.3f}, {fit.points} runs)")


# ------------------------------------------------------------------------------------------------ plots


def plot_command(argv: list[str]) -> None:
    args = load_config(PlotArgs, argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(d) for d in run_dirs(args.runs)]
    plotters = {"training": _plot_training, "glue_tasks": _plot_per_task, "mteb_types": _plot_per_task,
                "sources": _plot_sources, "heatmaps": _plot_heatmaps}
    _save(plt, plotters.get(args.kind, _plot_summary)(plt, runs, args), args.out)


def _plot_summary(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """curves, loss and probes (Figure 1)."""
    # Losses get a panel per app: the apps' losses are of different tasks (and scales), not comparable; probes a
    # panel per benchmark, GLUE then each MTEB benchmark evaluated, the apps side by side.
    panels = (sorted({run["app"] for run in runs}) if args.kind in ("curves", "loss")
              else ["GLUE", *sorted({benchmark for run in runs for benchmark in run["mteb"]})])
    fig, axes = plt.subplots(1, len(panels), figsize=(1 + 5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        shown = [run for run in runs if run["app"] == panel]  # curves and loss: the panel's app
        if args.kind == "curves":
            for run in shown:
                if run["val_curve"]:
                    ax.plot(*zip(*run["val_curve"]), marker=".", label=run["dir"].name)
            ax.set_ylabel("validation loss")
        elif args.kind == "loss":
            _scatter_with_law(ax, shown, lambda run: run["final_val_loss"])
            ax.set_ylabel("final validation loss")
        elif panel == "GLUE":
            _scatter_with_law(ax, runs, lambda run: run["probes"].get(args.probe, {}).get("avg"), fit=args.fit)
            ax.set_ylabel(f"frozen GLUE average, {args.probe} probe (%)")
        else:
            _scatter_with_law(ax, runs, lambda run, benchmark=panel: run["mteb"].get(benchmark, {}).get("Avg."),
                              fit=args.fit)
            ax.set_ylabel(f"{panel} Avg. (%)")
        _against_compute(ax, panel)
    return fig


def _plot_training(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """Figure 6: each run's probe scores over its training, a panel for the GLUE average, then one per task."""
    curves = {run["dir"]: probe_curves(run, args.probe) for run in runs}
    if not any(curves.values()):
        raise UserError(f"no GLUE probe scores logged during training in {args.runs} (set eval.every > 0)")
    tasks = sorted({task for by_task in curves.values() for task in by_task} - {"avg"})
    panels = ["avg", *tasks] if any("avg" in by_task for by_task in curves.values()) else tasks
    fig, axes = plt.subplots(1, len(panels), figsize=(1 + 4 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for run in runs:
            if panel in curves[run["dir"]]:
                ax.plot(*zip(*curves[run["dir"]][panel]), marker=".", label="/".join(run["dir"].parts[-2:]))
        _against_compute(ax, "GLUE average" if panel == "avg" else panel, "compute so far")
        ax.set_ylabel(f"frozen {args.probe} probe (%)")
    return fig


def task_scores(run: dict[str, Any], args: PlotArgs) -> dict[str, float]:
    """The run's frozen score per GLUE task (glue_tasks: the probe's) or per task type of the benchmark (mteb_types:
    the type means of its summary), in the order its results list them."""
    if args.kind == "glue_tasks":
        return {task: score for task, score in run["probes"].get(args.probe, {}).items() if task != "avg"}
    summary = run["mteb"].get(args.benchmark, {})
    return {kind: score for kind, score in summary.items() if kind not in ("Avg.", "Overall")}


def _plot_per_task(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """Figures 4 (GLUE tasks) and 3 (MTEB task types): a panel each, every app's scores against compute."""
    scores = {run["dir"]: task_scores(run, args) for run in runs}
    panels = list(dict.fromkeys(task for by_task in scores.values() for task in by_task))
    if not panels:
        found = (f"GLUE {args.probe} probe results (DUMP_DIR/glue_eval)" if args.kind == "glue_tasks"
                 else f"{args.benchmark} results (DUMP_DIR/mteb_eval)")
        raise UserError(f"no {found} in {args.runs}")
    fig, axes = _grid(plt, len(panels))
    for ax, panel in zip(axes, panels):
        _scatter_with_law(ax, runs, lambda run, task=panel: scores[run["dir"]].get(task), fit=args.fit)
        _against_compute(ax, panel)
        ax.set_ylabel(f"frozen {args.probe} probe (%)" if args.kind == "glue_tasks" else "score (%)")
    return fig


def _plot_sources(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """Figure 5 (Appendix F): the validation loss on each source against compute, a row per source and a column per
    app, a line per run, and the power law fitted to the runs' final losses."""
    sources = sorted({source for run in runs for source in run["source_curves"]})
    if not sources:
        raise UserError(f"no validation loss per source (val/loss/SOURCE) in {args.runs}: validate on two or more "
                        "sources (data.validation_sources)")
    apps = sorted({run["app"] for run in runs})
    fig, axes = plt.subplots(len(sources), len(apps), figsize=(1 + 5 * len(apps), 0.5 + 3.5 * len(sources)),
                             squeeze=False)
    for row, source in zip(axes, sources):
        for ax, app in zip(row, apps):
            shown = sorted((run for run in runs if run["app"] == app and run["source_curves"].get(source)),
                           key=lambda run: run["compute"])
            for run in shown:
                ax.plot(*zip(*run["source_curves"][source]), marker=".", markersize=3,
                        label=f"C = {run['compute']:.2g}")
            _draw_law(ax, [run["source_curves"][source][-1] for run in shown], "final losses")
            _against_compute(ax, f"{app}: {source}", "compute so far")
            ax.set_yscale("log")
            ax.set_ylabel(f"validation loss on {source}")
    return fig


def _plot_heatmaps(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """Appendix H: a sweep's final validation loss per learning rate and batch size, a heatmap per model size with
    its best `keep` runs marked, then the LR and BSZ laws fitted to those (two sizes or more)."""
    runs = [run for run in runs if run["final_val_loss"] is not None]
    apps = sorted({run["app"] for run in runs})
    if len(apps) != 1:
        raise UserError(f"heatmaps: the runs of one app with a validation loss are needed, found "
                        f"{', '.join(apps) or 'none'} in {args.runs}")
    sizes = sorted({run["size"] for run in runs}, key=lambda size: min(r["compute"] for r in runs if r["size"] == size))
    kept, fits = (fitted_hyperparameters(runs, args.keep) if len(sizes) > 1
                  else (best_per_group(runs, "size", "final_val_loss", args.keep), {}))
    fig, axes = _grid(plt, len(sizes) + len(fits), width=4.5)
    for ax, size in zip(axes, sizes):
        _heatmap(ax, [run for run in runs if run["size"] == size], {run["dir"] for run in kept}, f"{apps[0]} {size}")
    for ax, (name, fit) in zip(axes[len(sizes):], fits.items()):
        ax.plot(*zip(*sorted((run["compute"], run[name]) for run in kept)), "o", label=f"best {args.keep} per size")
        _draw_law(ax, [(run["compute"], run[name]) for run in kept], "fit")
        _against_compute(ax, f"{name.upper()}(C) = {fit.law.coefficient:.3g} C^{fit.law.exponent:.3f}")
        ax.set_yscale("log")
        ax.set_ylabel("peak learning rate" if name == "lr" else "BSZ (token-views per step)")
    return fig


def _heatmap(ax, runs: list[dict[str, Any]], kept: set, title: str) -> None:
    """Final validation loss, learning rate (rows) by batch size (columns); the kept runs' cells in bold, starred."""
    lrs, batches = sorted({run["lr"] for run in runs}), sorted({run["bsz"] for run in runs})
    losses = np.full((len(lrs), len(batches)), np.nan)
    for run in runs:
        row, column = lrs.index(run["lr"]), batches.index(run["bsz"])
        losses[row, column] = run["final_val_loss"]
        best = run["dir"] in kept
        ax.text(column, row, f"{run['final_val_loss']:.3f}" + ("*" if best else ""), ha="center", va="center",
                fontsize=7, fontweight="bold" if best else "normal", color="white")
    image = ax.imshow(losses, origin="lower", cmap="viridis", aspect="auto")
    ax.figure.colorbar(image, ax=ax, label="final validation loss")
    ax.set_xticks(range(len(batches)), [f"{b:.3g}" for b in batches], fontsize=7)
    ax.set_yticks(range(len(lrs)), [f"{lr:.2g}" for lr in lrs], fontsize=7)
    ax.set_xlabel("BSZ (token-views per step)")
    ax.set_ylabel("peak learning rate")
    ax.set_title(f"{title}, C = {np.mean([run['compute'] for run in runs]):.2g}")


def _grid(plt, n: int, width: float = 4.0, columns: int = 4):
    """A figure of n panels, `columns` to a row; (the figure, its n axes)."""
    shown = min(n, columns)
    rows = math.ceil(n / shown)
    fig, axes = plt.subplots(rows, shown, figsize=(1 + width * shown, 0.5 + 3.5 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _against_compute(ax, title: str, what: str = "compute C") -> None:
    ax.set_title(title)
    ax.set_xscale("log")
    ax.set_xlabel(f"{what} (FLOPs, paper counting)")
    ax.legend(fontsize=6)


def _save(plt, fig, out: str) -> None:
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot: {out}")


def _draw_law(ax, points: list[tuple[float, float]], label: str, color: str = "black") -> None:
    """The power law fitted to the points, dashed across their range: with two distinct x or more and every y
    positive (a power law has no other)."""
    if len({x for x, _ in points}) < 2 or min(y for _, y in points) <= 0:
        return
    law = fit_power_law(*zip(*points)).law
    xs = [min(x for x, _ in points), max(x for x, _ in points)]
    ax.plot(xs, [law(x) for x in xs], linestyle="--", color=color,
            label=f"{label}: {law.coefficient:.3g} C^{law.exponent:.3f}")


def _scatter_with_law(ax, runs, value, fit: bool = True) -> None:
    for app in sorted({run["app"] for run in runs}):
        points = sorted((run["compute"], value(run)) for run in runs if run["app"] == app and value(run) is not None)
        if not points:
            continue
        line, = ax.plot(*zip(*points), marker="o", linestyle="-" if not fit else "", label=app)
        if fit:
            _draw_law(ax, points, app, line.get_color())


# ------------------------------------------------------------------------------------------------ table


def table_command(argv: list[str]) -> None:
    args = load_config(TableArgs, argv)
    print(format_runs_table(sorted(map(read_run, run_dirs(args.runs)), key=lambda r: (r["app"], r["compute"])),
                            args.probe))


def format_runs_table(runs: list[dict[str, Any]], probe: str) -> str:
    """One Markdown row per run: app, shape, compute, final validation loss, then the probe's GLUE scores."""
    tasks = list(dict.fromkeys(task for run in runs for task in run["probes"].get(probe, {}) if task != "avg"))
    lines = ["| run | app | shape | C (FLOPs) | val loss | " + " | ".join([*tasks, f"{probe} avg"]) + " |",
             "|---" * (6 + len(tasks)) + "|"]
    for run in runs:
        scores = run["probes"].get(probe, {})
        loss = "-" if run["final_val_loss"] is None else f"{run['final_val_loss']:.3f}"
        cells = [f"{scores[task]:.1f}" if task in scores else "-" for task in [*tasks, "avg"]]
        lines.append(f"| {run['dir'].name} | {run['app']} | {run['size']} | {run['compute']:.2g} | {loss} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


COMMANDS = {"plan": plan_command, "fit": fit_command, "plot": plot_command, "table": table_command}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with command_line(__doc__):
        if not argv or argv[0] in ("--help", "-h"):
            print(__doc__)
            return
        if argv[0] not in COMMANDS:
            raise UserError(f"unknown command '{argv[0]}' (plan, fit, plot or table)")
        COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
