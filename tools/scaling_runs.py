"""A sweep's runs as the scaling commands read them: the run folders a `runs=` spec names, what each holds (its app,
shape, compute, validation curves, GLUE and MTEB scores, frozen and fine-tuned, its log's loss events), and the LR
and BSZ power laws fitted to the best of them. tools.scaling's fit and table and tools.scaling_plots all read runs
through here; the plan does not.
"""

import contextlib
import glob
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lingua.app import short_name
from lingua.checkpoint.store import Checkpoint
from lingua.errors import UserError, require
from lingua.files import untrusted
from lingua.jobs.launcher import read_job_record
from lingua.metrics import read_metrics
from lingua.model.scaling import best_per_group, fit_power_law
from lingua.run_folder import CHECKPOINTS, METRICS, RunFolder
from tools.eval.glue import read_summary
from tools.eval.mteb import benchmark_of
from tools.eval.mteb import read_results as read_mteb_results
from tools.finetune.table import choose
from tools.finetune.table import read_results as read_finetune_results
from tools.pipeline_results import median_views_per_s

PROBES = ("linear", "knn")


def require_probe(probe: str) -> None:
    require(probe in PROBES, "probe", f"must be linear or knn, got '{probe}'")


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
    config = untrusted.read_yaml(RunFolder(dump_dir).config, "run config")
    train, val, probed = [], [], []
    for record in read_metrics(RunFolder(dump_dir).metrics):
        is_probe = any(key.startswith("glue/") for key in record)
        (val if "val/loss" in record else train if "loss" in record else probed if is_probe else []).append(record)
    if not train:
        raise UserError(f"{dump_dir} has no training metrics yet")
    last = train[-1]
    views_per_token = last["token_views_per_s"] / last["data_tokens_per_s"]
    encoder = config["model"]["encoder"]
    parent = config.get("continue_from")
    start_step = continued_step(parent) if parent else 0
    compute_at, data_tokens_at = (count_by_step(train, key, continued=bool(parent))
                                  for key in ("compute_flops", "data_tokens"))
    step_tokens = data_tokens_at(last["step"]) - data_tokens_at(last["step"] - 1)  # a warm-up's batch grows
    return {
        "dir": dump_dir, "app": _app_of(dump_dir), "lr": config["optim"]["lr"],
        "parent": RunFolder.of(parent).root.resolve() if parent else None, "schedule": schedule_of(config),
        "steps": last["step"], "start_step": start_step,
        "bsz": round(step_tokens * views_per_token),  # the last step's; views per token: 1 or 2 (CMS)
        "views_per_token": round(views_per_token),
        "size": f"{encoder['dim']}x{encoder['n_layers']}", "compute": last["compute_flops"],
        "compute_with_heads": last.get("compute_flops_with_head"),
        "data_tokens": last["data_tokens"],
        "token_views_per_s": median_views_per_s(train),
        "compute_at": compute_at, "data_tokens_at": data_tokens_at,
        "val_curve": [(compute_at(r["step"]), r["val/loss"]) for r in val],
        "source_curves": source_curves(val, compute_at),
        "final_val_loss": val[-1]["val/loss"] if val else None,
        "probes": _probe_results(dump_dir),
        "finetune": _finetune_results(dump_dir),
        "mteb": _mteb_results(dump_dir, "frozen"),
        "mteb_full": _mteb_results(dump_dir, "full"),
        "probe_curve": [(compute_at(r["step"]), r) for r in probed],
    }


def schedule_of(config: dict) -> str:
    """The learning-rate schedule a run's config names: its decay's shape, after `wsd ` for warmup-stable-decay; a
    `branch` when it continues another run's training."""
    optim = config["optim"]
    name = optim.get("decay", "cosine") if optim.get("schedule", "warmup_decay") == "warmup_decay" else \
        f"wsd {optim.get('decay', 'cosine')}"
    return f"{name} branch" if config.get("continue_from") else name


def read_runs(spec: str) -> list[dict[str, Any]]:
    """Every run of `spec` (run_dirs), as runs at their budgets: a run that another of them continues from (the
    stable run of WSD decay branches, a phase before the next) is left out, its final loss being no finished run's;
    a continued run's validation curve starts with its parent's, up to the step it continued from, and its compute
    counts from the parent's start (the loop's count)."""
    runs = [read_run(folder) for folder in run_dirs(spec)]
    by_folder = {run["dir"].resolve(): run for run in runs}
    for run in sorted(runs, key=lambda r: r["start_step"]):  # a parent starts before its branches: its curve is whole
        parent = by_folder.get(run["parent"])
        if parent is not None:
            before = parent["compute_at"](run["start_step"])
            run["val_curve"] = [point for point in parent["val_curve"] if point[0] <= before] + run["val_curve"]
    parents = {run["parent"] for run in runs}
    return [run for run in runs if run["dir"].resolve() not in parents]


def source_curves(val: list[dict], compute_at) -> dict[str, list[tuple[float, float]]]:
    """{source: [(compute, loss)]} of the validation records' per-source losses (val/loss/SOURCE)."""
    curves: dict[str, list[tuple[float, float]]] = {}
    for record in val:
        for key, loss in record.items():
            if key.startswith("val/loss/"):
                curves.setdefault(key.removeprefix("val/loss/"), []).append((compute_at(record["step"]), loss))
    return curves


def count_by_step(train: list[dict], key: str, continued: bool):
    """A count the training records log as it grows (`compute_flops`, `data_tokens`) at the end of any step: exact at
    each logged step, linear between two, beyond them at the nearest two's rate; 0 before a new run's first step (a
    continued run's records count its parents' too). A batch-size warm-up or a continued run's parents make it no
    fixed rate per step."""
    points = ([] if continued else [(0, 0.0)]) + [(r["step"], r[key]) for r in train]
    (first_step, first), (last_step, last) = points[0], points[-1]
    first_rate = (points[1][1] - first) / (points[1][0] - first_step) if len(points) > 1 else first / first_step
    last_rate = (last - points[-2][1]) / (last_step - points[-2][0]) if len(points) > 1 else last / last_step

    def count_at(step: float) -> float:
        if step <= first_step:
            return first - (first_step - step) * first_rate
        if step >= last_step:
            return last + (step - last_step) * last_rate
        return float(np.interp(step, *zip(*points)))

    return count_at


def continued_step(checkpoint: str) -> int:
    """The step of the checkpoint a continued run's config names (continue_from records the exact checkpoint,
    CHECKPOINTS/0000000300)."""
    name = Path(checkpoint).name
    if Path(checkpoint).parent.name != CHECKPOINTS or not name.isdigit():
        raise UserError(f"continue_from {checkpoint} names no checkpoint of a run (RUN/{CHECKPOINTS}/STEP)")
    return int(name)


PROGRESS = re.compile(r"step (\d+)/\d+ \| loss (\S+)")
SPIKE_WINDOW = 10  # log lines: a spike is measured against the median of the loss over the previous ones


def training_history(dump_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every progress line of the run's train.log, in the order written: unlike metrics.jsonl, which
    a resumed run rewrites from its checkpoint on, the log keeps the stretch a divergence threw away."""
    return [(int(step), float(loss)) for step, loss in PROGRESS.findall(RunFolder(dump_dir).log_text())]


@dataclass
class LossEvents:
    spikes: list[tuple[int, float]]  # (step, loss) more than `rise` above the median of the previous log lines
    non_finite: list[int]  # steps logged with a loss that is not finite
    rewinds: list[tuple[int, int]]  # (last step logged, step resumed after): a restart from an earlier checkpoint,
    # as after the divergence guard stopped the run (it saves nothing) or a crash; a preempted run saves and goes on


def loss_events(history: list[tuple[int, float]], rise: float) -> LossEvents:
    """The loss spikes, non-finite losses and rewinds of a training history (Appendix I's evidence); the median
    restarts after a rewind."""
    events = LossEvents([], [], [])
    recent: list[float] = []
    last_step = 0
    for step, loss in history:
        if step <= last_step:
            events.rewinds.append((last_step, step))
            recent = []
        last_step = step
        if not math.isfinite(loss):
            events.non_finite.append(step)
            continue
        if len(recent) == SPIKE_WINDOW and loss > (1 + rise) * statistics.median(recent):
            events.spikes.append((step, loss))
        recent = [*recent, loss][-SPIKE_WINDOW:]
    return events


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
    consolidated.pt, else the first line of its log ("MODULE: N parameters ...")."""
    job, _ = read_job_record(dump_dir)
    if job is not None and isinstance(job.get("script"), str):
        return short_name(job["script"])
    with contextlib.suppress(UserError):
        return short_name(Checkpoint.open(dump_dir).app_name)
    log = RunFolder(dump_dir).log_text()
    found = re.search(r" (\S+): [\d,]+ parameters", log)
    return short_name(found.group(1)) if found else "?"


def _probe_results(dump_dir: Path) -> dict[str, dict[str, float]]:
    """{probe: {task: score, "avg": GLUE average}} of the newest frozen evaluation of the run's final weights."""
    results = sorted(RunFolder(dump_dir).evaluation_results("glue"), key=lambda p: p.stat().st_mtime)
    if not results:
        return {}
    return read_summary(results[-1]).get("last", {})


def _mteb_results(dump_dir: Path, protocol: str) -> dict[str, dict[str, float]]:
    """{benchmark: its summary (a score per task type, Avg., Overall)} of the newest MTEB evaluation per benchmark
    filed with the run (DUMP_DIR/mteb_eval/*/: the contrastive model trained from it, evaluated with tools.eval.mteb
    out=DUMP_DIR/mteb_eval/NAME), for one protocol: "full" (NAME ends in _full: the whole model fine-tuned) or
    "frozen" (any other NAME: a pooler over frozen features)."""
    found: dict[str, dict[str, float]] = {}
    for path in sorted(RunFolder(dump_dir).evaluation_results("mteb"), key=lambda p: p.stat().st_mtime):
        if (path.parent.name.endswith("_full")) == (protocol == "full"):
            results = read_mteb_results(path)
            found[benchmark_of(results)] = results["summary"]
    return found


def _finetune_results(dump_dir: Path) -> dict[str, float]:
    """{task: score, "avg": their mean} of the GLUE fine-tuning runs that descend from the run, in the sweeps beside
    it (a pipeline's VARIANT/finetune*/ beside VARIANT/pretrain), each task at the learning rate chosen on dev
    (tools.finetune.table's choice: the best median over seeds)."""
    results, _ = read_finetune_results(sorted(dump_dir.parent.glob("finetune*")))
    own = [r for r in results if RunFolder.of(r.model).root.resolve() == dump_dir.resolve()]
    scores = {task: entry["score"] for tasks in choose(own).values() for task, entry in tasks.items()}
    return scores | {"avg": sum(scores.values()) / len(scores)} if scores else {}


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
    """The runs of `spec` (`read_runs`) that have a validation loss (what the fits read)."""
    return [run for run in read_runs(spec) if run["final_val_loss"] is not None]
