"""Submitting jobs: what SLURM, or this machine through submitit's local executor, is asked for (`LauncherArgs`,
`executor_for`), the snapshot of the code a job runs in, and the job record (job.json) that says which job a
submission started. stool's runs and sweeps and the pipelines' stages are submitted through it."""

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lingua.errors import UserError, at_least, require
from lingua.files.safe import atomic_write, fsync_dir
from lingua.files.untrusted import read_json
from lingua.run_folder import JOB_RECORD

CODE_PACKAGES = ("lingua", "apps", "tools")  # copied whole (configs, data files) into each submission's code/HASH
CLUSTERS = ("slurm", "local")
JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")  # submitit's job ids: SLURM's (JOB_TASK in an array), a local job's pid


@dataclass
class LauncherArgs:
    script: str = ""  # the training module, e.g. apps.crossbert.train (run; a sweep file may set it per run)
    config: str = ""  # the run's base YAML config (run; a sweep file may set it per run)
    sweep: str = ""  # a sweep YAML file (sweep)
    pipeline: str = ""  # a pipeline YAML file (pipeline)
    cluster: str = "slurm"  # slurm | local: submitit's local executor, on this machine
    nodes: int = 1  # SLURM nodes per run
    gpus_per_node: int = 8  # also the tasks per node (one process per GPU); 0: a CPU job of one task
    cpus_per_task: int = 8  # CPU cores per task (data loading)
    mem_gb_per_task: int = 64  # host memory per task
    partition: str = ""  # SLURM partition (empty: the cluster's default)
    qos: str = ""  # SLURM quality of service
    account: str = ""  # SLURM account
    constraint: str = ""  # SLURM node constraint, e.g. a GPU model
    time: int = 720  # minutes before SLURM stops the job (a stopped run is requeued and resumes)
    signal_delay_s: int = 180  # the stop signal (lifecycle.stop_signal, SIGUSR2) comes this long before the limit
    array_parallelism: int = 256  # sweep runs at once on SLURM
    parallel: int = 1  # cluster=local: runs at once (stool waits for each wave)
    dry_run: bool = False  # print what would run, submit nothing (also --dry-run)

    def __post_init__(self):
        require(self.cluster in CLUSTERS, "cluster", f"must be one of {', '.join(CLUSTERS)}, got '{self.cluster}'")
        at_least(self, 1, "nodes", "cpus_per_task", "mem_gb_per_task", "time", "array_parallelism", "parallel")
        at_least(self, 0, "gpus_per_node", "signal_delay_s")


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(stool's key=value arguments, the rest: overrides of the training config)."""
    own = {f.name for f in dataclasses.fields(LauncherArgs)} | {"--help", "-h"}
    mine = ["dry_run=true" if arg == "--dry-run" else arg for arg in argv
            if arg == "--dry-run" or arg.partition("=")[0] in own]
    return mine, [arg for arg in argv if arg != "--dry-run" and arg.partition("=")[0] not in own]


def snapshot_code(parent: Path, source: Path | None = None) -> Path:
    """An immutable copy of every file of the code packages (not only *.py: configs and data files the code reads
    too) in parent/<hash of what it holds>, returned. It appears whole (copied aside, flushed, then renamed) and is
    never written again: a queued, running or requeued job keeps the code it was submitted with, whatever is
    submitted after it; submitting the same code again reuses it."""
    source = source or Path(__file__).resolve().parents[2]
    files = sorted(path.relative_to(source) for package in CODE_PACKAGES for path in (source / package).rglob("*")
                   if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc")
    contents = {path: (source / path).read_bytes() for path in files}  # read once: what is hashed is what is copied
    digest = hashlib.sha256()
    for path, data in contents.items():
        digest.update(f"{path.as_posix()}\0{len(data)}\0".encode() + data)
    destination = parent / digest.hexdigest()[:16]
    if destination.is_dir():
        return destination
    staging = parent / f".{destination.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    for path, data in contents.items():
        target = staging / path
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
            os.fsync(f.fileno())
        shutil.copymode(source / path, target)
    try:
        staging.rename(destination)
    except OSError:  # another submission made the same snapshot a moment ago
        shutil.rmtree(staging)
        if not destination.is_dir():
            raise
    fsync_dir(parent)
    return destination


def executor_for(args: LauncherArgs, folder: Path, code: Path, **sbatch_options: str):
    """submitit's executor for `args`; its SLURM jobs start in `code` (SLURM is told: a job, requeued ones too,
    never inherits the directory it was submitted from) with `sbatch_options` added."""
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster=args.cluster)
    tasks = max(args.gpus_per_node, 1) if args.cluster == "slurm" else 1
    params = {"timeout_min": args.time, "tasks_per_node": tasks, "nodes": args.nodes if args.cluster == "slurm" else 1,
              "cpus_per_task": args.cpus_per_task}
    if args.cluster == "slurm":
        params |= {"gpus_per_node": args.gpus_per_node} if args.gpus_per_node else {}
        params |= {"mem_gb": args.mem_gb_per_task * tasks,
                   "slurm_signal_delay_s": args.signal_delay_s, "slurm_array_parallelism": args.array_parallelism}
        params |= {f"slurm_{key}": getattr(args, key) for key in ("partition", "qos", "account", "constraint")
                   if getattr(args, key)}
        params |= {"slurm_additional_parameters": {"chdir": str(code), **sbatch_options}}
    executor.update_parameters(**params)
    return executor


@contextlib.contextmanager
def refused_by_slurm(consequence: str):
    """sbatch's refusal (a partition, memory or GPUs the cluster does not have) as one line: its reason and
    `consequence`, in place of submitit's traceback and its copy of sbatch's message."""
    from submitit.core.utils import FailedJobError

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    except FailedJobError as e:
        reason = "; ".join(line.removeprefix("sbatch: error: ") for line in str(e).splitlines() if line.strip())
        raise UserError(f"SLURM refused {consequence} ({reason})") from None


def write_job_record(folder: Path, job, code: Path, **fields: str) -> None:
    """folder/job.json: the submitted job's id and submitit folder, the code snapshot it runs, and `fields`."""
    atomic_write(folder / JOB_RECORD, json.dumps({"job_id": str(job.job_id), "folder": str(job.paths.folder),
                                                  **fields, "code": str(code)}))


def read_job_record(folder: Path) -> tuple[dict[str, Any] | None, str]:
    """(folder/job.json, the record stool wrote at submission, or None; why it is None when the file is there but
    unusable: not a JSON object, or no job id of submitit's form). Only its job id is trusted, never a path."""
    path = folder / JOB_RECORD
    if not path.exists():
        return None, ""
    try:
        record = read_json(path, "job record")
    except UserError:
        record = None
    if not isinstance(record, dict) or not JOB_ID.fullmatch(str(record.get("job_id", ""))):
        return None, f"unreadable job record ({path})"
    return {**record, "job_id": str(record["job_id"])}, ""
