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
"""

import dataclasses
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lingua.args import UserError, load_config, read_yaml
from lingua.files import atomic_write
from lingua.launcher import (
    LauncherArgs,
    executor_for,
    read_job_record,
    refused_by_slurm,
    snapshot_code,
    split_arguments,
    write_job_record,
)
from lingua.lifecycle import boot_id, process_start
from lingua.run_folder import CODE, JOB_RECORD, SUBMITIT

FORWARDED_SIGNALS = (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)  # a scheduler's stop signals
PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGUSR1)  # the time limit's warning, a preemption: the job goes back
# in the queue; SIGTERM and SIGINT (scancel, a shutdown) end it
FINAL_SLURM_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                      "DEADLINE")  # any other state (PENDING, REQUEUED, PREEMPTED, UNKNOWN while sacct lags ...) is
# still in the scheduler's hands
NAME = re.compile(r"[A-Za-z0-9_-]+")  # a stage's or a variant's: in a folder's name and a job's
STAGE_NAME = re.compile(rf"{NAME.pattern}(\.{NAME.pattern})?")  # STAGE or STAGE.VARIANT: DIR/stages/STAGE.VARIANT


class StageNotDone(Exception):
    """Ends a stage's SLURM job with a non-zero exit, so that SLURM does not start the stages that need it."""


@dataclass
class Stage:
    name: str  # STAGE, or STAGE.VARIANT
    module: str
    args: list[str]
    after: list[str]  # the names of the stages it needs
    launcher: dict[str, Any] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args]

    @property
    def line(self) -> str:
        """What the stage runs, as its records name it: a stage whose line changed is another stage."""
        return shlex.join([self.module, *self.args])


@dataclass
class Pipeline:
    dump_dir: Path
    stages: list[Stage]  # in an order where every stage comes after those it needs
    variants: dict[str, dict[str, Any]]
    paths: dict[str, str]
    source: str

    def record(self) -> dict[str, Any]:
        return {"source": self.source, "dump_dir": str(self.dump_dir), "paths": self.paths, "variants": self.variants,
                "stages": [dataclasses.asdict(stage) for stage in self.stages]}


# ------------------------------------------------------------------------------------------------ the plan


def load_pipeline(path: str, paths: dict[str, str] | None = None) -> Pipeline:
    """The pipeline of a file, its stages expanded per variant, checked, and ordered by their dependencies."""
    spec = read_yaml(path)
    unknown = sorted(set(spec) - {"dump_dir", "paths", "variants", "launcher", "stages"})
    if unknown:
        raise UserError(f"pipeline {path}: unknown key '{unknown[0]}'")
    if not spec.get("dump_dir") or not isinstance(spec.get("stages"), dict) or not spec["stages"]:
        raise UserError(f"pipeline {path} needs a dump_dir and stages (a mapping of stage names to stages)")
    if not all(isinstance(v, dict) for v in (spec.get("variants") or {}).values()):
        raise UserError(f"pipeline {path}: variants must map each variant's name to its keys ({{app: bert}})")
    given = {**(spec.get("paths") or {}), **(paths or {})}
    extra = sorted(set(paths or {}) - set(spec.get("paths") or {}) - {"dump_dir"})
    if extra:
        raise UserError(f"pipeline {path} has no path '{extra[0]}' (its paths: "
                        f"{', '.join(['dump_dir', *(spec.get('paths') or {})])})")
    resolved = {name: str(Path(str(value)).expanduser().resolve()) for name, value in given.items()}
    dump_dir = Path(resolved.pop("dump_dir", spec["dump_dir"])).expanduser().resolve()
    variants = spec.get("variants") or {}
    bad = [(what, name) for what, names in (("stage", spec["stages"]), ("variant", variants)) for name in names
           if not (isinstance(name, str) and NAME.fullmatch(name))]
    if bad:
        raise UserError(f"pipeline {path}: {bad[0][0]} {bad[0][1]!r} is not a name (letters, digits, _ and -)")
    stages = _expand(path, spec["stages"], variants, {**resolved, "dir": str(dump_dir)}, spec.get("launcher") or {})
    return Pipeline(dump_dir, _ordered(path, stages), variants, resolved, str(Path(path).resolve()))


def _expand(path: str, specs: dict, variants: dict, names: dict[str, str], launcher: dict) -> list[Stage]:
    keys = {"variant", *(key for fields in variants.values() for key in fields)}
    per_variant = {name for name, s in specs.items()
                   if any(f"{{{key}}}" in str((s or {}).get("run", "")) for key in keys)}
    stages = []
    for name, stage_spec in specs.items():
        stage_spec = stage_spec or {}
        unknown = sorted(set(stage_spec) - {"run", "after", "launcher"})
        if unknown or not stage_spec.get("run"):
            raise UserError(f"pipeline {path}: stage {name} " + (f"has an unknown key '{unknown[0]}'" if unknown
                                                                   else "has no run (a module and its arguments)"))
        after = stage_spec.get("after") or []
        if not isinstance(after, list) or not all(isinstance(need, str) for need in after):
            raise UserError(f"pipeline {path}: stage {name}'s after must be a list of stage names")
        missing = [need for need in after if need.split(".")[0] not in specs]
        if missing:
            raise UserError(f"pipeline {path}: stage {name} comes after '{missing[0]}', which is not a stage")
        for variant in (variants if name in per_variant else [""]):
            values = {**names, **({"variant": variant, **variants[variant]} if variant else {})}
            try:
                module, *args = [word.format_map(values) for word in shlex.split(str(stage_spec["run"]))]
                launch = {key: value.format_map(values) if isinstance(value, str) else value
                          for key, value in {**launcher, **(stage_spec.get("launcher") or {})}.items()}
            except KeyError as e:
                where = f"variant {variant}" if variant else "the pipeline's paths"
                raise UserError(f"pipeline {path}: stage {name} uses {{{e.args[0]}}}, which {where} does not "
                                "define") from None
            except (ValueError, IndexError) as e:  # a lone brace, {0}, an unclosed quote
                raise UserError(f"pipeline {path}: stage {name}'s run cannot be read ({e}); a literal brace is "
                                "written {{ or }}") from None
            needs = _needs(after, variant, per_variant, variants)
            stages.append(Stage(f"{name}.{variant}" if variant else name, module, args, needs, launch))
    return stages


def _needs(after: list[str], variant: str, per_variant: set[str], variants: dict) -> list[str]:
    """The stages named by `after`: a per-variant stage is the same variant's, or every variant's from a stage
    run once; STAGE.VARIANT names one."""
    needs = []
    for need in after:
        if "." in need or need not in per_variant:
            needs.append(need)
        else:
            needs += [f"{need}.{variant}"] if variant else [f"{need}.{v}" for v in variants]
    return needs


def _ordered(path: str, stages: list[Stage]) -> list[Stage]:
    """The stages in the file's order, each moved after the stages it needs; a cycle is refused."""
    by_name = {stage.name: stage for stage in stages}
    unknown = [(s.name, need) for s in stages for need in s.after if need not in by_name]
    if unknown:
        raise UserError(f"pipeline {path}: stage {unknown[0][0]} comes after {unknown[0][1]}, which is not a stage")
    ordered: list[Stage] = []
    visiting: set[str] = set()

    def visit(stage: Stage) -> None:
        if stage in ordered:
            return
        if stage.name in visiting:
            raise UserError(f"pipeline {path}: stage {stage.name} depends on itself (through its after)")
        visiting.add(stage.name)
        for need in stage.after:
            visit(by_name[need])
        ordered.append(stage)

    for stage in stages:
        visit(stage)
    return ordered


# ------------------------------------------------------------------------------------------------ one stage


def stage_dir(dump_dir: Path, name: str) -> Path:
    return dump_dir / "stages" / name


def run_stage(folder: str, stage: Stage, code: str) -> str:
    """Runs a stage's command in `code` with its output in folder/log.txt (a SLURM task other than the first: its own
    log) and, from the first task, records the outcome: done.json on exit 0, failed.json with the log's last line
    otherwise, both naming the stage's line. A stop signal is passed on to the command; a stage that got one is not
    done. Returns "done", "failed", "preempted" (a preemption signal) or "stopped" (another stop signal)."""
    folder_path, rank = Path(folder), int(os.environ.get("SLURM_PROCID", "0"))
    folder_path.mkdir(parents=True, exist_ok=True)
    log = folder_path / ("log.txt" if rank == 0 else f"log.task{rank}.txt")
    if rank == 0:
        (folder_path / "failed.json").unlink(missing_ok=True)
    received: list[int] = []
    start = time.time()
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(stage.command())}\n".encode())
        out.flush()
        process = subprocess.Popen(stage.command(), cwd=code, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        if rank == 0:  # the command's process group outlives a runner killed with SIGKILL: it is recorded too
            atomic_write(folder_path / "started.json", json.dumps({**this_process(process.pid), "line": stage.line}))

        def forward(signum, frame):
            received.append(signum)
            process.send_signal(signum)

        previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
        try:
            exit_code = process.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            _stop(process)
            if rank == 0:
                (folder_path / "started.json").unlink(missing_ok=True)
    if received:  # neither done nor failed: the next run of the pipeline runs it again
        return "preempted" if set(received) & set(PREEMPTION_SIGNALS) else "stopped"
    outcome = "done" if exit_code == 0 else "failed"
    if rank == 0 and outcome == "done":
        atomic_write(folder_path / "done.json", json.dumps({"seconds": time.time() - start, "line": stage.line}))
    elif rank == 0:
        atomic_write(folder_path / "failed.json", json.dumps({"code": exit_code, "reason": last_line(log),
                                                              "line": stage.line}))
    return outcome


def stage_job(folder: str, stage: Stage, code: str) -> None:
    """A stage's SLURM job. Its exit status is the stage's, so that SLURM starts the stages that need it only when it
    is done (afterok) and cancels them when it failed; a preempted stage puts its job back in the queue (a training
    run resumes), its dependents waiting."""
    outcome = run_stage(folder, stage, code)
    if outcome == "done":
        return
    if outcome == "preempted" and int(os.environ.get("SLURM_PROCID", "0")) == 0:
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
    raise StageNotDone(f"stage {stage.name}: {outcome}")


def this_process(group: int) -> dict[str, Any]:
    """What tells a stage's runner and its command's process group apart from any other process, later and from
    another host: the host, its boot, the pid and when it started, the group and when its leader started."""
    return {"host": socket.gethostname(), "boot": boot_id(), "pid": os.getpid(),
            "pid_start": process_start(os.getpid()), "group": group, "group_start": process_start(group)}


def _stop(process: subprocess.Popen) -> None:
    """The command's whole process group (it may have started workers): asked to stop, then killed."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        deadline = time.time() + 30
        while time.time() < deadline:
            process.poll()  # reaps the leader
            if not _group_running(process.pid):
                return
            time.sleep(0.2)


def _group_running(group: int) -> bool:
    """Whether a process of the group runs; a zombie does not (in a container nothing may ever reap one)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return _exists(os.killpg, group)
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if int(pgrp) == group and state != "Z":
            return True
    return False


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def state_of(dump_dir: Path, stage: Stage, states: dict[str, str]) -> str:
    """done | changed (done, or queued or running, with another line) | failed | blocked (a stage it needs failed) |
    running | submitted (queued on SLURM) | pending, from the stage's record; `states` holds those of the stages
    before it."""
    folder = stage_dir(dump_dir, stage.name)
    done = _read_json(folder / "done.json")
    if done is not None:
        return "done" if done.get("line", stage.line) == stage.line else "changed"
    if (folder / "failed.json").exists():
        return "failed"
    if any(states.get(need) in ("failed", "blocked") for need in stage.after):
        return "blocked"
    job, _ = read_job_record(folder)
    started = _read_json(folder / "started.json")
    if job is not None:
        if not _slurm_job_active(dump_dir, job["job_id"]):
            return "pending"  # its job ended without an outcome (killed, timed out): it runs again
        state = "running" if started is not None else "submitted"
    elif _alive(started):
        state, job = "running", started
    else:
        return "pending"
    return state if job.get("line", stage.line) == stage.line else "changed"


def _read_json(path: Path) -> dict[str, Any] | None:
    """A stage's record (a JSON object), or None: absent, or not one (half-written by hand, say)."""
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _alive(started: dict[str, Any] | None) -> bool:
    """Whether the process that runs a local stage, or its command's process group, still runs. One on another host
    counts as running (this host cannot see it); a record from before this host's last boot, or whose pids now
    belong to processes that started at another time, does not."""
    if started is None:
        return False
    if started.get("host", socket.gethostname()) != socket.gethostname():
        return True
    if started.get("boot", boot_id()) != boot_id():
        return False
    pid, group = started.get("pid"), started.get("group")
    if pid and process_start(pid) is not None and started.get("pid_start") == process_start(pid):
        return True
    leader = process_start(group) if group else None  # None: the leader is gone, its group may live on
    return bool(group and leader in (None, started.get("group_start")) and _group_running(group))


def _exists(kill, target: int) -> bool:
    try:
        kill(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True


def _slurm_job_active(dump_dir: Path, job_id: str) -> bool:
    """Whether SLURM still holds the job (of the pipeline's submitit folder, not one a record names)."""
    import submitit

    state = submitit.SlurmJob(dump_dir / SUBMITIT, job_id).state  # "CANCELLED by 0": the first word
    return (state.split() or ["UNKNOWN"])[0] not in FINAL_SLURM_STATES


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
    atomic_write(pipeline.dump_dir / "pipeline.json", json.dumps(pipeline.record(), indent=1))
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
    for name in ("done.json", JOB_RECORD, "started.json"):
        record = _read_json(folder / name)
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
    started = _read_json(folder / "started.json") or {}
    group, host = started.get("group"), started.get("host", socket.gethostname())
    if host != socket.gethostname():
        return (f"on host {host}, process group {group}; if that host is gone, remove "
                f"{folder / 'started.json'}")
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
        (folder / "failed.json").unlink(missing_ok=True)  # submitted again: queued, no longer failed
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
        seconds = (_read_json(folder / "done.json") or {}).get("seconds")
        return f"done ({seconds / 60:.1f} min)" if isinstance(seconds, (int, float)) else "done"
    if state == "failed":
        failure = _read_json(folder / "failed.json") or {}
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
    path = dump_dir / "pipeline.json"
    try:
        stages = [Stage(**stage) for stage in (_read_json(path) or {})["stages"]]
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
