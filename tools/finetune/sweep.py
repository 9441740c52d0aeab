"""The GLUE fine-tuning grid of one pre-trained model (task x learning rate x seed), through stool:

    python -m tools.finetune.sweep init_from=RUN dump_dir=SWEEP_DIR data=GLUE_DIR_OR_hf [tasks=rte,sst2]
        [lrs=1e-4,3e-5] [seeds=0,1,2] [epochs=3] [run_config=apps/finetune/configs/paper.yaml] [mnli_from=SWEEP_DIR]
        [run_overrides=KEY=VALUE,...] [cluster=slurm|local] [parallel=N] [gpus_per_node=1] [--dry-run] [any stool key]

Writes SWEEP_DIR/sweep.yaml (one run per task, learning rate and seed: SWEEP_DIR/<task>_lr<LR>_seed<S>) and runs
it with `python -m lingua.stool sweep` (on SLURM every run is its own job, so the tasks of a model train in
parallel). `mnli_from=SWEEP_DIR` starts RTE, MRPC and STS-B from the best MNLI run of that sweep (the RoBERTa
protocol); run the MNLI sweep first, and this one into another folder. Then `python -m tools.finetune.table DIR`
prints the table of every sweep below DIR.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from apps.finetune.train import FINETUNE
from lingua import stool
from lingua.args import command_line, load_config, parse_assignment
from lingua.errors import UserError
from lingua.eval.glue_data import TASKS
from lingua.files.safe import atomic_write
from lingua.jobs.launcher import split_arguments
from lingua.run_folder import RunFolder
from tools.finetune.table import choose, finetune_config, read_results

STARTED_FROM_MNLI = ("rte", "mrpc", "stsb")  # RoBERTa's and ModernBERT's protocol


@dataclass
class SweepArgs:
    init_from: str = ""  # the pre-trained run (any app's dump_dir or checkpoint)
    dump_dir: str = ""  # the sweep's folder
    data: str = ""  # a folder in the GLUE TSV layout, or hf
    run_config: str = "apps/finetune/configs/paper.yaml"  # every run's base config
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lrs: list[float] = field(default_factory=lambda: [1e-5, 2e-5, 3e-5])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    epochs: int = 0  # 0: the config's
    mnli_from: str = ""  # a sweep folder with MNLI runs: RTE, MRPC and STS-B start from its best one
    run_overrides: list[str] = field(default_factory=list)  # key=value settings of every run, e.g. data.seq_len=256


def sweep_spec(args: SweepArgs) -> dict:
    """The stool sweep file's content."""
    unknown = sorted(set(args.tasks) - set(TASKS))
    if unknown:
        raise UserError(f"unknown GLUE task '{unknown[0]}' (valid: {', '.join(TASKS)})")
    if not (args.init_from and args.dump_dir and args.data):
        raise UserError("init_from=, dump_dir= and data= are required: the pre-trained run, the sweep's folder and "
                        "the GLUE data (a folder or hf)")
    if not args.lrs or not args.seeds:
        raise UserError("lrs and seeds need at least one value each")
    mnli = best_mnli_run(Path(args.mnli_from)) if args.mnli_from else None
    from_mnli = {"init_from": str(mnli)} if mnli else {}
    runs = [{"name": f"{task}_lr{lr:g}_seed{seed}", "data.task": task, "optim.lr": lr, "seed": seed,
             **(from_mnli if task in STARTED_FROM_MNLI else {})}
            for task in args.tasks for lr in args.lrs for seed in args.seeds]
    overrides = {"init_from": args.init_from, "data.path": args.data,
                 **({"epochs": args.epochs} if args.epochs else {}), **dict(map(parse_assignment, args.run_overrides))}
    return {"script": FINETUNE, "config": args.run_config, "dump_dir": args.dump_dir, "overrides": overrides,
            "runs": runs,
            "launcher": {"gpus_per_node": 1, "time": 240}}  # one GPU per run


def best_mnli_run(folder: Path) -> Path:
    """best.pt of the MNLI run with the highest dev score at the learning rate chosen on dev (tools.finetune.table)."""
    finished, unfinished = read_results([folder])
    results = [r for r in finished if r.task == "mnli"]
    if any(finetune_config(RunFolder(run).config).data.task == "mnli" for run in unfinished):
        raise UserError(f"mnli_from: {folder} has MNLI runs that have not finished")
    if not results:
        raise UserError(f"mnli_from: no finished MNLI run under {folder}")
    if len({r.model for r in results}) > 1:
        raise UserError(f"mnli_from: {folder} holds MNLI runs of several pre-trained models")
    (tasks,) = choose(results).values()
    return RunFolder(Path(tasks["mnli"]["best_run"])).best_weights


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with command_line(__doc__):
        if "--help" in argv or "-h" in argv:
            load_config(SweepArgs, ["--help"])
        launcher, mine = split_arguments(argv)
        args = load_config(SweepArgs, mine)
        path = Path(args.dump_dir) / "sweep.yaml"
        atomic_write(path, yaml.safe_dump(sweep_spec(args), sort_keys=False))
        print(f"sweep file: {path}")
        stool.sweep_command([f"sweep={path}", *launcher])


if __name__ == "__main__":
    main()
