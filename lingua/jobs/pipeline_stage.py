"""One stage of a pipeline: running its command (a stop signal passed on, its process group stopped after it), its
records in DIR/stages/STAGE/ (log.txt, started.json, done.json, failed.json) and its state read back from them, for
a stage run on this host, on another, or by SLURM.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from lingua.errors import UserError
from lingua.files import untrusted
from lingua.files.safe import atomic_write, open_appending
from lingua.host import boot_id, process_start
from lingua.jobs.launcher import read_job_record
from lingua.jobs.pipeline_plan import Stage
from lingua.run_folder import STAGE_DONE, STAGE_FAILED, STAGE_STARTED, STAGES, SUBMITIT

FORWARDED_SIGNALS = (signal.SIGUSR2, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)  # a scheduler's stop signals
PREEMPTION_SIGNALS = (signal.SIGUSR2, signal.SIGUSR1)  # the time limit's warning, a preemption: the job goes back
# in the queue; SIGTERM and SIGINT (scancel, a shutdown) end it
FINAL_SLURM_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                      "DEADLINE")  # any other state (PENDING, REQUEUED, PREEMPTED, UNKNOWN while sacct lags ...) is
# still in the scheduler's hands


class StageNotDone(Exception):
    """Ends a stage's SLURM job with a non-zero exit, so that SLURM does not start the stages that need it."""


def stage_dir(dump_dir: Path, name: str) -> Path:
    return dump_dir / STAGES / name


def run_stage(folder: str, stage: Stage, code: str) -> str:
    """Runs a stage's command in `code` with its output in folder/log.txt (a SLURM task other than the first: its own
    log) and, from the first task, records the outcome: done.json on exit 0, failed.json with the log's last line
    otherwise, both naming the stage's line. A stop signal is passed on to the command; a stage that got one is not
    done. Returns "done", "failed", "preempted" (a preemption signal) or "stopped" (another stop signal)."""
    folder_path, rank = Path(folder), int(os.environ.get("SLURM_PROCID", "0"))
    folder_path.mkdir(parents=True, exist_ok=True)
    log = folder_path / ("log.txt" if rank == 0 else f"log.task{rank}.txt")
    if rank == 0:
        (folder_path / STAGE_FAILED).unlink(missing_ok=True)
    received: list[int] = []
    start = time.time()
    try:
        out = open_appending(log, binary=True)  # a received pipeline folder may hold a link there
    except OSError as e:
        raise UserError(f"cannot write {log}: {e.strerror}") from None
    with out:
        out.write(f"$ {shlex.join(stage.command())}\n".encode())
        out.flush()
        process: subprocess.Popen | None = None

        def forward(signum, frame):
            received.append(signum)
            if process is not None:
                process.send_signal(signum)

        # in place before the command starts and before started.json says so: a stop never finds the default action
        previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
        try:
            process = subprocess.Popen(stage.command(), cwd=code, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            if received:  # it came while the command started
                process.send_signal(received[-1])
            if rank == 0:  # the command's process group outlives a runner killed with SIGKILL: it is recorded too
                atomic_write(folder_path / STAGE_STARTED, json.dumps({**this_process(process.pid), "line": stage.line}))
            exit_code = process.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if process is not None:
                _stop(process)
            if rank == 0:
                (folder_path / STAGE_STARTED).unlink(missing_ok=True)
    if received:  # neither done nor failed: the next run of the pipeline runs it again
        return "preempted" if set(received) & set(PREEMPTION_SIGNALS) else "stopped"
    outcome = "done" if exit_code == 0 else "failed"
    if rank == 0 and outcome == "done":
        atomic_write(folder_path / STAGE_DONE, json.dumps({"seconds": time.time() - start, "line": stage.line}))
    elif rank == 0:
        atomic_write(folder_path / STAGE_FAILED, json.dumps({"code": exit_code, "reason": last_line(log),
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
    done = read_json(folder / STAGE_DONE)
    if done is not None:
        return "done" if done.get("line", stage.line) == stage.line else "changed"
    if (folder / STAGE_FAILED).exists():
        return "failed"
    if any(states.get(need) in ("failed", "blocked") for need in stage.after):
        return "blocked"
    job, _ = read_job_record(folder)
    started = read_json(folder / STAGE_STARTED)
    if job is not None:
        if not slurm_job_active(dump_dir, job["job_id"]):
            return "pending"  # its job ended without an outcome (killed, timed out): it runs again
        state = "running" if started is not None else "submitted"
    elif _alive(started):
        state, job = "running", started
    else:
        return "pending"
    return state if job.get("line", stage.line) == stage.line else "changed"


def read_json(path: Path) -> dict[str, Any] | None:
    """A stage's record (a JSON object), or None: absent, or not one (half-written by hand, say)."""
    try:
        return untrusted.read_json(path, "stage record")
    except UserError:
        return None


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


def slurm_job_active(dump_dir: Path, job_id: str) -> bool:
    """Whether SLURM still holds the job (of the pipeline's submitit folder, not one a record names)."""
    import submitit

    state = submitit.SlurmJob(dump_dir / SUBMITIT, job_id).state  # "CANCELLED by 0": the first word
    return (state.split() or ["UNKNOWN"])[0] not in FINAL_SLURM_STATES
