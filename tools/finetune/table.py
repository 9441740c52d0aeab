"""The GLUE fine-tuning results of one or more sweeps in the paper's Table 3 layout:

    python -m tools.finetune.table SWEEP_DIR [SWEEP_DIR ...]

Every finished fine-tuning run below the folders counts (its config.yaml, and best.json: the dev score of its best
epoch). Runs are grouped by the pre-training checkpoint they descend from (through an MNLI start; `origin`, recorded
at the start); per model and task, the learning rate with the best median over seeds is chosen on dev, and the table
shows that median; the average is over the tasks present. The paper's row is printed beside a model of the paper's
shape (its app's single_scale.yaml encoder), on the same tasks and averaged over them. Writes table.md and table.json
into the first folder.
"""

import json
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from apps.finetune.train import FinetuneTrainArgs
from lingua.app import load_app, shipped_module, short_name
from lingua.args import command_line, from_dict
from lingua.checkpoint.store import Checkpoint
from lingua.errors import UserError
from lingua.eval.glue_data import TASKS
from lingua.files import untrusted
from lingua.files.safe import atomic_write
from lingua.run_folder import CONFIG, RunFolder
from tools.paper import GLUE_FINETUNE, NAMES


@dataclass(frozen=True)
class Result:
    model: str  # the pre-training run's checkpoint path
    task: str
    lr: float
    seed: int
    score: float  # the task's headline metric, best epoch on dev
    epoch: int
    run: Path


def read_results(folders: list[Path]) -> tuple[list[Result], list[Path]]:
    """(the finished runs' results, the runs not finished yet: no consolidated.pt, the last step's weights)."""
    results, unfinished = [], []
    for config_file in sorted(p for folder in folders for p in folder.rglob(CONFIG)):
        run = RunFolder(config_file.parent)
        config = finetune_config(config_file)
        if config is None:
            continue
        if not run.finished:
            unfinished.append(run.root)
            continue
        best = untrusted.read_json(run.best_record, "best record")
        if not isinstance(best.get("step"), int) or not isinstance(best.get("val/score"), (int, float)):
            raise UserError(f"best record {run.best_record} does not hold step and val/score")
        epoch = best["step"] // config.validation.every
        results.append(Result(config.origin or "(random initialisation)", config.data.task, config.optim.lr,
                              config.seed, best["val/score"], epoch, run.root))
    return results, unfinished


def finetune_config(config_file: Path) -> FinetuneTrainArgs | None:
    """A fine-tuning run's config (checked as the app checks it), or None for another app's run (no `epochs`)."""
    tree = untrusted.read_yaml(config_file, "run config")
    if "epochs" not in tree:
        return None
    try:
        return from_dict(FinetuneTrainArgs, tree)
    except UserError as e:
        raise UserError(f"run config {config_file} is not a fine-tuning run's: {e}") from None


def choose(results: list[Result]) -> dict[str, dict[str, dict]]:
    """{model: {task: {"score": median at the best lr, "lr", "seeds", "per_lr": {lr: median}, "best_run": the run
    with the highest score at that lr}}}."""
    grouped: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in results:
        grouped[r.model][r.task][r.lr].append(r)
    table: dict = {}
    for model, tasks in grouped.items():
        table[model] = {}
        for task, per_lr in tasks.items():
            medians = {lr: statistics.median(r.score for r in runs) for lr, runs in per_lr.items()}
            lr = max(medians, key=medians.get)
            table[model][task] = {"score": medians[lr], "lr": lr, "seeds": len(per_lr[lr]), "per_lr": medians,
                                  "best_run": str(max(per_lr[lr], key=lambda r: r.score).run)}
    return table


def paper_app(model: str) -> str | None:
    """The paper row of a pre-training checkpoint of the paper's single-scale shape, if it is one."""
    if not Path(model).exists():
        return None
    checkpoint = Checkpoint.open(model)
    module = shipped_module(checkpoint.app_name)  # a name read from the run: only this code's apps are loaded
    name = short_name(module) if module else None
    single_scale = load_app(module).config("single_scale") if name in GLUE_FINETUNE else None
    if single_scale is None:
        return None
    paper = untrusted.read_yaml(single_scale, "config file")["model"]["encoder"]
    model_config = checkpoint.config.get("model")  # read from the file: any shape
    ours = model_config.get("encoder") if isinstance(model_config, dict) else None
    if not isinstance(ours, dict):
        raise UserError(f"checkpoint {checkpoint.path} has no model.encoder in its config")
    return name if all(ours.get(key) == paper[key] for key in ("dim", "n_layers", "n_heads")) else None


METRIC_NAMES = {"acc": "accuracy", "f1": "F1", "mcc": "Matthews correlation", "pearson": "Pearson correlation",
                "spearman": "Spearman correlation"}


def metric_names(tasks: list[str]) -> str:
    """How the tasks are scored (their headline metric, on dev), e.g. "Metrics (dev, in %): MNLI matched and RTE
    accuracy; CoLA Matthews correlation."."""
    by_metric: dict[str, list[str]] = {}
    for name in tasks:
        task = TASKS[name]
        label = f"{task.title} matched" if task.dev_file == "dev_matched" else task.title
        by_metric.setdefault(task.headline, []).append(label)
    groups = [(", ".join(labels[:-1]) + " and " if len(labels) > 1 else "") + f"{labels[-1]} {METRIC_NAMES[metric]}"
              for metric, labels in by_metric.items()]
    return "Metrics (dev, in %): " + "; ".join(groups) + "."


def format_table(table: dict) -> str:
    header = f"{'model':<28}" + "".join(f"{t.title:>6}" for t in TASKS.values()) + f"{'Avg.':>6}"
    lines = ["GLUE fine-tuning, dev: per task the median over seeds at the learning rate chosen on dev", header]
    for model, tasks in table.items():
        scores = [tasks[name]["score"] for name in TASKS if name in tasks]
        label = RunFolder.of(model).root.name
        cells = "".join(f"{tasks[name]['score']:>6.1f}" if name in tasks else f"{'-':>6}" for name in TASKS)
        partial = "*" if len(scores) < len(TASKS) else ""
        lines.append(f"{label[:27]:<28}{cells}{sum(scores) / len(scores):>6.1f}{partial}")
        lines.append(f"{'  learning rate':<28}" + "".join(
            f"{tasks[name]['lr']:>6.0e}" if name in tasks else f"{'':>6}" for name in TASKS))
        paper = paper_app(model)
        if paper is not None:
            published = dict(zip(TASKS, GLUE_FINETUNE[paper]))
            mean = sum(published[name] for name in tasks) / len(tasks)
            cells = "".join(f"{published[name]:>6.1f}" if name in tasks else f"{'-':>6}" for name in TASKS)
            lines.append(f"{'  paper: ' + NAMES[paper]:<28}{cells}{mean:>6.1f}{partial}")
    if any(len(tasks) < len(TASKS) for tasks in table.values()):
        lines.append("* the average of the tasks present, the paper's too (from its per-task numbers; its own average "
                     f"is over all {len(TASKS)})")
    lines.append(metric_names([name for name in TASKS if any(name in tasks for tasks in table.values())]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with command_line(__doc__):
        if not argv or argv[0] in ("--help", "-h"):
            print(__doc__)
            return
        folders = [Path(a) for a in argv]
        missing = [f for f in folders if not f.is_dir()]
        if missing:
            raise UserError(f"not a folder: {missing[0]}")
        results, unfinished = read_results(folders)
        if not results:
            raise UserError(f"no finished fine-tuning run (with a best.json) under {', '.join(map(str, folders))}")
        table = choose(results)
        text = format_table(table)
        if unfinished:
            text += f"\nnot finished yet ({len(unfinished)}): " + ", ".join(run.name for run in unfinished)
        atomic_write(folders[0] / "table.md", text + "\n")
        atomic_write(folders[0] / "table.json", json.dumps(table, indent=1) + "\n")
        print(text)


if __name__ == "__main__":
    main()
