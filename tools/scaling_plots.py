"""The plots of `python -m tools.scaling plot`: the paper's Figures 1, 3, 4, 5 and 6 and Appendix H's heatmaps, drawn
with matplotlib from a sweep's runs (tools.scaling_runs): panels, axes, the fitted laws dashed across the points.
"""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lingua.args import load_config
from lingua.errors import UserError, require
from lingua.model.scaling import best_per_group, fit_power_law
from tools.scaling_runs import (
    fitted_hyperparameters,
    loss_events,
    probe_curves,
    read_runs,
    require_probe,
    training_history,
)

PLOT_KINDS = ("curves", "loss", "probes", "training", "glue_tasks", "mteb_types", "sources", "heatmaps", "spikes",
              "schedules")


@dataclass
class PlotArgs:
    # curves | loss | probes | training | glue_tasks | mteb_types | sources | heatmaps | spikes | schedules
    kind: str = "curves"
    runs: str = ""  # comma-separated sweep folders (or dump_dirs)
    out: str = "plot.png"
    probe: str = "linear"  # probes, training and glue_tasks: linear | knn
    benchmark: str = "MTEB(eng, v2)"  # mteb_types: the benchmark whose task types are drawn
    fit: bool = False  # probes, glue_tasks and mteb_types: each app's power law fitted to its scores
    keep: int = 3  # heatmaps: the best runs per model size the LR and BSZ laws are fitted to (the paper: 3)
    rise: float = 0.1  # spikes: a logged loss this far above the median of the previous 10 log lines is a spike

    def __post_init__(self):
        require_probe(self.probe)
        require(self.kind in PLOT_KINDS, "kind", f"must be one of {', '.join(PLOT_KINDS)}, got '{self.kind}'")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")
        require(self.rise > 0, "rise", f"must be > 0, got {self.rise}")


def plot_command(argv: list[str]) -> None:
    args = load_config(PlotArgs, argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = read_runs(args.runs)
    plotters = {"training": _plot_training, "glue_tasks": _plot_per_task, "mteb_types": _plot_per_task,
                "sources": _plot_sources, "heatmaps": _plot_heatmaps, "spikes": _plot_spikes,
                "schedules": _plot_schedules}
    _save(plt, plotters.get(args.kind, _plot_summary)(plt, runs, args), args.out)


def _plot_summary(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """curves, loss and probes (Figure 1)."""
    # Losses get a panel per app: the apps' losses are of different tasks (and scales), not comparable; probes a
    # panel per benchmark, GLUE then each MTEB benchmark evaluated, the apps side by side.
    panels = (sorted({run["app"] for run in runs}) if args.kind in ("curves", "loss")
              else ["GLUE", *sorted({benchmark for run in runs for results in ("mteb", "mteb_full")
                                     for benchmark in run[results]})])
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
        elif panel == "GLUE":  # frozen: the linear (or kNN) probe; unfrozen: the fine-tuning recipe of Table 3
            _scatter_with_law(ax, runs, lambda run: run["probes"].get(args.probe, {}).get("avg"), fit=args.fit,
                              frozen=True)
            _scatter_with_law(ax, runs, lambda run: run["finetune"].get("avg"), fit=args.fit, frozen=False)
            ax.set_ylabel(f"GLUE average (%): frozen, {args.probe} probe; unfrozen, fine-tuned")
        else:  # contrastive training over frozen features, or of the whole model
            for frozen, results in ((True, "mteb"), (False, "mteb_full")):
                _scatter_with_law(ax, runs, lambda run, benchmark=panel, results=results: run[results].get(
                    benchmark, {}).get("Avg."), fit=args.fit, frozen=frozen)
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


def task_scores(run: dict[str, Any], args: PlotArgs, frozen: bool = True) -> dict[str, float]:
    """The run's score per GLUE task (glue_tasks: the probe's on frozen features, else fine-tuned) or per task type
    of the benchmark (mteb_types: the type means of its summary, over frozen features or of the whole model), in the
    order its results list them."""
    if args.kind == "glue_tasks":
        scores = run["probes"].get(args.probe, {}) if frozen else run["finetune"]
        return {task: score for task, score in scores.items() if task != "avg"}
    summary = run["mteb" if frozen else "mteb_full"].get(args.benchmark, {})
    return {kind: score for kind, score in summary.items() if kind not in ("Avg.", "Overall")}


def _plot_per_task(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """Figures 4 (GLUE tasks) and 3 (MTEB task types): a panel each, every app's scores against compute, frozen and,
    where the runs have them, unfrozen."""
    scores = {(run["dir"], frozen): task_scores(run, args, frozen) for run in runs for frozen in (True, False)}
    panels = list(dict.fromkeys(task for by_task in scores.values() for task in by_task))
    if not panels:
        found = (f"GLUE {args.probe} probe results (DUMP_DIR/glue_eval)" if args.kind == "glue_tasks"
                 else f"{args.benchmark} results (DUMP_DIR/mteb_eval)")
        raise UserError(f"no {found} in {args.runs}")
    fig, axes = _grid(plt, len(panels))
    for ax, panel in zip(axes, panels):
        for frozen in (True, False):
            _scatter_with_law(ax, runs, lambda run, task=panel, frozen=frozen: scores[run["dir"], frozen].get(task),
                              fit=args.fit, frozen=frozen)
        _against_compute(ax, panel)
        ax.set_ylabel(f"{args.probe} probe or fine-tuned (%)" if args.kind == "glue_tasks" else "score (%)")
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


def _plot_spikes(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """Appendix I's evidence: each run's training loss against steps from every progress line of its log (the
    stretches a divergence threw away included), its spikes marked, the non-finite losses and the restarts from an
    earlier checkpoint (the divergence guard stops a run without saving) as vertical lines; a panel per run, and a
    line per run printed."""
    histories = {run["dir"]: training_history(run["dir"]) for run in runs}
    if not any(histories.values()):
        raise UserError(f"no progress lines (step N/T | loss ...) in the train.log of {args.runs}")
    shown = [run for run in runs if histories[run["dir"]]]
    fig, axes = _grid(plt, len(shown), width=5.0, columns=2)
    for ax, run in zip(axes, shown):
        history, name = histories[run["dir"]], "/".join(run["dir"].parts[-2:])
        events = loss_events(history, args.rise)
        ax.plot(*zip(*history), linewidth=0.8, label="training loss (log lines)")
        if events.spikes:
            ax.plot(*zip(*events.spikes), "x", color="red", label=f"spikes (> {1 + args.rise:g} x median)")
        for step in events.non_finite:
            ax.axvline(step, color="red", linewidth=0.8)
        for last, resumed in events.rewinds:
            ax.axvspan(resumed, last, color="orange", alpha=0.3)
        ax.set_title(f"{name} ({run['app']})")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.legend(fontsize=6)
        steps = ", ".join(str(step) for step, _ in events.spikes[:10]) + (", ..." if len(events.spikes) > 10 else "")
        restarts = "".join(f" ({last} back to {resumed})" for last, resumed in events.rewinds)
        print(f"{name}: {len(events.spikes)} loss spikes" + (f" (steps {steps})" if steps else "")
              + f"; {len(events.non_finite)} non-finite losses; {len(events.rewinds)} restarts from an earlier "
              f"checkpoint{restarts}")
    return fig


def _plot_schedules(plt, runs: list[dict[str, Any]], args: PlotArgs):
    """Learning-rate schedules compared (e.g. cosine runs against the WSD decay branches of a stable run), a row
    per app: the validation curves (a colour per model size, a line style per schedule; a branch's curve starts with
    its stable parent's), then the final losses against compute with each schedule's fitted law."""
    runs = [run for run in runs if run["final_val_loss"] is not None]
    apps = sorted({run["app"] for run in runs})
    if not apps:
        raise UserError(f"schedules: no run with a validation loss in {args.runs}")
    sizes = sorted({run["size"] for run in runs}, key=lambda size: min(r["compute"] for r in runs if r["size"] == size))
    schedules = sorted({run["schedule"] for run in runs})
    colours = {size: plt.get_cmap("tab10")(i) for i, size in enumerate(sizes)}
    styles = dict(zip(schedules, ["-", "--", ":", "-."] * len(schedules)))
    markers = dict(zip(schedules, "osD^v" * len(schedules)))
    fig, axes = plt.subplots(len(apps), 2, figsize=(13, 0.5 + 4.5 * len(apps)), squeeze=False)
    for (curves, finals), app in zip(axes, apps):
        shown = [run for run in runs if run["app"] == app]
        for run in shown:
            curves.plot(*zip(*run["val_curve"]), linestyle=styles[run["schedule"]], color=colours[run["size"]],
                        linewidth=1.5)
        for size in sizes:
            curves.plot([], [], color=colours[size], label=f"dim x layers {size}")
        for name in schedules:
            curves.plot([], [], color="black", linestyle=styles[name], label=name)
        _against_compute(curves, f"{app}: validation loss during training", "compute so far")
        curves.set_ylabel("validation loss")
        for name in schedules:
            points = sorted((run["compute"], run["final_val_loss"]) for run in shown if run["schedule"] == name)
            line, = finals.plot(*zip(*points), marker=markers[name], markersize=7, linestyle="", label=name)
            _draw_law(finals, points, name, line.get_color())
        _against_compute(finals, f"{app}: final validation loss per budget", "compute C")
        finals.xaxis.set_minor_formatter("")  # the budgets' minor ticks' labels run into each other
        finals.set_ylabel("final validation loss")
    for ax in axes.flat:
        ax.legend(fontsize=9)
        ax.title.set_fontsize(12)
        ax.xaxis.label.set_fontsize(11)
        ax.yaxis.label.set_fontsize(11)
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


def _scatter_with_law(ax, runs, value, fit: bool = True, frozen: bool | None = None) -> None:
    """Each app's points of `value` against compute, an app's color the same in every panel and series; `frozen`
    (scores) labels the series and draws the unfrozen one dashed with open squares, as Figure 1 sets them apart."""
    apps = sorted({run["app"] for run in runs})
    for index, app in enumerate(apps):
        points = sorted((run["compute"], value(run)) for run in runs if run["app"] == app and value(run) is not None)
        if not points:
            continue
        label = app if frozen is None else f"{app}, {'frozen' if frozen else 'unfrozen'}"
        ax.plot(*zip(*points), marker="o" if frozen is not False else "s", color=f"C{index}",
                fillstyle="full" if frozen is not False else "none",
                linestyle="" if fit else "-" if frozen is not False else "--", label=label)
        if fit:
            _draw_law(ax, points, label, f"C{index}")
