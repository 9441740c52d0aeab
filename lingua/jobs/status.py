"""The status of stool's runs: a run's state, last step and losses, and why it failed, from its dump_dir alone
(metrics.jsonl, config.yaml, job.json and submitit's result file, read as plain data so that reading runs no code),
one row per run of a sweep. It only reads folders, whoever wrote them, and submits nothing.
"""

import pickle
import re
from pathlib import Path
from typing import Any

from lingua.errors import UserError
from lingua.files.untrusted import read_json, read_yaml
from lingua.jobs.launcher import read_job_record
from lingua.run_folder import SUBMITIT, SWEEP_RECORD, RunFolder


def describe(dump_dir: Path) -> dict[str, Any]:
    """A run's state (missing, pending, running, finished, failed), its reason, last step, loss and val loss, from
    its dump_dir alone (metrics.jsonl, config.yaml, job.json and submitit's result file). What cannot be read (a
    damaged or hand-made file) is the row's reason, never an error."""
    from lingua.metrics import read_metrics  # imported here: it brings torch, which stool's commands do without

    info = {"state": "missing", "reason": "", "step": None, "loss": None, "val_loss": None}
    if not dump_dir.is_dir():
        return info
    run = RunFolder(dump_dir)
    config = _read_yaml_mapping(run.config)
    steps = config.get("steps") if isinstance(config.get("steps"), int) else None
    for record in read_metrics(run.metrics) if run.metrics.is_file() else []:
        if isinstance(record, dict):
            info["step"] = record["step"] if isinstance(record.get("step"), int) else info["step"]
            info["loss"] = record.get("loss", info["loss"])
            info["val_loss"] = record.get("val/loss", info["val_loss"])
    outcome, reason = job_outcome(dump_dir)
    if outcome == "error":
        info["state"], info["reason"] = "failed", reason
        return info
    info["reason"] = reason  # why the job's outcome is unknown, if it is
    if steps is not None and info["step"] is not None and info["step"] >= steps:
        info["state"] = "finished"
    elif outcome == "success" and not _newer_log(dump_dir):
        info["state"], info["reason"] = "stopped", "the job ended before the last step (a stop signal: resubmit)"
    else:
        info["state"] = "running" if run.log.exists() else "pending"
    return info


def _read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file's mapping; {} when it is absent, not a mapping or does not parse."""
    try:
        return read_yaml(path, "run config") if path.is_file() else {}
    except UserError:
        return {}


def _newer_log(dump_dir: Path) -> bool:
    """A requeued job writes its log after the result file of its previous attempt."""
    job, _ = read_job_record(dump_dir)
    results, log = _result_files(dump_dir, job["job_id"]) if job else [], RunFolder(dump_dir).log
    return bool(results) and log.exists() and log.stat().st_mtime > max(r.stat().st_mtime for r in results)


def submitit_folder(dump_dir: Path) -> Path:
    """The submitit folder stool chose for the run's job: its sweep's for a run of a sweep, its own otherwise. It is
    derived from where the run is, never read from a file of the run."""
    return dump_dir.parent / SUBMITIT if (dump_dir.parent / SWEEP_RECORD).exists() else dump_dir / SUBMITIT


def _result_files(dump_dir: Path, job_id: str) -> list[Path]:
    """submitit's result files of the job (one per task, by task), in the run's submitit folder: plain files, a link
    (which could lead anywhere) ignored."""
    names = re.compile(re.escape(job_id) + r"_([0-9]+)_result\.pkl")
    found = [(int(match[1]), path) for path in submitit_folder(dump_dir).glob(f"{job_id}_*_result.pkl")
             if (match := names.fullmatch(path.name)) and path.is_file() and not path.is_symlink()]
    return [path for _, path in sorted(found)]


class _CodeInPickle(pickle.UnpicklingError):
    """A pickle that names a global: loading it would call code."""


class _PlainData(pickle.Unpickler):
    """Loads plain data only (str, bytes, numbers, None, tuples, lists, dicts, sets): a pickle builds any other object
    by calling a global it names, and every global is refused, so loading runs no code."""

    def find_class(self, module: str, name: str):
        raise _CodeInPickle(f"it names {f'{module}.{name}'!r}")  # quoted: the names are the pickle's, any text


def job_outcome(dump_dir: Path) -> tuple[str | None, str]:
    """('success' | 'error' | None, the error's last line, or why the outcome is unknown) from submitit's result
    file of the run's job (a pickle: ("success", None) or ("error", the traceback)), read as plain data."""
    job, problem = read_job_record(dump_dir)
    results = _result_files(dump_dir, job["job_id"]) if job else []
    if not results:
        return None, problem
    try:
        with open(results[0], "rb") as f:
            result = _PlainData(f).load()
    except _CodeInPickle as e:
        return None, f"job result {results[0]} refused: {e}"
    except Exception:  # a truncated or garbled pickle fails in many ways (EOF, bad opcodes, bad lengths)
        result = None
    if not (isinstance(result, tuple) and len(result) == 2 and result[0] in ("success", "error")):
        return None, f"unreadable job result ({results[0]})"
    outcome, value = result
    if outcome == "success":
        return "success", ""
    lines = [line for line in value.strip().splitlines() if line.strip()] if isinstance(value, str) else []
    return "error", lines[-1].strip() if lines else "unknown error"


def status_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, describe()) of each run of a sweep folder (sweep.json), or of one dump_dir."""
    if (path / SWEEP_RECORD).exists():
        return [(name, describe(path / name)) for name in sweep_runs(path)]
    if not path.exists():
        raise UserError(f"{path} does not exist")
    return [(path.name, describe(path))]


def sweep_runs(folder: Path) -> list[str]:
    """The run names of a sweep's sweep.json, each a folder directly inside the sweep's."""
    path = folder / SWEEP_RECORD
    try:
        runs = read_json(path, "sweep record").get("runs")
    except UserError:
        runs = None
    if not isinstance(runs, list) or not all(map(is_folder_name, runs)):
        raise UserError(f"{path} is not a sweep record (a JSON object whose runs are names of folders in it)")
    return runs


def is_folder_name(name: Any) -> bool:
    """Whether `name` names a folder directly inside another (printable, no separator, not . or ..)."""
    return isinstance(name, str) and name.isprintable() and name not in ("", ".", "..") and "/" not in name


def format_status(rows: list[tuple[str, dict[str, Any]]]) -> str:
    width = max(len("run"), *(len(name) for name, _ in rows))
    lines = [f"{'run'.ljust(width)}  {'state':9} {'step':>7} {'loss':>8} {'val loss':>9}  reason"]
    for name, info in rows:
        cells = [f"{info[k]:.4f}" if isinstance(info[k], float) else "-" for k in ("loss", "val_loss")]
        step = "-" if info["step"] is None else str(info["step"])
        lines.append(f"{name.ljust(width)}  {info['state']:9} {step:>7} {cells[0]:>8} {cells[1]:>9}  {info['reason']}")
    return "\n".join(lines)
