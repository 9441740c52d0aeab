"""Scaling laws: plan a compute-optimal run, fit the hyper-parameter power laws, plot a sweep.

    python -m tools.scaling plan app=crossbert compute=1e19 gpus=16 [micro_batch=128] [out=CONFIG.yaml]
    python -m tools.scaling fit runs=SWEEP_DIR[,SWEEP_DIR...] [keep=3]
    python -m tools.scaling plot kind=KIND runs=SWEEP_DIR[,...] out=PLOT.png [probe=linear|knn] [fit=true] [keep=3]
    python -m tools.scaling table runs=SWEEP_DIR[,...] [probe=linear|knn]
    python -m tools.scaling loss runs=SWEEP_DIR[,...]

plan: the shape from the app's family (the configs `shapes`, by default apps/<app>/configs/scaling_*.yaml, the
paper's Appendix J) whose F_N is nearest sqrt(C / ratio); D = C / F_N token-views; BSZ and LR from the app's power
laws (section 5.1); steps, per-GPU batch and gradient accumulation for `gpus`. fit: from a sweep over sizes, learning
rates and batch sizes, the best `keep` runs per size by final validation loss, and the LR and BSZ power laws of C
fitted by log-log least squares (Appendix H). plot: validation-loss curves against compute (curves), final
validation loss against compute with its fitted law (loss), both a panel per app; the scores against compute per app
(probes, the paper's Figure 1): a GLUE panel (the probe averages of each run's glue_eval results, and the fine-tuned
averages of the GLUE fine-tuning sweeps beside the run, VARIANT/finetune*/) and a panel per MTEB benchmark (the Avg.
of each run's mteb_eval results: over frozen features, and of the whole model from a folder named *_full), frozen
filled, unfrozen open and dashed; the frozen probe scores over training (training, the paper's Figure 6): the
`glue/<task>/<probe>` records the loop logs every eval.every steps, against the compute spent so far, a line per
run, a panel for the GLUE average and one per task; the scores per task against compute, the apps side by side, a
panel per GLUE task (glue_tasks, Figure 4) or per task type of an MTEB benchmark (mteb_types, Figure 3), frozen and,
where the runs have them, unfrozen; the validation loss on each source against compute, a panel per source and app,
with the power law of the runs' final losses (sources, Figure 5 / Appendix F); a sweep's final validation loss per
learning rate and batch size, a heatmap per model size, the best `keep` of each marked, then the LR and BSZ laws
fitted to them (heatmaps, Appendix H); each run's training loss against steps from every progress line of its
train.log, its spikes (a log line `rise` above the median of the previous 10), non-finite losses and restarts from an
earlier checkpoint marked, and printed (spikes, Appendix I); the validation curves and final losses of runs of
different learning-rate schedules, a law per schedule (schedules). fit=true draws each app's power law in the score
plots. runs= takes patterns too (DIR/*/pretrain). table: a Markdown table of the runs by app and compute, with their
final validation loss and frozen GLUE scores per task, then, where the runs were also fine-tuned (GLUE, or contrastive
training of the whole model: mteb_eval/*_full), each run's frozen and unfrozen averages and Figure 1's gap beside the
paper's. loss: the runs' final validation losses side by side per schedule (a column each: cosine, wsd, the WSD decay
branches of a stable run, ...), a row per app, shape and budget, then the power law L(C) = a C^b of the final loss
against compute fitted per app and schedule. A run other runs continue from (the stable run of decay branches) is
read as their parent, never as a run at a budget (tools.scaling_runs.read_runs).
"""

import copy
import glob
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import yaml

from apps import registered_apps
from lingua.app import App, load_app
from lingua.args import command_line, load_config, read_yaml
from lingua.errors import UserError
from lingua.files.safe import atomic_write
from lingua.model.scaling import (
    TOKENS_PER_FLOP_PER_TOKEN,
    fit_power_law,
    nearest_shape,
    optimal_flops_per_token,
    plan_batch,
)
from tools import paper
from tools.scaling_plots import plot_command
from tools.scaling_runs import fitted_hyperparameters, read_runs, require_probe, validated_runs


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


@dataclass
class LossArgs:
    runs: str = ""  # comma-separated sweep folders (or dump_dirs): runs of several schedules, decay branches


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


# ------------------------------------------------------------------------------------------------ fit


def fit_command(argv: list[str]) -> None:
    args = load_config(FitArgs, argv)
    runs = validated_runs(args.runs)
    kept, fits = fitted_hyperparameters(runs, args.keep)
    print(f"{len(runs)} runs with a validation loss, {len({r['size'] for r in runs})} sizes; kept the best "
          f"{args.keep} per size: {len(kept)}")
    for name, fit in fits.items():
        print(f"{name.upper()}(C) = {fit.law.coefficient:.4g} x C^{fit.law.exponent:.3f}   (exponent ± "
              f"{fit.exponent_stderr:.3f}, log10 coefficient ± {fit.coefficient_log10_stderr:.3f}, {fit.points} runs)")


# ------------------------------------------------------------------------------------------------ table


def table_command(argv: list[str]) -> None:
    args = load_config(TableArgs, argv)
    runs = sorted(read_runs(args.runs), key=lambda r: (r["app"], r["compute"]))
    print(format_runs_table(runs, args.probe))
    if any(run["finetune"] or run["mteb_full"] for run in runs):
        print("\n" + format_adaptation_gaps(runs, args.probe))


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


GAP_BENCHMARK = "MTEB(eng, v2)"  # Figure 1's


def format_adaptation_gaps(runs: list[dict[str, Any]], probe: str) -> str:
    """Frozen against unfrozen per run (Figure 1, section 5.3): the GLUE probe's average beside the fine-tuned one,
    MTEB(eng, v2)'s Avg. over frozen features beside the whole model's, and the gap (unfrozen minus frozen); then
    each app's mean MTEB gap beside the paper's prose (BERT about 15 points, CrossBERT about 1)."""
    def avg(scores: dict) -> float | None:
        return scores.get("avg") if "avg" in scores else scores.get("Avg.")

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = [f"| run | app | C (FLOPs) | GLUE {probe} probe | GLUE fine-tuned | {GAP_BENCHMARK} frozen | "
             f"{GAP_BENCHMARK} whole model | gap |", "|---" * 8 + "|"]
    gaps: dict[str, list[float]] = {}
    for run in runs:
        frozen, full = avg(run["mteb"].get(GAP_BENCHMARK, {})), avg(run["mteb_full"].get(GAP_BENCHMARK, {}))
        gap = None if frozen is None or full is None else full - frozen
        if gap is not None:
            gaps.setdefault(run["app"], []).append(gap)
        lines.append(f"| {'/'.join(run['dir'].parts[-2:])} | {run['app']} | {run['compute']:.2g} | "
                     f"{cell(avg(run['probes'].get(probe, {})))} | {cell(avg(run['finetune']))} | {cell(frozen)} | "
                     f"{cell(full)} | {cell(gap)} |")
    published = paper.PROSE["adaptation_gap"]
    ours = "; ".join(f"{app} {sum(values) / len(values):.1f} over {len(values)} runs" for app, values in gaps.items())
    lines += ["", f"{GAP_BENCHMARK} gap, unfrozen minus frozen Avg., mean per app: ours {ours or 'none yet'}; the "
              "paper (section 5.3): " + ", ".join(f"{paper.NAMES[app]} about {points}" for app, points in
                                                   published.items()) + " points."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ loss


def loss_command(argv: list[str]) -> None:
    args = load_config(LossArgs, argv)
    print(format_loss_laws(validated_runs(args.runs)))


def format_loss_laws(runs: list[dict[str, Any]]) -> str:
    """A Markdown table of the final validation losses, a row per app, shape and budget (compute, to 3 digits), a
    column per schedule; then L(C) fitted per app and schedule (where two budgets or more have a loss)."""
    schedules = sorted({run["schedule"] for run in runs})
    rows: dict[tuple, dict[str, dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: (r["app"], r["compute"])):
        rows.setdefault((run["app"], run["size"], f"{run['compute']:.3g}"), {})[run["schedule"]] = run
    lines = ["| app | shape | steps | C (FLOPs) | " + " | ".join(schedules) + " |", "|---" * (4 + len(schedules)) + "|"]
    for (app, size, compute), by_schedule in rows.items():
        steps = "/".join(sorted({str(run["steps"]) for run in by_schedule.values()}))
        losses = [f"{by_schedule[name]['final_val_loss']:.4f}" if name in by_schedule else "-" for name in schedules]
        lines.append(f"| {app} | {size} | {steps} | {compute} | " + " | ".join(losses) + " |")
    lines.append("")
    for app in sorted({run["app"] for run in runs}):
        for name in schedules:
            points = [(run["compute"], run["final_val_loss"]) for run in runs
                      if run["app"] == app and run["schedule"] == name]
            if len({compute for compute, _ in points}) >= 2:
                fit = fit_power_law(*zip(*points))
                lines.append(f"{app}, {name}: L(C) = {fit.law.coefficient:.4g} x C^{fit.law.exponent:.4f}   (exponent "
                             f"± {fit.exponent_stderr:.4f}, {fit.points} runs)")
    return "\n".join(lines)


COMMANDS = {"plan": plan_command, "fit": fit_command, "plot": plot_command, "table": table_command,
            "loss": loss_command}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with command_line(__doc__):
        if not argv or argv[0] in ("--help", "-h"):
            print(__doc__)
            return
        if argv[0] not in COMMANDS:
            raise UserError(f"unknown command '{argv[0]}' (plan, fit, plot, table or loss)")
        COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
