"""stool and pipelines against a real SLURM (tests/slurm_cluster.py: slurmctld, accounting, two nodes with two
stand-in GPUs each): runs with their base config, in the code they were submitted with; sweeps as job arrays and
their status; one task, two tasks, two nodes; the preemption signal, a save, a requeue and an exact resume; pipelines
chained by afterok, a failed or cancelled stage whose dependents never run, a preempted stage requeued, and re-runs
that submit nothing twice."""

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, end, read_metrics, start, tiny_argv

from lingua.jobs.launcher import CODE_PACKAGES

SMALL_JOB = ["cpus_per_task=1", "mem_gb_per_task=1", "time=10"]


def stool(cluster, *args: str, cwd: Path = REPO, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "lingua.stool", *args], cwd=cwd, env=cluster.env,
                            capture_output=True, text=True, timeout=180)
    assert not check or result.returncode == 0, result.stderr
    return result


def run_argv(corpus: Path, dump_dir: Path, steps: int) -> list[str]:
    """The tiny model over the debug config (which names other sources: replaced, not added to)."""
    return ["config=apps/bert/configs/debug.yaml", "data.sources={tiny: 1.0}",
            *[arg for arg in tiny_argv(corpus, dump_dir, steps) if not arg.startswith("data.sources")]]


def job_id(folder: Path) -> str:
    return json.loads((folder / "job.json").read_text())["job_id"]


def wait_for(condition, timeout: float = 120, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def log(dump_dir: Path) -> str:
    """A run's train.log, for a failed assertion's message."""
    path = dump_dir / "train.log"
    return path.read_text() if path.exists() else "(no train.log)"


def steps_logged(dump_dir: Path) -> list[int]:
    lines = [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]
    return [record["step"] for record in lines if "loss" in record]


def test_a_run_with_its_config_runs_the_code_it_was_submitted_with(slurm_cluster, corpus, tmp_path):
    """`stool run config=...` as documented; the repository edited while the job is queued: the job runs the
    snapshot (its working directory, as SLURM records it), not the edit."""
    repo = tmp_path / "repo"
    for package in CODE_PACKAGES:
        shutil.copytree(REPO / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    dump = tmp_path / "run"
    slurm_cluster.run("scontrol", "update", "PartitionName=main", "State=DOWN")  # queued, not started
    try:
        stool(slurm_cluster, "run", "script=apps.bert.train", "gpus_per_node=1", *SMALL_JOB,
              *run_argv(corpus, dump, 6), cwd=repo)
        assert slurm_cluster.states(job_id(dump)) == ["PENDING"]
        (repo / "lingua" / "train.py").write_text("raise SystemExit('the edited repository ran')\n")
    finally:
        slurm_cluster.run("scontrol", "update", "PartitionName=main", "State=UP")
    assert slurm_cluster.wait_final(job_id(dump)) == "COMPLETED", log(dump)
    code = Path(json.loads((dump / "job.json").read_text())["code"])
    assert code.parent == dump / "code" and (code / "lingua" / "train.py").read_text().startswith('"""')
    assert slurm_cluster.sacct(job_id(dump))[0]["WorkDir"] == str(code)
    assert steps_logged(dump) == list(range(1, 7))


def test_a_job_slurm_refuses_is_one_line(slurm_cluster, corpus, tmp_path):
    refused = stool(slurm_cluster, "run", "script=apps.bert.train", "partition=nowhere", *SMALL_JOB,
                    *run_argv(corpus, tmp_path / "run", 5), check=False)
    assert refused.returncode == 2 and refused.stderr == (
        "error: SLURM refused the job of 1 run(s): nothing was submitted (invalid partition specified: nowhere; Batch "
        "job submission failed: Invalid partition name specified)\n")


def test_a_sweep_is_one_job_array_and_status_reads_it(slurm_cluster, corpus, tmp_path):
    overrides = dict(arg.split("=", 1) for arg in tiny_argv(corpus, tmp_path / "unused", 4)[1:])
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "script": "apps.bert.train", "dump_dir": str(tmp_path / "sweep"), "overrides": overrides,
        "grid": {"optim.lr": [1e-3, 3e-3]},
        "launcher": {"gpus_per_node": 1, "cpus_per_task": 1, "mem_gb_per_task": 1, "time": 10}}))
    stool(slurm_cluster, "sweep", f"sweep={sweep}")
    runs = [tmp_path / "sweep" / name for name in ("lr0.001", "lr0.003")]
    array = {job_id(run).split("_")[0] for run in runs}
    assert len(array) == 1 and sorted(job_id(run) for run in runs) == [f"{min(array)}_0", f"{min(array)}_1"]
    assert slurm_cluster.wait_final(min(array)) == "COMPLETED"
    code, = (tmp_path / "sweep" / "code").iterdir()
    assert {row["WorkDir"] for row in slurm_cluster.sacct(min(array))} == {str(code)}
    rows = stool(slurm_cluster, "status", str(tmp_path / "sweep")).stdout.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [["lr0.001", "finished", "4"], ["lr0.003", "finished", "4"]]


@pytest.mark.parametrize("launcher,nodes", [(["gpus_per_node=1"], {"n1", "n2"}),  # one task
                                            (["gpus_per_node=2"], {"n1", "n2"}),  # two tasks on one node
                                            (["nodes=2", "gpus_per_node=1"], {"n[1-2]"})])
def test_runs_train_with_one_rank_per_task_on_one_or_two_nodes(slurm_cluster, corpus, tmp_path, launcher, nodes):
    dump = tmp_path / "run"
    stool(slurm_cluster, "run", "script=apps.bert.train", *launcher, *SMALL_JOB, *run_argv(corpus, dump, 5))
    assert slurm_cluster.wait_final(job_id(dump)) == "COMPLETED", log(dump)
    ranks = 2 if launcher != ["gpus_per_node=1"] else 1
    assert f"on {ranks} process(es) ({'slurm' if ranks > 1 else 'single'}, cpu" in (dump / "train.log").read_text()
    assert steps_logged(dump) == list(range(1, 6))  # one line per step, from rank 0 alone
    row, = slurm_cluster.sacct(job_id(dump), ("NodeList", "AllocTRES"))
    assert row["NodeList"] in nodes and f"gres/gpu={ranks}" in row["AllocTRES"]


def test_the_preemption_signal_saves_requeues_and_resumes_exactly(slurm_cluster, corpus, tmp_path):
    """SIGUSR2 (what SLURM sends `signal_delay_s` before the time limit) mid-run: the run saves, requeues its job,
    which starts again and resumes; every step is logged once, with the losses of a run never stopped."""
    dump, steps = tmp_path / "run", 150
    stool(slurm_cluster, "run", "script=apps.bert.train", "gpus_per_node=1", *SMALL_JOB,
          *run_argv(corpus, dump, steps), "checkpoint.every=1000", "validation.every=0")
    job = job_id(dump)
    wait_for(lambda: (dump / "metrics.jsonl").exists() and len(steps_logged(dump)) >= 20, what="step 20")
    slurm_cluster.run("scancel", "--signal=USR2", job)
    reference = tmp_path / "reference"  # the run never stopped, trained here while the job is requeued
    uninterrupted_run = start([sys.executable, "-m", "apps.bert.train", *run_argv(corpus, reference, steps),
                               "checkpoint.every=1000", "validation.every=0"],
                              {k: v for k, v in slurm_cluster.env.items() if not k.startswith("SLURM")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert slurm_cluster.wait_final(job, timeout=240) == "COMPLETED", log(dump)
        _, err = uninterrupted_run.communicate(timeout=240)
    finally:
        end(uninterrupted_run)
    assert uninterrupted_run.returncode == 0, err[-3000:]
    attempts = slurm_cluster.run("sacct", "-j", job, "-D", "-X", "-n", "-P", "-o", "State").split()
    assert attempts[0] == "REQUEUED" and attempts[-1] == "COMPLETED", attempts
    assert steps_logged(dump) == list(range(1, steps + 1))
    saved = sorted(int(p.name) for p in (dump / "checkpoints").iterdir() if p.name.isdigit())
    assert 20 <= saved[0] < steps  # the save at the signal (besides the last step's)

    resumed, uninterrupted = read_metrics(dump), read_metrics(reference)
    assert [resumed[s]["loss"] for s in range(1, steps + 1)] == pytest.approx(
        [uninterrupted[s]["loss"] for s in range(1, steps + 1)], rel=1e-5)


# ------------------------------------------------------------------------------------------------ pipelines


def pipeline_file(tmp_path: Path, stages: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(f"dump_dir: {tmp_path / 'out'}\npaths: {{flag: {tmp_path / 'flag'}}}\n"
                    "launcher: {gpus_per_node: 0, cpus_per_task: 1, mem_gb_per_task: 1, time: 10}\n"
                    "stages:\n" + textwrap.indent(textwrap.dedent(stages), "  "))
    return path


def stage(tmp_path: Path, name: str) -> Path:
    return tmp_path / "out" / "stages" / name


def starts(folder: Path) -> int:
    """How many times a stage's command started (each start writes its command line to its log)."""
    log = folder / "log.txt"
    return sum(line.startswith("$ ") for line in log.read_text().splitlines()) if log.exists() else 0


def test_pipeline_stages_wait_for_their_needs_and_a_failed_ones_dependents_never_run(slurm_cluster, tmp_path):
    spec = pipeline_file(tmp_path, """\
        first:
          run: timeit -n 1 "import time; time.sleep(2)"
        second:
          after: [first]
          run: timeit -n 1 pass
        broken:
          run: json.tool {dir}/missing.json
        after_broken:
          after: [broken]
          run: timeit -n 1 pass
        """)
    stool(slurm_cluster, "pipeline", f"pipeline={spec}", "cluster=slurm")
    jobs = {name: job_id(stage(tmp_path, name)) for name in ("first", "second", "broken", "after_broken")}
    assert f"Dependency=afterok:{jobs['first']}" in slurm_cluster.run("scontrol", "show", "job", jobs["second"])
    assert slurm_cluster.wait_final(jobs["second"]) == "COMPLETED"
    assert slurm_cluster.wait_final(jobs["broken"]) == "FAILED"  # the stage failed: so did its job
    assert slurm_cluster.wait_final(jobs["after_broken"]) == "CANCELLED"
    first, second = (slurm_cluster.sacct(jobs[name], ("Start", "End"))[0] for name in ("first", "second"))
    assert second["Start"] >= first["End"]
    assert starts(stage(tmp_path, "after_broken")) == 0
    status = stool(slurm_cluster, "status", str(tmp_path / "out")).stdout
    assert "broken        failed (exit 2: python -m json.tool: error: " in status, status
    assert "after_broken  not started" in status
    assert "2 of 4 stage(s) done" in status


@pytest.mark.slow
def test_a_preempted_stage_is_requeued_and_its_dependents_wait_for_it(slurm_cluster, corpus, tmp_path):
    """A training stage gets the preemption signal: the run saves and ends with status 0 (it does not requeue
    itself here), which must not count as done: the stage's job goes back in the queue, the run resumes, and only
    then does the next stage start."""
    train = " ".join([*tiny_argv(corpus, tmp_path / "train", 200), "checkpoint.every=1000", "validation.every=0",
                      "lifecycle.requeue=false"])
    spec = pipeline_file(tmp_path, f"""\
        train:
          run: apps.bert.train {train}
        after:
          after: [train]
          run: timeit -n 1 pass
        """)
    stool(slurm_cluster, "pipeline", f"pipeline={spec}", "cluster=slurm")
    job = job_id(stage(tmp_path, "train"))
    wait_for(lambda: (tmp_path / "train" / "metrics.jsonl").exists() and len(steps_logged(tmp_path / "train")) >= 20,
             what="step 20")
    slurm_cluster.run("scancel", "--signal=USR2", job)
    assert slurm_cluster.wait_final(job_id(stage(tmp_path, "after")), timeout=240) == "COMPLETED"
    assert slurm_cluster.wait_final(job) == "COMPLETED"
    assert starts(stage(tmp_path, "train")) == 2 and starts(stage(tmp_path, "after")) == 1
    assert steps_logged(tmp_path / "train") == list(range(1, 201))
    assert (stage(tmp_path, "train") / "done.json").exists()


@pytest.mark.slow
def test_a_rerun_submits_nothing_twice_and_a_cancelled_stage_runs_again(slurm_cluster, tmp_path):
    """Stages running, queued after them, or requeued keep their jobs when the pipeline is run again; `scancel` of a
    stage cancels the stages that need it, and the next run submits both again."""
    spec = pipeline_file(tmp_path, """\
        slow:
          run: timeit -n 1 "import os, time; [time.sleep(0.2) for _ in range(3000) if not os.path.exists('{flag}')]"
        waits:
          after: [slow]
          run: timeit -n 1 pass
        """)
    slow, waits = stage(tmp_path, "slow"), stage(tmp_path, "waits")
    stool(slurm_cluster, "pipeline", f"pipeline={spec}", "cluster=slurm")
    jobs = [job_id(slow), job_id(waits)]
    wait_for(lambda: (slow / "started.json").exists(), what="the slow stage to start")
    again = stool(slurm_cluster, "pipeline", f"pipeline={spec}", "cluster=slurm").stdout
    assert f"slow: job {jobs[0]} already running" in again and f"waits: job {jobs[1]} already submitted" in again

    slurm_cluster.run("scontrol", "requeue", jobs[0])
    slurm_cluster.wait_state(jobs[0], ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"))
    again = stool(slurm_cluster, "pipeline", f"pipeline={spec}", "cluster=slurm").stdout
    assert f"slow: job {jobs[0]} already" in again and f"waits: job {jobs[1]} already" in again, again
    assert sorted(slurm_cluster.queue()) == sorted(jobs)  # nothing new

    slurm_cluster.wait_state(jobs[0], ("RUNNING",))
    slurm_cluster.run("scancel", jobs[0])
    assert slurm_cluster.wait_final(jobs[0]) == "CANCELLED"
    assert slurm_cluster.wait_final(jobs[1]) == "CANCELLED" and starts(waits) == 0
    (tmp_path / "flag").touch()
    resubmitted = stool(slurm_cluster, "pipeline", f"pipeline={spec}", "cluster=slurm").stdout
    assert job_id(slow) not in jobs and f"waits: submitted job {job_id(waits)}, after {job_id(slow)}" in resubmitted
    assert slurm_cluster.wait_final(job_id(waits)) == "COMPLETED"
    assert (slow / "done.json").exists() and (waits / "done.json").exists() and starts(waits) == 1
