"""stool: launch training runs through submitit (SLURM, or this machine) and follow them.

    python -m lingua.stool run script=apps.crossbert.train config=PATH nodes=N gpus_per_node=G partition=P \\
        time=MINUTES [key=value ...]          # one run; any key stool does not know overrides the run's config
    python -m lingua.stool sweep sweep=SWEEP.yaml [cluster=local] [--dry-run]
    python -m lingua.stool pipeline pipeline=PIPELINE.yaml [cluster=local] [NAME=PATH ...] [--dry-run]
    python -m lingua.stool status SWEEP_PIPELINE_OR_DUMP_DIR

A run gets one task per GPU (lingua/distributed.py reads srun's variables), the stop signal `signal_delay_s` before
the time limit (the training loop saves a checkpoint and requeues the job, which resumes), its resolved config in
`dump_dir/submitted.yaml` (the job reads it; the run writes the config it derives and trains with to config.yaml).
Each submission snapshots the code (every file of the packages it imports) into `FOLDER/code/HASH` (FOLDER: the
run's dump_dir, or the sweep's), where its jobs run, requeued ones too: edits to the repository after submission
do not reach them. `cluster=local` runs the same jobs through
submitit's local executor, `parallel` at a time (stool waits for them).

A sweep file names the base config and the runs, each with its own dump_dir `<dump_dir>/<name>`, the name made of
the values it sets:

    script: apps.bert.train            # each run may set its own script and config
    config: apps/bert/configs/debug.yaml
    dump_dir: dump/sweeps/lr           # the sweep's folder
    overrides: {steps: 100}            # for every run
    grid: {optim.lr: [1e-3, 3e-3], data.batch_size: [8, 16]}   # every combination ...
    runs: [{model.mask_ratio: 0.3}, {model.mask_ratio: 0.5, name: half}]   # ... of each of these (default: one
                                       # empty run); `name` sets a run's folder
    launcher: {nodes: 1, gpus_per_node: 8, partition: learn, time: 720}   # stool's keys (command line wins)

A pipeline chains commands (training, evaluation, tables) into stages that start when the stages they need are
done: lingua/jobs/pipeline.py describes its file.
"""

import contextlib
import dataclasses
import itertools
import json
import os
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lingua.args import command_line, from_dict, load_config, parse_assignment, read_yaml, set_dotted
from lingua.errors import UserError
from lingua.files import untrusted
from lingua.files.safe import atomic_write, open_appending
from lingua.jobs import pipeline
from lingua.jobs.launcher import (
    LauncherArgs,
    executor_for,
    refused_by_slurm,
    snapshot_code,
    split_arguments,
    write_job_record,
)
from lingua.jobs.status import describe, format_status, is_folder_name, status_rows
from lingua.run_folder import CODE, LOCAL_CONTROLLERS_LOG, PIPELINE_RECORD, SUBMITIT, SWEEP_RECORD, RunFolder

PATH_KEYS = ("dump_dir", "data.root_dir", "data.path", "data.tokenizer.path", "init_from", "continue_from",
             "eval.data")  # made absolute


@dataclass
class PlannedRun:
    name: str
    script: str
    dump_dir: Path
    config: dict[str, Any]  # the resolved training config (a nested dict)
    overrides: dict[str, Any]  # what the run sets over its base config (dotted keys)
    base_config: str = ""  # the base YAML, if any


def resolve_config(script: str, config_path: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The training config of `script` from its YAML and dotted overrides, checked by the app's own dataclass (a
    mistake fails here, before anything is submitted), with its paths made absolute (the job runs elsewhere)."""
    from lingua.app import load_app  # imported here: an app brings torch, which pipelines and status do without

    app = load_app(script)
    tree = read_yaml(config_path) if config_path else {}
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    tree = dataclasses.asdict(from_dict(app.args_cls, tree))
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.get(part, {})
        value = node.get(leaf)
        if value and value != "hf":
            node[leaf] = str(Path(value).expanduser().resolve())
    return tree


def _yaml_value(value: Any) -> str:
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix(
        "\n...")


def plan_sweep(sweep_file: str) -> tuple[Path, list[PlannedRun], dict[str, Any]]:
    """(the sweep's folder, its runs, its launcher section) from a sweep YAML file."""
    spec = read_yaml(sweep_file)
    unknown = sorted(set(spec) - {"script", "config", "dump_dir", "overrides", "grid", "runs", "launcher"})
    if unknown:
        raise UserError(f"sweep file {sweep_file}: unknown key '{unknown[0]}'")
    if not spec.get("dump_dir"):
        raise UserError(f"sweep file {sweep_file} names no dump_dir (the sweep's folder)")
    grid = spec.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise UserError(f"sweep file {sweep_file}: grid must map each key to a non-empty list of values")
    runs = spec.get("runs") or [{}]
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise UserError(f"sweep file {sweep_file}: runs must be a list of mappings of key: value")
    settings = [{**run, **dict(zip(grid, values))} for run in runs for values in itertools.product(*grid.values())]
    root = Path(spec["dump_dir"]).expanduser().resolve()
    named = [setting.pop("name", None) for setting in settings]
    planned, names = [], [given or made for given, made in zip(named, run_names(settings))]
    if not all(map(is_folder_name, names)):
        raise UserError(f"sweep file {sweep_file}: run name '{next(n for n in names if not is_folder_name(n))}' is "
                        "not a folder name (no /, not . or ..)")
    if len(set(names)) < len(names):
        raise UserError(f"sweep file {sweep_file}: two runs are named {max(names, key=names.count)}")
    for name, setting in zip(names, settings):
        setting = dict(setting)
        script = setting.pop("script", spec.get("script"))
        config = setting.pop("config", spec.get("config", ""))
        if not script:
            raise UserError(f"sweep file {sweep_file}: run {name} has no script")
        overrides = {**(spec.get("overrides") or {}), **setting, "dump_dir": str(root / name), "name": name}
        planned.append(PlannedRun(name, script, root / name, resolve_config(script, config, overrides), overrides,
                                  config))
    return root, planned, spec.get("launcher") or {}


def run_names(settings: list[dict[str, Any]]) -> list[str]:
    """A folder name per run from the values that differ between runs: `lr0.003_batch_size16`; keys by their last
    part unless two share it; the app for `script`. Unique: a clash gets the run's index."""
    varying = [key for key in dict.fromkeys(k for s in settings for k in s)
               if len({json.dumps(s.get(key), sort_keys=True) for s in settings}) > 1]
    leaves = [key.split(".")[-1] for key in varying]
    labels = {key: (leaf if leaves.count(leaf) == 1 else key.replace(".", "-")) for key, leaf in zip(varying, leaves)}
    names = []
    for i, setting in enumerate(settings):
        parts = [_name_part(labels[key], setting.get(key)) for key in varying]
        name = "_".join(parts) or "run"
        names.append(name if name not in names else f"{name}_{i}")
    return names


def _name_part(label: str, value: Any) -> str:
    if label == "script" and isinstance(value, str):
        return value.split(".")[-2] if value.count(".") >= 2 else value
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return label + "".join(c if c.isalnum() or c in ".-+" else "-" for c in text)


# ------------------------------------------------------------------------------------------------ submission


def prepare(run: PlannedRun) -> None:
    """The run's dump_dir and the config stool resolved (submitted.yaml); refuses a config other than
    the one submitted there before (nothing is lost). A run may derive its config.yaml from it (fine-tuning: its
    steps from epochs), so submitting the same run again compares what was submitted, not what the run wrote."""
    run.dump_dir.mkdir(parents=True, exist_ok=True)
    submitted = RunFolder(run.dump_dir).submitted
    if submitted.exists() and untrusted.read_yaml(submitted, "submitted config") != run.config:
        raise UserError(f"{run.dump_dir} already holds a run submitted with another config: use another dump_dir")
    atomic_write(submitted, yaml.safe_dump(run.config, sort_keys=False))


def train_job(script: str, config_file: str) -> None:
    """What a job runs, in the run's code folder (its working directory): the app's training, in-process. It returns
    nothing, so that submitit's result file holds plain data that status reads without running code."""
    from lingua.app import load_app
    from lingua.train import train

    app = load_app(script)
    train(app, load_config(app.args_cls, [f"config={config_file}"]))


def submit(runs: list[PlannedRun], args: LauncherArgs, folder: Path) -> None:
    """Prepares every run and snapshots the code once (folder/code/HASH), then submits them: one SLURM job array, or
    local waves of `parallel` runs."""
    for run in runs:
        prepare(run)
    code = snapshot_code(folder / CODE)
    executor = executor_for(args, folder / SUBMITIT, code)
    if args.cluster == "slurm":
        with refused_by_slurm(f"the job of {len(runs)} run(s): nothing was submitted"), executor.batch():
            jobs = [_submit_one(executor, run, code) for run in runs]
        for run, job in zip(runs, jobs):
            _record(run, job, code)
        return
    failed = []
    for start in range(0, len(runs), args.parallel):
        jobs: list = []
        with _cancelled_when_interrupted(jobs):
            with _stderr_into(folder / SUBMITIT / LOCAL_CONTROLLERS_LOG):
                wave = [(run, _submit_one(executor, run, code)) for run in runs[start:start + args.parallel]]
            jobs += [job for _, job in wave]
            for run, job in wave:
                _record(run, job, code)
            for run, job in wave:
                job.wait()
                info = describe(run.dump_dir)
                print(f"{run.name}: {info['state']}" + (f" ({info['reason']})" if info["reason"] else ""))
                failed += [run.name] if info["state"] == "failed" else []
    if failed:  # the others ran: a script that runs stool stops here rather than go on without these results
        raise UserError(f"{len(failed)} of {len(runs)} local run(s) failed ({', '.join(failed)}): "
                        f"python -m lingua.stool status {folder} tells why")


@contextlib.contextmanager
def _stderr_into(path: Path):
    """Processes started inside write their stderr into `path`, never through a link: submitit's local job
    controllers, which print a KeyboardInterrupt traceback when their job is cancelled or the terminal's Ctrl-C
    reaches them (stool then prints one line; their jobs' own output goes to their log files)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open_appending(path)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        log.close()


class _Terminated(Exception):
    """SIGTERM to a waiting stool."""


@contextlib.contextmanager
def _cancelled_when_interrupted(jobs: list):
    """submitit's local jobs outlive the process that started them: if stool is stopped while it waits (Ctrl-C,
    SIGTERM), it cancels them (a checkpoint is saved when there is time) and waits until their processes are gone.
    submitit cancels a local job with SIGINT, which a process started with SIGINT ignored (as a shell's background
    job is) would ignore too: the jobs are started with a handler in place, which they do not inherit as ignored."""
    def terminate(signum, frame):
        raise _Terminated

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, terminate),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    try:
        yield
    except (KeyboardInterrupt, _Terminated):
        for job in jobs:
            job.cancel()
        for job in jobs:
            job.wait()
        raise UserError(f"stopped: {len(jobs)} local job(s) cancelled; the same command resumes them") from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _submit_one(executor, run: PlannedRun, code: Path):
    with contextlib.chdir(code):  # submitit's local jobs start where they are submitted from
        return executor.submit(train_job, run.script, str(RunFolder(run.dump_dir).submitted))


def _record(run: PlannedRun, job, code: Path) -> None:
    """Where status finds the job (job.json), and the code it runs."""
    write_job_record(run.dump_dir, job, code, script=run.script)
    print(f"submitted {run.name}: job {job.job_id}, dump_dir {run.dump_dir}")


# ------------------------------------------------------------------------------------------------ commands


def run_command(argv: list[str]) -> None:
    mine, overrides = split_arguments(argv)
    args = load_config(LauncherArgs, mine)
    if not args.script:
        raise UserError("run needs script=MODULE (e.g. apps.crossbert.train)")
    settings = dict(map(parse_assignment, overrides))
    config = resolve_config(args.script, args.config, settings)
    run = PlannedRun(Path(config["dump_dir"]).name, args.script, Path(config["dump_dir"]), config, settings,
                     args.config)
    _launch([run], args, run.dump_dir)


def sweep_command(argv: list[str]) -> None:
    mine, extra = split_arguments(argv)
    if extra:
        raise UserError(f"unknown key '{extra[0].partition('=')[0]}' (a sweep's config changes go in its file)")
    cli = load_config(LauncherArgs, mine)
    if not cli.sweep:
        raise UserError("sweep needs sweep=FILE.yaml")
    root, runs, launcher = plan_sweep(cli.sweep)
    args = load_config(LauncherArgs, mine, base=launcher)  # the command line wins over the file
    if not args.dry_run:
        root.mkdir(parents=True, exist_ok=True)
        atomic_write(root / SWEEP_RECORD, json.dumps({"sweep": str(Path(cli.sweep).resolve()),
                                                       "runs": [run.name for run in runs]}))
    _launch(runs, args, root)


def _launch(runs: list[PlannedRun], args: LauncherArgs, folder: Path) -> None:
    if args.dry_run:
        where = (f"slurm: {args.nodes} node(s) x {args.gpus_per_node} GPU(s), {args.time} min"
                 if args.cluster == "slurm" else "local: 1 process")
        for run in runs:
            settings = shlex.join([f"config={run.base_config}"] * bool(run.base_config) + [
                f"{key}={_yaml_value(value)}" for key, value in run.overrides.items()])  # pasteable into a shell
            print(f"{run.name} ({where}): python -m {run.script} {settings}")
        print(f"dry run: {len(runs)} run(s), nothing submitted")
        return
    submit(runs, args, folder)


COMMANDS = {"run": run_command, "sweep": sweep_command}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    with command_line(__doc__):
        if not argv or argv[0] in ("--help", "-h"):
            load_config(LauncherArgs, ["--help"])
        command, rest = argv[0], argv[1:]
        if command == "status":
            if len(rest) != 1 or rest[0].startswith("-"):
                raise UserError("usage: python -m lingua.stool status SWEEP_PIPELINE_OR_DUMP_DIR")
            folder = Path(rest[0])
            if (folder / PIPELINE_RECORD).exists():
                print(pipeline.format_status(folder))
            else:
                print(format_status(status_rows(folder)))
        elif command == "pipeline":
            pipeline.pipeline_command(rest)
        elif command in COMMANDS:
            COMMANDS[command](rest)
        else:
            raise UserError(f"unknown command '{command}' (run, sweep, pipeline or status)")


if __name__ == "__main__":
    main()
