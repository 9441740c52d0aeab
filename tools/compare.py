"""Runs side by side: a table of each pre-training run's validation loss, cost and probe scores, and its curves.

    python -m tools.compare dump/a dump/b ... [plot=curves.png] [metrics=glue/avg/linear,mteb/MTEB(eng, v2)/Avg.]

A row per run (a dump_dir holding metrics.jsonl, read through tools.scaling_runs): its final and best validation
loss, steps, data tokens, training FLOPs (eq. 6-8 as the paper counts them, every app's output heads left out: the
logs' `compute_flops`; and with every head: `compute_flops_with_head`), throughput (the median of its log lines'
token-views/s over all processes, the first left out: it holds the start-up; CrossBERT with CMS sees each token
twice) and the probe scores named by `metrics`: `glue/TASK/PROBE` (TASK or avg; PROBE linear or knn) and
`mteb/BENCHMARK/TYPE` (a task type, Avg. or Overall), from the newest evaluation filed with the run (tools.eval.glue,
tools.eval.mteb), else the last the run logged while training; by default every GLUE and MTEB average any of the runs
has. BERT's and CrossBERT's validation losses are
the cross-entropy of their masked tokens and share a column; another app's loss is its own objective (ELECTRA's: the
generator's MLM loss plus rtd_weight x the discriminator's RTD loss) and gets a column of its own. plot=FILE.png
draws each run's validation loss against its compute, a panel per column of losses.
"""

import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingua.args import command_line, load_config
from lingua.errors import UserError, require
from lingua.files.safe import atomic_write
from lingua.run_folder import RunFolder
from tools.scaling_runs import read_run
from tools.tables import markdown_table, number

MASKED_LM_APPS = ("bert", "crossbert")  # their val/loss: the cross-entropy of the masked tokens
OBJECTIVES = {"electra": "generator MLM + rtd_weight x RTD"}  # what another app's val/loss is


def named_metrics(spec: str) -> list[str]:
    """The comma-separated names of `spec`, commas inside a benchmark's parentheses kept."""
    return [name.strip() for name in re.split(r",(?![^()]*\))", spec) if name.strip()]


@dataclass
class CompareArgs:
    plot: str = ""  # a PNG: each run's validation loss against its compute
    metrics: str = ""  # comma-separated glue/TASK/PROBE and mteb/BENCHMARK/TYPE (default: every average any run has)

    def __post_init__(self):
        for name in named_metrics(self.metrics):
            require(re.fullmatch(r"glue/[^/]+/[^/]+|mteb/.+/[^/]+", name) is not None, "metrics",
                    f"'{name}' is neither glue/TASK/PROBE nor mteb/BENCHMARK/TYPE")


def loss_kind(app: str) -> str:
    """The column a run's validation loss goes in: the masked-LM cross-entropy, or its app's own objective."""
    return "masked LM" if app in MASKED_LM_APPS else f"{app}: {OBJECTIVES.get(app, 'its own objective')}"


def read_runs(folders: list[str]) -> list[dict[str, Any]]:
    if not folders:
        raise UserError("name the runs to compare: python -m tools.compare dump/a dump/b ...")
    runs = []
    for folder in map(Path, folders):
        if not RunFolder(folder).metrics.is_file():
            raise UserError(f"{folder} is not a run (no {RunFolder(folder).metrics.name} in it)")
        runs.append({**read_run(folder), "label": str(folder)})
    return runs


def scores(run: dict[str, Any]) -> dict[str, float]:
    """The run's probe scores by metric name: those it logged while training, replaced by its filed evaluations'."""
    found = {key: value for _, record in run["probe_curve"] for key, value in record.items()
             if key.startswith("glue/")}
    found |= {f"glue/{task}/{probe}": score for probe, tasks in run["probes"].items() for task, score in tasks.items()}
    found |= {f"mteb/{benchmark}/{kind}": score for benchmark, summary in run["mteb"].items()
              for kind, score in summary.items()}
    return found


def metric_names(spec: str, runs: list[dict[str, Any]]) -> list[str]:
    """The metrics named, or every average any run has."""
    if spec:
        return named_metrics(spec)
    return sorted({key for run in runs for key in scores(run)
                   if re.fullmatch(r"glue/avg/\w+|mteb/.+/Avg\.", key)})


def table(runs: list[dict[str, Any]], metrics: list[str]) -> list[str]:
    kinds = list(dict.fromkeys(loss_kind(run["app"]) for run in runs))
    header = ["run", "app", *(f"val loss, {kind} (final / best)" for kind in kinds), "steps", "data tokens",
              "FLOPs eq. 7-8", "FLOPs, all heads", "token-views/s", *metrics]
    rows = []
    for run in runs:
        losses = [loss for _, loss in run["val_curve"]]
        loss = f"{losses[-1]:.4f} / {min(losses):.4f}" if losses else "–"
        found = scores(run)
        rows.append([run["label"], run["app"], *(loss if kind == loss_kind(run["app"]) else "" for kind in kinds),
                     str(run["steps"]), number(run["data_tokens"], ".2e"), number(run["compute"], ".2e"),
                     number(run["compute_with_heads"], ".2e"), number(run["token_views_per_s"], ",.0f"),
                     *(number(found.get(name), ".1f") for name in metrics)])
    notes = ["FLOPs (eq. 6): eq. 7-8 as the paper counts them, every app's output heads left out "
             "(`compute_flops`), and with every head (`compute_flops_with_head`). token-views/s: the median over the "
             "run's log lines, all processes together (CrossBERT with CMS sees each token twice). Probe scores in %, "
             "from the newest evaluation filed with the run, else the last logged in training."]
    if len(kinds) > 1:
        notes.append("The validation losses of different objectives are not comparable and stand in columns of their "
                     "own: BERT's and CrossBERT's are the cross-entropy of their masked tokens (each at its own mask "
                     "ratio); ELECTRA's is its whole objective, the generator's MLM loss plus rtd_weight (50 by "
                     "default) x the discriminator's RTD loss; another app's is its own objective.")
    return markdown_table(header, rows) + [line for note in notes for line in ("", note)]


def plot(runs: list[dict[str, Any]], out: str) -> None:
    """Validation loss against compute, a line per run, a panel per kind of loss (losses of different objectives
    share no axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    kinds = list(dict.fromkeys(loss_kind(run["app"]) for run in runs if run["val_curve"]))
    if not kinds:
        raise UserError("plot: none of the runs has logged a validation loss yet")
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 5), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    names = [Path(run["label"]).name for run in runs]
    short = len(set(names)) == len(names)  # the folders' names, unless two runs share one
    for ax, kind in zip(axes[0], kinds):
        for i, run in enumerate(runs):
            if run["val_curve"] and loss_kind(run["app"]) == kind:
                ax.plot(*zip(*run["val_curve"]), marker="o", markersize=4, linewidth=2, color=colors[i % len(colors)],
                        label=f"{names[i] if short else run['label']} ({run['app']})")
        ax.set_xscale("log")
        ax.xaxis.set_minor_locator(ticker.LogLocator(subs=(2, 5)))  # labelled, yet few enough not to overlap
        for axis_ticks in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
            axis_ticks(ticker.FuncFormatter(lambda x, _: f"{x:.0e}".replace("e+", "e")))
        ax.set_xlabel("compute C (FLOPs, eq. 6-8, heads left out)", fontsize=11)
        ax.set_ylabel("validation loss", fontsize=11)
        ax.set_title(f"validation loss, {kind}", fontsize=12)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=10)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=120)
    plt.close(fig)
    atomic_write(out, image.getvalue())
    print(f"plot: {out}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with command_line(__doc__):
        options = [arg for arg in argv if "=" in arg or arg in ("--help", "-h")]
        args = load_config(CompareArgs, options)
        runs = read_runs([arg for arg in argv if arg not in options])
        print("\n".join(table(runs, metric_names(args.metrics, runs))))
        if args.plot:
            plot(runs, args.plot)


if __name__ == "__main__":
    main()
