"""Several processes on the CPU (gloo): torchrun launches of the real commands, FSDP2 equivalence, checkpoints
across world sizes, preemption, the launch environment of SLURM, the data re-partition."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    ENV,
    LONG_RUN_STEPS,
    REPO,
    end,
    long_run_argv,
    read_metrics,
    run_to_the_end,
    running,
    start,
    tagged_processes,
    tiny_argv,
)

from apps.bert.train import APP as BERT
from lingua import train as loop
from lingua.app import load_model
from lingua.args import load_config
from lingua.checkpoint.store import CheckpointArgs, CheckpointManager
from lingua.data.loader import DataArgs, TrainLoader, repartition
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer
from lingua.distributed import Launch, detect_launch, first_host
from lingua.run_folder import RunFolder
from lingua.training.lifecycle import RunLock


def torchrun(*args, procs=2, check=True, timeout=300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", *map(str, args)]
    result = run_to_the_end(cmd, timeout)
    if check and result.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


APPS = ("bert", "crossbert")
FSDP_TYPES = ("full_shard", "no_shard", "hybrid_shard")
ON_ONE_PROCESS = [*(f"app={app} grad_acc=2" for app in APPS), *(f"app={app}" for app in APPS),
                  "app=crossbert ac=full", "app=crossbert ac=selective", "app=crossbert ema=0.5"]
ON_TWO_PROCESSES = [*(f"app={app} grad_acc=2 fsdp_type={fsdp_type}" for app in APPS for fsdp_type in FSDP_TYPES),
                    *(f"app={app} bf16=true" for app in APPS), "app=crossbert",
                    "app=crossbert compile=true backend=aot_eager ac=selective", "app=crossbert ema=0.5"]


@pytest.fixture(scope="module")
def fsdp_steps(tmp_path_factory) -> dict[int, dict[str, list[dict]]]:
    """Per-step loss and gradient norm of tests/fsdp_steps.py, by number of processes and configuration: every
    configuration the tests below compare, in one launch on one process and one torchrun launch on two."""
    folder = tmp_path_factory.mktemp("fsdp_steps")
    subprocess.run([sys.executable, "tests/fsdp_steps.py", folder / "one.json", *ON_ONE_PROCESS], cwd=REPO, env=ENV,
                   check=True)
    torchrun("tests/fsdp_steps.py", folder / "two.json", *ON_TWO_PROCESSES, timeout=600)
    return {1: json.loads((folder / "one.json").read_text()), 2: json.loads((folder / "two.json").read_text())}


def assert_close(a: list[dict], b: list[dict], rel: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=rel)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=rel)


@pytest.mark.parametrize("app", APPS)
def test_two_ranks_match_one_rank_with_the_whole_batch(fsdp_steps, app):
    """Same global rows and masks: FSDP over 2 ranks (full, replicated, hybrid; with gradient accumulation) gives
    the losses and gradient norms of one process."""
    one = fsdp_steps[1][f"app={app} grad_acc=2"]
    for fsdp_type in FSDP_TYPES:
        assert_close(fsdp_steps[2][f"app={app} grad_acc=2 fsdp_type={fsdp_type}"], one, rel=1e-5)


@pytest.mark.parametrize("app", APPS)
def test_fsdp_bf16_mixed_precision_under_gloo_follows_fp32(fsdp_steps, app):
    """FSDP2's bf16 policy (parameters gathered in bf16, gradients reduced in fp32: the GPUs'), on two CPU ranks."""
    fp32, bf16 = fsdp_steps[1][f"app={app}"], fsdp_steps[2][f"app={app} bf16=true"]
    assert_close(bf16, fp32, rel=3e-2)
    assert any(abs(a["grad_norm"] / b["grad_norm"] - 1) > 1e-5 for a, b in zip(bf16, fp32))  # bf16 was in force


def test_activation_checkpointing_keeps_the_gradients(fsdp_steps):
    for mode in ("full", "selective"):
        assert_close(fsdp_steps[1][f"app=crossbert ac={mode}"], fsdp_steps[1]["app=crossbert"], rel=1e-6)


def test_compiled_blocks_under_fsdp_match_eager(fsdp_steps):
    """Dynamo and AOT autograd through FSDP2's hooks and selective checkpointing, run by the eager kernels: the same
    numbers. Inductor's code (slow to build on a CPU, another on a GPU) runs in the GPU acceptance's dry run."""
    compiled = fsdp_steps[2]["app=crossbert compile=true backend=aot_eager ac=selective"]
    assert compiled == fsdp_steps[2]["app=crossbert"]


def test_the_weights_average_under_fsdp_matches_one_process_and_leaves_training_as_it_was(fsdp_steps):
    """The average kept on each rank's shards, swapped into the sharded model after every step: its loss is one
    process's, and the training steps after each swap are those of a run that keeps none, bit for bit."""
    averaged = fsdp_steps[2]["app=crossbert ema=0.5"]
    assert [(r["loss"], r["grad_norm"]) for r in averaged] == [(r["loss"], r["grad_norm"])
                                                               for r in fsdp_steps[2]["app=crossbert"]]
    for two, one in zip(averaged, fsdp_steps[1]["app=crossbert ema=0.5"], strict=True):
        assert two["ema_loss"] == pytest.approx(one["ema_loss"], rel=1e-5)


def _train_argv(corpus: Path, dump: Path, steps: int, *extra) -> list[str]:
    return [*tiny_argv(corpus, dump, steps), "checkpoint.every=10", *extra]


def test_torchrun_trains_and_writes_once(corpus, tmp_path):
    """ELECTRA, whose two networks are sharded and saved together, with the weights' average kept on each rank's
    shards, scored and gathered; every app's sharded steps are compared with one process in fsdp_steps, CrossBERT
    trains under torchrun below, BERT moves between world sizes."""
    dump = tmp_path / "run"
    result = torchrun("-m", "apps.electra.train", *_train_argv(corpus, dump, 12, "ema.decay=0.9", "ema.evaluate=both"))
    metrics = read_metrics(dump)
    assert sorted(metrics) == list(range(1, 13))  # one line per step: rank 0 alone writes
    assert metrics[12]["data_tokens"] == 12 * 2 * 8 * 32  # both ranks' tokens
    assert "on 2 process(es) (torchrun, cpu, full_shard)" in (dump / "train.log").read_text()
    assert "Traceback" not in result.stderr
    model, _, _ = load_model(dump)  # the export gathers every shard
    assert all(torch.isfinite(p).all() for p in model.parameters())
    average, _, _ = load_model(dump / "consolidated_ema.pt")
    assert all(torch.isfinite(p).all() and not torch.equal(p, raw)
               for p, raw in zip(average.parameters(), model.parameters(), strict=True))
    assert "ema/val/loss" in (dump / "metrics.jsonl").read_text()


def test_torchrun_with_one_process_trains_under_fsdp(corpus, tmp_path):
    """`torchrun --nproc-per-node 1` (one GPU) trains under FSDP2, as several processes do; the checkpoint loads
    without torchrun."""
    dump = tmp_path / "run"
    torchrun("-m", "apps.crossbert.train", *_train_argv(corpus, dump, 6), procs=1)
    assert "on 1 process(es) (torchrun, cpu, full_shard)" in (dump / "train.log").read_text()
    assert sorted(read_metrics(dump)) == list(range(1, 7))
    model, _, _ = load_model(dump)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_checkpoints_move_between_world_sizes(corpus, tmp_path):
    """Saved on 2 ranks at step 10, resumed on 1 rank: it continues with the unread data re-partitioned (and a run
    continuing from that checkpoint on 1 rank takes the same steps), then back on 2 ranks again; the weights' average
    goes on through both (resharded like the weights, never started again).
    (Resumed on the same 2 ranks, a run continues exactly: the elastic restart's test.)"""
    full, dump = tmp_path / "full", tmp_path / "resumed_on_1"
    torchrun("-m", "apps.bert.train", *_train_argv(corpus, full, 20, "ema.decay=0.9"))
    reference = read_metrics(full)
    subprocess.run(["cp", "-r", full, dump], check=True)
    subprocess.run(["rm", "-r", dump / "checkpoints" / "0000000020", dump / "consolidated.pt",
                    dump / "consolidated_ema.pt"], check=True)
    subprocess.run([sys.executable, "-m", "apps.bert.train", *_train_argv(corpus, dump, 20, "ema.decay=0.9")],
                   cwd=REPO, env=ENV, check=True, capture_output=True)
    resumed = read_metrics(dump)
    assert sorted(resumed) == list(range(1, 21))
    assert resumed[20]["data_tokens"] == reference[10]["data_tokens"] + 10 * 8 * 32
    assert "re-partitioned over 1 rank(s)" in (dump / "train.log").read_text()
    branch = tmp_path / "branch"  # continue_from the same checkpoint on 1 rank: the same steps as that resume
    subprocess.run([sys.executable, "-m", "apps.bert.train", *_train_argv(corpus, branch, 20, "ema.decay=0.9"),
                    f"continue_from={full / 'checkpoints' / '0000000010'}"], cwd=REPO, env=ENV, check=True,
                   capture_output=True)
    assert [read_metrics(branch)[s]["loss"] for s in range(11, 21)] == [resumed[s]["loss"] for s in range(11, 21)]
    torchrun("-m", "apps.bert.train", *_train_argv(corpus, dump, 30, "ema.decay=0.9"))
    assert sorted(read_metrics(dump)) == list(range(1, 31))
    for step in ("0000000020", "0000000030"):  # the average started at step 0 and was carried on
        assert json.loads((dump / "checkpoints" / step / "train_state_00000.json").read_text())["ema_from"] == 0
    average, raw = (torch.load(dump / name, weights_only=True)["model"] for name in ("consolidated_ema.pt",
                                                                                    "consolidated.pt"))
    assert all(torch.isfinite(v).all() for v in average.values()) and any(
        not torch.equal(v, raw[k]) for k, v in average.items())


def test_init_from_loads_weights_only_into_a_sharded_model(corpus, tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    loop.train(BERT, load_config(BERT.args_cls, _train_argv(corpus, source, 20)))
    torchrun("-m", "apps.bert.train", *_train_argv(corpus, target, 1, f"init_from={source}", "validation.every=1",
                                                   "optim.lr=1e-12", "optim.lr_min=0"))
    val = lambda dump: [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                        if "val/loss" in line]
    assert val(target)[0]["step"] == 1 and read_metrics(target)[1]["loss"] < 4.5  # trained weights, step from 0
    assert val(target)[0]["val/loss"] == pytest.approx(val(source)[-1]["val/loss"], rel=1e-4)
    state = torch.load(target / "consolidated.pt", weights_only=True)
    assert state["config"]["init_from"] == str(source)


def test_init_from_another_architecture_is_refused(corpus, tmp_path, capsys):
    loop.train(BERT, load_config(BERT.args_cls, _train_argv(corpus, tmp_path / "source", 2)))
    with pytest.raises(SystemExit) as exit_info:
        loop.main(BERT, _train_argv(corpus, tmp_path / "run", 2, f"init_from={tmp_path / 'source'}",
                                    "model.encoder.n_heads=4"))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "another architecture (model.encoder.n_heads 2 -> 4)" in err


def test_an_error_on_one_rank_stops_every_rank_in_one_line(tmp_path):
    """A source with one line gives rank 1 no data: both ranks say so, nothing is written, nothing hangs."""
    (tmp_path / "data" / "tiny").mkdir(parents=True)
    (tmp_path / "data" / "tiny" / "train.00000.jsonl").write_text(json.dumps({"text": "one line " * 10}) + "\n")
    (tmp_path / "data" / "tiny" / "valid.jsonl").write_text(json.dumps({"text": "word " * 400}) + "\n")
    dump = tmp_path / "run"
    result = torchrun("-m", "apps.bert.train", *_train_argv(tmp_path / "data", dump, 2), check=False)
    assert result.stderr.count("error: data source 'tiny' is too small to give rank 1 of 2 any line") == 2
    assert "]: Traceback" not in result.stderr
    assert not (dump / "config.yaml").exists() and not (dump / "metrics.jsonl").exists()


def test_init_from_a_missing_path_is_one_line(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        loop.main(BERT, tiny_argv(corpus, tmp_path / "run", 2) + [f"init_from={tmp_path / 'nowhere'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "checkpoint not found" in err and len(err.strip().splitlines()) == 1


def test_preemption_signal_to_one_rank_stops_all_at_one_step(corpus, tmp_path):
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "apps.bert.train",
           *_train_argv(corpus, dump, 100_000, "checkpoint.every=1000", "validation.every=0")]
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (dump / "metrics.jsonl").exists():
            time.sleep(0.2)
        time.sleep(1)
        rank0 = int((dump / ".lock").read_text().split()[1])
        rank1, = (p for p in _training_children(proc.pid) if p != rank0)  # not a helper process torchrun started
        os.kill(rank1, signal.SIGUSR2)  # rank 1 only
        output, _ = proc.communicate(timeout=120)
    finally:
        end(proc)
    assert proc.returncode == 0, output
    saved = CheckpointManager(dump / "checkpoints", CheckpointArgs()).complete_checkpoints()
    assert len(saved) == 1 and len(list(saved[0].glob("train_state_*.json"))) == 2
    states = [json.loads(p.read_text()) for p in sorted(saved[0].glob("train_state_*.json"))]
    assert states[0]["step"] == states[1]["step"] == int(saved[0].name)
    assert "another rank received SIGUSR2" in output or "received SIGUSR2" in output
    step = int(saved[0].name)
    torchrun("-m", "apps.bert.train", *_train_argv(corpus, dump, step + 3, "validation.every=0"))
    assert max(read_metrics(dump)) == step + 3


def _workers(proc: subprocess.Popen, module: bytes = b"apps.bert.train") -> dict[int, int]:
    """Rank -> pid of the training workers that the torchrun `proc` runs now."""
    workers = {}
    for pid in tagged_processes(proc.tag):
        try:
            cmdline, environ = (Path(f"/proc/{pid}/{name}").read_bytes() for name in ("cmdline", "environ"))
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in environ.split(b"\0") if b"=" in item)
        if pid != proc.pid and module in cmdline and b"RANK" in env:
            workers[int(env[b"RANK"])] = pid
    return workers


def _wait_for(condition, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not condition():
        time.sleep(0.1)
    assert condition(), "timed out"


def _start_training(corpus: Path, dump: Path, *extra: str, output=subprocess.PIPE) -> subprocess.Popen:
    """A long two-rank BERT run under torchrun, in the background; returns once both workers train."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "apps.bert.train",
           *_train_argv(corpus, dump, 100_000, "checkpoint.every=1000", *extra)]
    proc = start(cmd, stdout=output, stderr=output)
    try:
        _wait_for(lambda: (dump / "metrics.jsonl").exists() and len(_workers(proc)) == 2)
    except BaseException:
        end(proc)
        raise
    return proc


def _saved_together(dump: Path) -> int:
    """The step of the one complete checkpoint, which both ranks saved at the same step."""
    saved = CheckpointManager(dump / "checkpoints", CheckpointArgs()).complete_checkpoints()
    assert len(saved) == 1 and len(list(saved[0].glob("train_state_*.json"))) == 2
    states = [json.loads(p.read_text()) for p in sorted(saved[0].glob("train_state_*.json"))]
    assert states[0]["step"] == states[1]["step"] == int(saved[0].name)
    return int(saved[0].name)


def test_a_signal_inside_the_stop_agreement_stops_every_rank_after_the_next_step(corpus, tmp_path):
    """Rank 1 receives SIGUSR2 after step 3's agreement was reduced and before its result is used: rank 0 never
    heard of it then, so no rank stops at step 3; both stop after step 4, together."""
    dump = tmp_path / "run"
    result = torchrun("tests/signal_in_agreement.py", 3, "apps.bert.train",
                      *_train_argv(corpus, dump, 100_000, "logging.freq=1000", "validation.every=0",
                                   "checkpoint.every=1000", "distributed.timeout_minutes=0.5"), check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _saved_together(dump) == 4
    assert "[rank 1] received SIGUSR2" in result.stdout and "another rank received SIGUSR2" in result.stdout


def test_a_rank_that_stops_responding_ends_the_job_in_one_line_within_the_timeout(corpus, tmp_path):
    proc = _start_training(corpus, tmp_path / "run", "distributed.timeout_minutes=0.25")
    try:
        rank0, rank1 = _workers(proc)[0], _workers(proc)[1]
        os.kill(rank0, signal.SIGSTOP)
        stopped = time.time()
        _wait_for(lambda: not running(rank1), timeout=60)
        waited = time.time() - stopped
        os.kill(rank0, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        end(proc)
    assert proc.returncode != 0
    assert 15 <= waited < 15 + 20  # the timeout, and the time to notice it
    assert err.count("error: rank 1 waited more than 0.25 min for the other ranks during ") == 1, err[-3000:]
    assert "]: Traceback" not in err


def test_a_data_file_that_shrinks_under_a_run_stops_every_rank_in_one_line(corpus, tmp_path):
    proc = _start_training(corpus, tmp_path / "run", "distributed.timeout_minutes=0.5")
    chunk = corpus / "tiny" / "train.00001.jsonl"  # rank 1's share (most of it)
    try:
        os.truncate(chunk, chunk.stat().st_size // 2)
        _, err = proc.communicate(timeout=120)
    finally:
        end(proc)
    assert proc.returncode != 0
    assert err.count(f"error: data file {chunk} ") == 2, err[-3000:]  # the same line on both ranks
    assert "under the running job" in err and "]: Traceback" not in err


def test_an_elastic_restart_continues_from_the_newest_checkpoint(corpus, tmp_path, long_run_on_two_processes):
    """torchrun --max-restarts: a worker killed mid-run is restarted with the other, and the run resumes by itself
    with the losses of an uninterrupted run."""
    restarted = tmp_path / "restarted"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "apps.bert.train", *long_run_argv(corpus, restarted)]
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    checkpoints = CheckpointManager(restarted / "checkpoints", CheckpointArgs())
    try:
        _wait_for(lambda: checkpoints.latest() is not None and len(_workers(proc)) == 2)  # the first, at step 5
        os.kill(_workers(proc)[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        end(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in (restarted / "train.log").read_text()
    got = read_metrics(restarted)
    assert sorted(got) == list(range(1, LONG_RUN_STEPS + 1))
    assert all(got[s]["loss"] == long_run_on_two_processes[s]["loss"] for s in got)


def test_sigterm_ends_a_start_up_that_waits_for_the_other_ranks(corpus, tmp_path):
    """A worker whose other ranks never come (a launcher restarting the job) stops on SIGTERM at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    proc = start([sys.executable, "-m", "apps.bert.train", *_train_argv(corpus, tmp_path / "run", 10)], env,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        sigint = 1 << (signal.SIGINT - 1)  # the start-up holds the stop signals back from this point
        _wait_for(lambda: any(line.startswith("SigBlk:") and int(line.split()[1], 16) & sigint
                              for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()))
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    finally:
        end(proc)
    assert proc.returncode == -signal.SIGTERM


def test_a_torchrun_that_times_out_leaves_no_worker(corpus, tmp_path):
    proc = _start_training(corpus, tmp_path / "run", output=subprocess.DEVNULL)
    try:
        workers = list(_workers(proc).values())
        with pytest.raises(subprocess.TimeoutExpired):
            proc.communicate(timeout=1)  # as a test that runs too long
    finally:
        end(proc)
    assert not any(running(pid) for pid in workers) and tagged_processes(proc.tag) == []


def _training_children(pid: int) -> list[int]:
    """The child processes of `pid` that run the training module."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in children if b"apps.bert.train" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_a_held_dump_dir_refuses_every_rank(corpus, tmp_path):
    dump = tmp_path / "run"
    dump.mkdir()
    with RunLock(RunFolder(dump)):
        result = torchrun("-m", "apps.bert.train", *_train_argv(corpus, dump, 2), check=False)
    assert result.returncode != 0 and result.stderr.count("is in use by a running training") == 2
    assert "]: Traceback" not in result.stderr  # no worker traceback (torchrun reports the exit status with its own)


def test_launch_environments():
    torchrun_env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "node1", "MASTER_PORT": "29400"}
    assert detect_launch(torchrun_env) == Launch(3, 1, 4, 2, "node1", 29400, "torchrun")
    srun_env = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "123456",
                "SLURM_STEP_NODELIST": "gpu[07-09,12]", "SLURM_STEP_NUM_NODES": "4",
                "SLURM_STEP_TASKS_PER_NODE": "2(x4)", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-09,12]"}
    assert detect_launch(srun_env) == Launch(5, 1, 8, 2, "gpu07", 20_000 + 123456 % 20_000, "slurm")
    assert detect_launch({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}) == Launch()  # a batch script, no srun
    assert detect_launch({}) == Launch()
    for nodelist, host in [("node1", "node1"), ("a[1-3]", "a1"), ("gpu[07-09,12],cpu1", "gpu07"), ("n[5,7]", "n5"),
                           ("h-a-[003-004]", "h-a-003")]:
        assert first_host(nodelist) == host


def _distinct_docs(root: Path) -> Counter:
    """A corpus whose documents are runs of one distinct character: the tokens read tell which lines were read."""
    source = root / "docs"
    source.mkdir(parents=True)
    chars = [c for c in map(chr, range(33, 127))]
    lines = [json.dumps({"text": c * (5 + 7 * i % 23)}) for i, c in enumerate(chars)]
    (source / "train.00000.jsonl").write_text("\n".join(lines[:50]) + "\n")
    (source / "train.00001.jsonl").write_text("\n".join(lines[50:]) + "\n")
    return Counter({ord(c): 5 + 7 * i % 23 for i, c in enumerate(chars)})


def _read_epoch(loader: TrainLoader, counts: Counter) -> None:
    """Counts the tokens a loader hands out until its stream starts the next epoch."""
    stream = loader.streams[0]
    epoch = stream.epoch
    while True:
        token = stream.take(1)[0]
        if stream.epoch != epoch:
            return
        counts[token] += 1


@pytest.mark.parametrize("old, new", [(2, 1), (2, 3), (1, 2), (3, 2)])
def test_repartition_reads_every_line_once(tmp_path, old, new):
    expected = _distinct_docs(tmp_path)
    args = DataArgs(root_dir=str(tmp_path), sources={"docs": 1.0}, seq_len=16, batch_size=2, prefetch=0)
    tokenizer = build_tokenizer(TokenizerArgs(name="bytes"))
    counts = Counter()
    states = []
    for rank in range(old):
        with TrainLoader(args, tokenizer, rank, old) as loader:
            for _ in range(rank + 2):  # ranks stop at different places, mid-document
                counts.update(next(loader).flatten().tolist())
            states.append(loader.state_dict())
    moved = repartition(states, new, args)
    moved = json.loads(json.dumps(moved))  # it is saved as JSON
    for rank in range(new):
        with TrainLoader(args, tokenizer, rank, new, moved[rank]) as loader:
            _read_epoch(loader, counts)
    assert counts.pop(tokenizer.bos_id) == counts.pop(tokenizer.eos_id) == len(expected) and counts == expected


def test_repartition_is_balanced(tmp_path):
    _distinct_docs(tmp_path)
    args = DataArgs(root_dir=str(tmp_path), sources={"docs": 1.0}, seq_len=16, batch_size=2, prefetch=0)
    tokenizer = build_tokenizer(TokenizerArgs(name="bytes"))
    with TrainLoader(args, tokenizer, 0, 1) as loader:
        state = loader.state_dict()
    pieces = [s["sources"]["docs"]["segments"] for s in repartition([state], 4, args)]
    sizes = [sum(end - start for _, start, end, _ in piece) for piece in pieces]
    longest_line = max(len(line) + 1 for line in (tmp_path / "docs" / "train.00000.jsonl").read_text().splitlines())
    assert min(sizes) > 0 and max(sizes) - min(sizes) <= 2 * longest_line
    assert np.sum(sizes) == sum(p.stat().st_size for p in (tmp_path / "docs").iterdir())
