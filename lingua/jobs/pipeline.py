"""Pipelines: the stages behind one of the paper's tables, each a command, run when the stages it needs are done.

    python -m lingua.stool pipeline pipeline=FILE.yaml [cluster=slurm|local] [NAME=PATH ...] [--dry-run]
    python -m lingua.stool status PIPELINE_DIR

A pipeline file:

    dump_dir: dump/pipelines/table3          # the pipeline's folder: {dir} in the commands
    paths: {glue: ../shared/data/glue}       # {glue} in the commands, made absolute; NAME=PATH on the command line
    variants:                                # a stage whose command names {variant} or a variant's key runs once
      bert: {app: bert}                      # per variant, as STAGE.VARIANT, with the variant's keys filled in
      crossbert: {app: crossbert}
    launcher: {gpus_per_node: 1, time: 240}  # stool's keys, for every stage (a stage's own launcher wins; its
                                             # values may name a variant's keys too: nodes: "{nodes}")
    stages:
      pretrain:
        run: apps.{app}.train config=apps/{app}/configs/debug.yaml dump_dir={dir}/{variant}/pretrain
        launcher: {nodes: 4, gpus_per_node: 8, time: 1440}
      probes:
        after: [pretrain]                    # the same variant's stage; from a stage run once: every variant's
        run: tools.eval.glue ckpt={dir}/{variant}/pretrain data={glue} out={dir}/{variant}/probes

`run` is a Python module and its key=value arguments (`python -m` runs it, in the snapshot of the code made when the
stage was launched, DIR/code/HASH), split into arguments as a shell would before the values are filled in: a value
(a path with a space, say) stays inside its argument. Stage and variant names are letters, digits, _ and -. On
`local` the stages run one after the other on this machine, each as one process; on `slurm` every stage is a job
(its launcher's nodes and GPUs, one task per GPU) that SLURM starts once the jobs of the stages it needs have
succeeded, and never if one failed or was cancelled (a stage's job fails when the stage did). Each stage's record is
in DIR/stages/STAGE/: log.txt, then done.json or failed.json, naming the command. Running the pipeline again skips
the stages that are done (and on SLURM those still in its hands: queued, running, requeued), and runs again a failed
or interrupted one: a training run resumes from its checkpoint. A stage that received a stop signal is not done,
whatever its exit code; on SLURM a preemption signal (the time limit's) requeues its job. A stage whose command
changed since it was done, queued or started is refused in one line. A local stage records its host and processes,
so that another host or a later boot does not take it for running or gone wrongly.

The file is read by lingua/jobs/pipeline_plan.py, a stage runs and leaves its records through
lingua/jobs/pipeline_stage.py; this file launches a pipeline (local or SLURM) and shows its plan and status.
"""

import json
import re
import shlex
import socket
import time
from pathlib import Path

from lingua.args import load_config
from lingua.errors import UserError
from lingua.files.safe import atomic_write
from lingua.jobs.launcher import (
    LauncherArgs,
    executor_for,
    read_job_record,
    refused_by_slurm,
    snapshot_code,
    split_arguments,
    write_job_record,
)
from lingua.jobs.pipeline_plan import NAME, Pipeline, Stage, load_pipeline
from lingua.jobs.pipeline_stage import read_json, run_stage, stage_dir, stage_job, state_of
from lingua.run_folder import CODE, JOB_RECORD, PIPELINE_RECORD, STAGE_DONE, STAGE_FAILED, STAGE_STARTED, SUBMITIT

STAGE_NAME = re.compile(rf"{NAME.pattern}(\.{NAME.pattern})?")  # STAGE or STAGE.VARIANT: DIR/stages/STAGE.VARIANT


# ------------------------------------------------------------------------------------------------ running


def launch(pipeline: Pipeline, launcher_argv: list[str]) -> None:
    """Runs (local) or submits (slurm) the stages not done, in a snapshot of the code made for this launch (the
    stages queued or running before keep theirs); `launcher_argv`: stool's keys from the command line. A stage whose
    line changed since it was done, queued or started is refused before anything is written."""
    args = load_config(LauncherArgs, launcher_argv)
    if args.dry_run:
        print(format_plan(pipeline, launcher_argv))
        return
    _refuse_changed_stages(pipeline)
    pipeline.dump_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(pipeline.dump_dir / PIPELINE_RECORD, json.dumps(pipeline.record(), indent=1))
    code = snapshot_code(pipeline.dump_dir / CODE)
    if args.cluster == "local":
        run_local(pipeline, code)
    else:
        submit_slurm(pipeline, launcher_argv, code)


def _refuse_changed_stages(pipeline: Pipeline) -> None:
    states: dict[str, str] = {}
    for stage in pipeline.stages:
        states[stage.name] = state_of(pipeline.dump_dir, stage, states)
        if states[stage.name] == "changed":
            folder = stage_dir(pipeline.dump_dir, stage.name)
            raise UserError(f"stage {stage.name} was run with another command ({_recorded_line(folder)}); to run "
                            f"`{stage.line}` instead, stop its job if it has one and remove {folder} (and what it "
                            "wrote)")


def _recorded_line(folder: Path) -> str:
    for name in (STAGE_DONE, JOB_RECORD, STAGE_STARTED):
        record = read_json(folder / name)
        if record is not None and "line" in record:
            return record["line"]
    return "unknown"


def run_local(pipeline: Pipeline, code: Path) -> None:
    """The stages in order, on this machine; a failed stage's dependents are not started, the others are."""
    states: dict[str, str] = {}
    for stage in pipeline.stages:
        state = state_of(pipeline.dump_dir, stage, states)
        if state != "done" and any(states[need] != "done" for need in stage.after):
            state = "blocked"
        elif state in ("running", "submitted"):
            raise UserError(f"stage {stage.name} is {state} elsewhere ({_where(pipeline.dump_dir, stage)}): wait for "
                            "it, or stop it")
        elif state != "done":  # pending, or failed before: run it (again)
            folder = stage_dir(pipeline.dump_dir, stage.name)
            print(f"[{time.strftime('%H:%M:%S')}] {stage.name}: started, log {folder / 'log.txt'}", flush=True)
            if run_stage(str(folder), stage, str(code)) in ("stopped", "preempted"):
                raise UserError(f"stopped during {stage.name}: the same command goes on from there")
            state = state_of(pipeline.dump_dir, stage, states)
        states[stage.name] = state
        print(f"[{time.strftime('%H:%M:%S')}] {stage.name}: {_describe(pipeline.dump_dir, stage, state)}", flush=True)
    failed = [name for name, state in states.items() if state == "failed"]
    if failed:
        blocked = [name for name, state in states.items() if state == "blocked"]
        raise UserError(f"{len(failed)} stage(s) failed: " + "; ".join(
            f"{name} (log {stage_dir(pipeline.dump_dir, name) / 'log.txt'})" for name in failed)
            + (f"; not started: {', '.join(blocked)}" if blocked else ""))


def _where(dump_dir: Path, stage: Stage) -> str:
    folder = stage_dir(dump_dir, stage.name)
    job, _ = read_job_record(folder)
    if job is not None:
        return f"SLURM job {job['job_id']}"
    started = read_json(folder / STAGE_STARTED) or {}
    group, host = started.get("group"), started.get("host", socket.gethostname())
    if host != socket.gethostname():
        return (f"on host {host}, process group {group}; if that host is gone, remove "
                f"{folder / STAGE_STARTED}")
    return f"process group {group}: kill -- -{group}"


def submit_slurm(pipeline: Pipeline, launcher_argv: list[str], code: Path) -> None:
    """One job per stage not done, each depending on the jobs of the stages it needs (afterok); SLURM cancels the
    dependents of a failed one. Stages already in SLURM's hands (queued, running, requeued) keep their jobs."""
    job_ids: dict[str, str] = {}
    for stage in pipeline.stages:
        state = state_of(pipeline.dump_dir, stage, {})
        folder = stage_dir(pipeline.dump_dir, stage.name)
        if state == "done":
            continue
        job, _ = read_job_record(folder)
        if state in ("submitted", "running") and job is not None:
            job_ids[stage.name] = job["job_id"]
            print(f"{stage.name}: job {job_ids[stage.name]} already {state}")
            continue
        waits = [job_ids[need] for need in stage.after if need in job_ids]
        dependency = {"dependency": "afterok:" + ":".join(waits)} if waits else {}
        executor = executor_for(stage_launcher(launcher_argv, stage), pipeline.dump_dir / SUBMITIT, code,
                                **{"kill-on-invalid-dep": "yes", **dependency})
        executor.update_parameters(slurm_job_name=stage.name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STAGE_FAILED).unlink(missing_ok=True)  # submitted again: queued, no longer failed
        with refused_by_slurm(f"the job of stage {stage.name}; the stages before it are submitted, and once "
                              "this is fixed the same command submits the others"):
            job = executor.submit(stage_job, str(folder), stage, str(code))
        job_ids[stage.name] = str(job.job_id)
        write_job_record(folder, job, code, line=stage.line)
        print(f"{stage.name}: submitted job {job.job_id}" + (f", after {', '.join(waits)}" if waits else ""))
    print(f"python -m lingua.stool status {pipeline.dump_dir} follows them")


def stage_launcher(launcher_argv: list[str], stage: Stage) -> LauncherArgs:
    """A stage's launcher: its own keys over the file's, the command line's over both (as in stool's sweeps)."""
    return load_config(LauncherArgs, launcher_argv, base=stage.launcher)


# ------------------------------------------------------------------------------------------------ views


def _describe(dump_dir: Path, stage: Stage, state: str) -> str:
    folder = stage_dir(dump_dir, stage.name)
    if state == "done":
        seconds = (read_json(folder / STAGE_DONE) or {}).get("seconds")
        return f"done ({seconds / 60:.1f} min)" if isinstance(seconds, (int, float)) else "done"
    if state == "failed":
        failure = read_json(folder / STAGE_FAILED) or {}
        return (f"failed (exit {failure.get('code', '?')}: {failure.get('reason', 'unreadable failed.json')}); "
                f"log {folder / 'log.txt'}")
    if state == "blocked":
        return "not started: a stage it needs did not finish"
    if state == "changed":
        return f"run with another command ({_recorded_line(folder)})"
    return state


def format_plan(pipeline: Pipeline, launcher_argv: list[str]) -> str:
    lines, states = [], {}
    for stage in pipeline.stages:
        states[stage.name] = state = state_of(pipeline.dump_dir, stage, states)
        launcher = stage_launcher(launcher_argv, stage)
        where = (f"slurm: {launcher.nodes} node(s) x {launcher.gpus_per_node} GPU(s), {launcher.time} min"
                 if launcher.cluster == "slurm" else "local")
        after = f", after {', '.join(stage.after)}" if stage.after else ""
        lines.append(f"{stage.name} [{state}] ({where}{after}): python -m {stage.module} {shlex.join(stage.args)}")
    return "\n".join(lines + [f"dry run: {len(pipeline.stages)} stage(s), nothing started"])


def recorded_stages(dump_dir: Path) -> list[Stage]:
    """The stages of DIR/pipeline.json; a record that is not one (a name that is not a stage's, a field missing or of
    another type) is refused in one line."""
    path = dump_dir / PIPELINE_RECORD
    try:
        stages = [Stage(**stage) for stage in (read_json(path) or {})["stages"]]
    except (KeyError, TypeError):
        stages = []
    if not stages or not all(_is_stage(stage) for stage in stages):
        raise UserError(f"{path} is not a pipeline record (stages with names, modules, arguments and needs)")
    return stages


def _is_stage(stage: Stage) -> bool:
    lists = isinstance(stage.args, list) and isinstance(stage.after, list)
    return (lists and all(isinstance(text, str) for text in [stage.name, stage.module, *stage.args, *stage.after])
            and STAGE_NAME.fullmatch(stage.name) is not None and isinstance(stage.launcher, dict))


def format_status(dump_dir: Path) -> str:
    stages = recorded_stages(dump_dir)
    width = max(len("stage"), *(len(stage.name) for stage in stages))
    lines, states = [f"{'stage'.ljust(width)}  state"], {}
    for stage in stages:
        states[stage.name] = state = state_of(dump_dir, stage, states)
        lines.append(f"{stage.name.ljust(width)}  {_describe(dump_dir, stage, state)}")
    done = sum(state == "done" for state in states.values())
    return "\n".join(lines + [f"{done} of {len(stages)} stage(s) done"])


def pipeline_command(argv: list[str]) -> None:
    mine, extra = split_arguments(argv)
    args = load_config(LauncherArgs, mine)
    if not args.pipeline:
        raise UserError("pipeline needs pipeline=FILE.yaml")
    bad = [arg for arg in extra if "=" not in arg]
    if bad:
        raise UserError(f"expected NAME=PATH (one of the pipeline's paths, or dump_dir), got '{bad[0]}'")
    launch(load_pipeline(args.pipeline, dict(arg.split("=", 1) for arg in extra)), mine)
