"""stool: sweep expansion and naming, dry runs, the code snapshot, a local two-run sweep through submitit, status."""

import dataclasses
import json
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, end, start, tagged_processes, tiny_argv

from apps.bert.train import BertTrainArgs
from lingua import stool
from lingua.args import load_config
from lingua.errors import UserError
from lingua.jobs.launcher import CODE_PACKAGES, LauncherArgs, executor_for, snapshot_code


def write_sweep(tmp_path, corpus, **extra) -> Path:
    overrides = dict(arg.split("=", 1) for arg in tiny_argv(corpus, tmp_path / "unused", 4)[1:])
    spec = {"script": "apps.bert.train", "dump_dir": str(tmp_path / "sweep"), "overrides": overrides,
            "grid": {"optim.lr": [1e-3, 3e-3]}, "launcher": {"cluster": "local"}, **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_names_come_from_the_values_that_differ():
    settings = [{"optim.lr": 1e-3, "data.batch_size": 8, "steps": 5}, {"optim.lr": 3e-3, "data.batch_size": 8,
                                                                        "steps": 5}]
    assert stool.run_names(settings) == ["lr0.001", "lr0.003"]
    clash = [{"model.encoder.dim": 64, "model.predictor.dim": 32}, {"model.encoder.dim": 128,
                                                                    "model.predictor.dim": 64}]
    assert stool.run_names(clash) == ["model-encoder-dim64_model-predictor-dim32",
                                      "model-encoder-dim128_model-predictor-dim64"]
    apps = [{"script": "apps.bert.train", "optim.lr": 1e-3}, {"script": "apps.crossbert.train", "optim.lr": 1e-3}]
    assert stool.run_names(apps) == ["bert", "crossbert"]
    assert stool.run_names([{}, {}]) == ["run", "run_1"]


def test_sweep_expands_runs_times_grid(tmp_path, corpus):
    path = write_sweep(tmp_path, corpus, runs=[{"script": "apps.bert.train"}, {"script": "apps.crossbert.train"}])
    root, runs, launcher = stool.plan_sweep(str(path))
    assert [run.name for run in runs] == ["bert_lr0.001", "bert_lr0.003", "crossbert_lr0.001", "crossbert_lr0.003"]
    assert {run.dump_dir for run in runs} == {root / run.name for run in runs}
    assert runs[3].config["optim"]["lr"] == 3e-3 and runs[3].config["model"]["cms"] is True
    assert runs[0].config["data"]["root_dir"] == str(corpus.resolve())  # paths made absolute for the job
    assert launcher == {"cluster": "local"}


def test_a_run_may_name_itself_but_names_stay_unique(tmp_path, corpus):
    path = write_sweep(tmp_path, corpus, runs=[{"name": "small"}, {}], grid={"optim.lr": [1e-3]})
    assert [run.name for run in stool.plan_sweep(str(path))[1]] == ["small", "run_1"]
    path = write_sweep(tmp_path, corpus, runs=[{"name": "same"}, {"name": "same"}], grid={"optim.lr": [1e-3]})
    with pytest.raises(UserError, match="two runs are named same"):
        stool.plan_sweep(str(path))


@pytest.mark.parametrize("change,message", [
    ({"grid": {"optim.lr": []}}, "non-empty list"),
    ({"bogus": 1}, "unknown key 'bogus'"),
    ({"overrides": {"optim.lrr": 1}}, "unknown config key 'optim.lrr'"),
    ({"script": "apps.nothing.train"}, "not a module"),
])
def test_bad_sweeps_fail_before_anything_is_submitted(tmp_path, corpus, change, message):
    path = write_sweep(tmp_path, corpus, **change)
    with pytest.raises(UserError, match=message):
        stool.plan_sweep(str(path))
    assert not (tmp_path / "sweep").exists()


def test_dry_run_prints_and_writes_nothing(tmp_path, corpus, capsys):
    stool.main(["sweep", f"sweep={write_sweep(tmp_path, corpus, config='apps/bert/configs/debug.yaml')}", "--dry-run"])
    out = capsys.readouterr().out
    assert "lr0.001 (local: 1 process): python -m apps.bert.train config=apps/bert/configs/debug.yaml" in out
    assert "optim.lr=0.003" in out
    assert "2 run(s), nothing submitted" in out
    assert not (tmp_path / "sweep").exists()


def test_a_dry_run_prints_commands_a_shell_can_run(tmp_path, corpus, capsys):
    path = write_sweep(tmp_path, corpus, grid={"optim.lr": [1e-3]},
                       runs=[{"data.sources": {"a b": 1.0, "c": 3.0}}])  # a mapping, with a space
    stool.main(["sweep", f"sweep={path}", "--dry-run"])
    words = shlex.split(capsys.readouterr().out.splitlines()[0].partition("): ")[2])
    assert words[:3] == ["python", "-m", "apps.bert.train"]
    args = load_config(BertTrainArgs, words[3:])
    assert args.data.sources == {"a b": 1.0, "c": 3.0}


def test_snapshot_holds_everything_the_run_imports(tmp_path):
    code = snapshot_code(tmp_path / "code")
    probe = ("import sys, apps.crossbert.train, tools.eval.glue, lingua.stool; "
             "print('\\n'.join(m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)))")
    files = subprocess.run([sys.executable, "-c", probe], cwd=code, capture_output=True, text=True,
                           check=True).stdout.split()
    ours = [f for f in files if "/lingua/" in f or "/apps/" in f]
    assert ours and all(Path(f).is_relative_to(code) for f in ours)
    assert (code / "apps/crossbert/configs/debug.yaml").exists()  # not only *.py


def test_a_snapshot_is_never_rewritten_and_the_same_code_shares_one(tmp_path):
    """A queued or requeued job keeps the code it was submitted with: a later submission of changed code (an edited
    module, a deleted one) gets a folder of its own."""
    source = tmp_path / "repo"
    for package in CODE_PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    first = snapshot_code(tmp_path / "code", source)
    assert snapshot_code(tmp_path / "code", source) == first
    (source / "lingua" / "model" / "flops.py").write_text("raise SystemExit('edited')\n")
    (source / "lingua" / "training" / "divergence.py").unlink()
    second = snapshot_code(tmp_path / "code", source)
    assert second != first and sorted(p.name for p in (tmp_path / "code").iterdir()) == sorted([first.name,
                                                                                               second.name])
    flops, divergence = Path("lingua", "model", "flops.py"), Path("lingua", "training", "divergence.py")
    assert (first / flops).read_bytes() == (REPO / flops).read_bytes()
    assert (first / divergence).exists() and not (second / divergence).exists()


def test_local_sweep_runs_end_to_end_and_status_reads_it(tmp_path, corpus, capsys):
    stool.main(["sweep", f"sweep={write_sweep(tmp_path, corpus)}"])
    root = tmp_path / "sweep"
    for name in ("lr0.001", "lr0.003"):
        run = root / name
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert metrics[-1]["step"] == 4 and len(list(root.glob("code/*/lingua/train.py"))) == 1
        assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] in (1e-3, 3e-3)
    capsys.readouterr()
    stool.main(["status", str(root)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines[1:]] == [["lr0.001", "finished", "4"], ["lr0.003", "finished", "4"]]


def test_a_local_sweep_with_a_failed_run_runs_the_others_and_says_so(tmp_path, corpus, capsys):
    path = write_sweep(tmp_path, corpus, grid={"data.root_dir": [str(corpus), str(tmp_path / "nowhere")]})
    with pytest.raises(SystemExit) as exit_status:
        stool.main(["sweep", f"sweep={path}"])
    out, err = capsys.readouterr()
    assert exit_status.value.code == 2 and "1 of 2 local run(s) failed" in err
    assert "finished" in out and "failed (" in out  # the failed run's reason is printed where it ends


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_stopped_local_sweep_leaves_no_job_running_and_says_so_in_one_line(tmp_path, corpus, how):
    """submitit's local jobs outlive the stool that started them: a SIGTERM to stool, or Ctrl-C (which reaches the
    terminal's whole process group, submitit's local job controllers too, whose tracebacks went to the terminal
    before stool's line), cancels them and prints stool's line alone."""
    overrides = dict(arg.split("=", 1) for arg in tiny_argv(corpus, tmp_path / "unused", 100_000)[1:])
    sweep = write_sweep(tmp_path, corpus, overrides=overrides, launcher={"cluster": "local", "parallel": 2})
    proc = start([sys.executable, "-m", "lingua.stool", "sweep", f"sweep={sweep}"], stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        runs = [tmp_path / "sweep" / name / "metrics.jsonl" for name in ("lr0.001", "lr0.003")]
        while time.time() < deadline and not all(path.exists() for path in runs):
            time.sleep(0.2)
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)  # as the terminal sends it
        _, err = proc.communicate(timeout=60)
        deadline = time.time() + 10  # a job killed by its controller a moment ago may still be dying
        while tagged_processes(proc.tag) and time.time() < deadline:
            time.sleep(0.1)
        left = tagged_processes(proc.tag)
    finally:
        end(proc)
    assert all(path.exists() for path in runs)
    assert proc.returncode == 2 and err == "error: stopped: 2 local job(s) cancelled; the same command resumes them\n"
    assert left == []


def test_status_tells_failed_missing_and_pending_runs(tmp_path, capsys):
    root = tmp_path / "sweep"
    (root / "failed").mkdir(parents=True)
    (root / "pending").mkdir()
    (root / "sweep.json").write_text(json.dumps({"runs": ["failed", "pending", "missing"]}))
    (root / "failed/config.yaml").write_text("steps: 10\n")
    (root / "failed/metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 2.5}) + "\n")
    (root / "failed/train.log").write_text("")
    (root / "submitit").mkdir()  # the sweep's, where stool's jobs write their results
    with open(root / "submitit/7_0_result.pkl", "wb") as f:
        pickle.dump(("error", "Traceback ...\nlingua.args.UserError: data folder not found"), f)
    (root / "failed/job.json").write_text(json.dumps({"job_id": "7", "folder": str(root / "failed"),
                                                      "script": "apps.bert.train"}))
    (root / "pending/job.json").write_text(json.dumps({"job_id": "8", "folder": str(root / "pending"),
                                                       "script": "apps.bert.train"}))
    stool.main(["status", str(root)])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["failed"].split()[1:4] == ["failed", "3", "2.5000"] and "data folder not found" in rows["failed"]
    assert rows["pending"].split()[1] == "pending" and rows["missing"].split()[1] == "missing"


def test_stool_answers_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        stool.main(["run", "--help"])
    assert exit_.value.code == 0 and "gpus_per_node: int = 8" in capsys.readouterr().out


def test_run_command_dry_run_takes_config_overrides(tmp_path, corpus, capsys):
    argv = ["run", "script=apps.crossbert.train", "nodes=2", "gpus_per_node=8", "partition=learn", "time=60",
            "--dry-run", *tiny_argv(corpus, tmp_path / "one", 4)]
    stool.main(argv)
    out = capsys.readouterr().out
    assert "one (slurm: 2 node(s) x 8 GPU(s), 60 min): python -m apps.crossbert.train" in out
    assert "model.encoder.dim=32" in out and not (tmp_path / "one").exists()


def test_slurm_jobs_get_one_task_per_gpu_and_the_stop_signal_before_the_limit(tmp_path, monkeypatch):
    from submitit.slurm.slurm import SlurmExecutor

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # no srun on this machine
    args = LauncherArgs(nodes=2, gpus_per_node=4, partition="learn", time=90, signal_delay_s=120,
                              account="team")
    executor = executor_for(args, tmp_path, tmp_path / "code")
    script = executor._executor._make_submission_file_text("python -m x", "ID")
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=learn", "--time=90",
                 "--signal=USR2@120", "--account=team", f"--chdir={tmp_path / 'code'}"):
        assert f"#SBATCH {line}" in script, line


def test_a_run_submitted_again_is_compared_with_what_was_submitted_not_what_it_derived(tmp_path):
    """A fine-tuning run writes to config.yaml the steps it derives from its epochs: submitting the same run again
    (a pipeline re-run) goes on, another config is refused."""
    run = stool.PlannedRun("r", "apps.bert.train", tmp_path / "r", {"steps": 0, "epochs": 2}, {})
    stool.prepare(run)
    (run.dump_dir / "config.yaml").write_text(yaml.safe_dump({"steps": 124, "epochs": 2}))
    stool.prepare(run)
    assert yaml.safe_load((run.dump_dir / "submitted.yaml").read_text()) == {"steps": 0, "epochs": 2}
    with pytest.raises(UserError, match="already holds a run submitted with another config"):
        stool.prepare(stool.PlannedRun("r", "apps.bert.train", tmp_path / "r", {"steps": 0, "epochs": 3}, {}))


def test_run_takes_the_runs_base_config_as_config(tmp_path, corpus, capsys):
    """`config=PATH` is the run's base config, as documented, not a file of stool's own keys."""
    stool.main(["run", "script=apps.bert.train", "config=apps/bert/configs/debug.yaml", "gpus_per_node=1",
                "--dry-run", *tiny_argv(corpus, tmp_path / "one", 4)])
    assert "python -m apps.bert.train config=apps/bert/configs/debug.yaml dump_dir=" in capsys.readouterr().out


def test_no_apps_config_key_is_taken_by_stool():
    """stool routes its own keys to itself and the rest to the run: a run's top-level key of the same name could
    never be set."""
    from apps import registered_apps

    own = {field.name for field in dataclasses.fields(LauncherArgs)}
    for app in registered_apps():
        assert not own & {field.name for field in dataclasses.fields(app.args_cls)}, app.name


class _WritesAFile:
    """A pickled object whose loading runs a shell command."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.path))}",)


def test_status_runs_no_code_and_reads_only_the_runs_own_folder(tmp_path, capsys):
    """A run folder from anyone: a result pickle that would run code, a job.json that points elsewhere or names no
    folder, a truncated pickle, a JSON array in metrics.jsonl. Nothing runs; each run is a row, with a reason where
    its outcome cannot be read."""
    root, marker = tmp_path / "sweep", tmp_path / "code_ran"
    runs = {"evil": "7", "elsewhere": "8", "bad_id": "../../elsewhere/9", "truncated": "10", "no_folder": "11",
            "array_line": "12"}
    (root / "submitit").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "sweep.json").write_text(json.dumps({"runs": list(runs)}))
    for name, job_id in runs.items():
        (root / name).mkdir()
        (root / name / "config.yaml").write_text("steps: 10\n")
        record = {"job_id": job_id, "folder": str(tmp_path / "elsewhere"), "script": "apps.bert.train"}
        (root / name / "job.json").write_text(json.dumps(record if name != "no_folder" else {"job_id": job_id}))
    with open(root / "submitit/7_0_result.pkl", "wb") as f:
        pickle.dump(("success", _WritesAFile(marker)), f)
    for job_id in ("8", "9"):  # where the job.json points: never read
        with open(tmp_path / "elsewhere" / f"{job_id}_0_result.pkl", "wb") as f:
            pickle.dump(("success", _WritesAFile(marker)), f)
    whole = pickle.dumps(("error", "Traceback ...\nValueError: the last line"))
    (root / "submitit/10_0_result.pkl").write_bytes(whole[:len(whole) // 2])
    (root / "submitit/11_0_result.pkl").write_bytes(whole)
    (root / "array_line" / "metrics.jsonl").write_text('[1, 2]\n{"step": 4, "loss": 2.5}\n')

    stool.main(["status", str(root)])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert not marker.exists()
    assert rows["evil"].split()[1] == "pending" and "7_0_result.pkl refused: it names 'posix.system'" in rows["evil"]
    assert rows["elsewhere"].split()[1:] == ["pending", "-", "-", "-"]
    assert "unreadable job record" in rows["bad_id"] and "unreadable job result" in rows["truncated"]
    assert rows["no_folder"].split()[1] == "failed" and rows["no_folder"].endswith("ValueError: the last line")
    assert rows["array_line"].split()[1:4] == ["pending", "4", "2.5000"]


def test_a_dump_dir_s_status_reads_its_own_submitit_folder(tmp_path, capsys):
    """`stool run`'s layout: the job's results in DUMP_DIR/submitit."""
    dump = tmp_path / "run"
    (dump / "submitit").mkdir(parents=True)
    (dump / "job.json").write_text(json.dumps({"job_id": "5"}))
    with open(dump / "submitit/5_0_result.pkl", "wb") as f:
        pickle.dump(("error", "Traceback ...\nRuntimeError: out of memory"), f)
    stool.main(["status", str(dump)])
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["run", "failed"]


@pytest.mark.parametrize("record", ['{"runs": ["../outside"]}', '{"runs": ["a\\nb"]}', '{"runs": "one"}', "[1]",
                                    '{"runs": ["a"'])
def test_a_sweep_record_that_is_not_one_is_refused_in_one_line(tmp_path, capsys, record):
    (tmp_path / "sweep.json").write_text(record)
    with pytest.raises(SystemExit) as exit_status:
        stool.main(["status", str(tmp_path)])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'sweep.json'} is not a sweep record (a JSON object whose " \
                                      "runs are names of folders in it)\n"


def test_a_run_named_outside_the_sweep_folder_is_refused(tmp_path, corpus):
    path = write_sweep(tmp_path, corpus, runs=[{"name": "../outside"}], grid={"optim.lr": [1e-3]})
    with pytest.raises(UserError, match="run name '../outside' is not a folder name"):
        stool.plan_sweep(str(path))


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_link_or_fifo_at_the_local_controllers_log_is_refused_in_one_line(tmp_path, corpus, capsys, planted):
    """A link there was a bare OSError traceback; a FIFO blocked stool for ever."""
    log = tmp_path / "sweep" / stool.SUBMITIT / stool.LOCAL_CONTROLLERS_LOG
    log.parent.mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("someone's file\n")
    log.symlink_to(outside) if planted == "link" else os.mkfifo(log)
    with pytest.raises(SystemExit) as exit_status:
        stool.main(["sweep", f"sweep={write_sweep(tmp_path, corpus)}"])
    err = capsys.readouterr().err
    reason = "a symbolic link, which the library never writes through" if planted == "link" else \
        "not a regular file, so the library does not write to it"
    assert exit_status.value.code == 2 and err.startswith(f"error: cannot write {log}: {reason}"), err
    assert len(err.splitlines()) == 1 and outside.read_text() == "someone's file\n"
