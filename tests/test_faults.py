"""Faults a run meets on a real machine or cluster: each ends in one line or an automatic recovery, and nothing that
was saved is lost. The commands run in-process through `main`, as the command line runs them."""

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import end, read_metrics, start, tiny_argv, write_corpus
from torch.distributed.checkpoint import FileSystemWriter

from apps.bert.train import APP as BERT
from apps.crossbert.train import APP as CROSSBERT
from lingua import train as loop
from lingua.app import load_model
from lingua.args import load_config
from lingua.checkpoint import safe_dcp
from lingua.checkpoint import store as checkpoint_module
from lingua.run_folder import RunFolder
from lingua.training import step as training_step
from lingua.training.lifecycle import RunLock
from lingua.training.optim import lr_at


def run_main(argv, capsys, app=BERT) -> tuple[int, str]:
    """Exit status and stderr of the training command."""
    try:
        loop.main(app, argv)
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def assert_one_line(err: str, message: str) -> None:
    assert err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def checkpoint_names(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoints").iterdir())


def test_a_diverging_run_keeps_only_finite_checkpoints(corpus, tmp_path, capsys):
    """Checkpoints every 5 steps, a log line every 40: the run diverges between two checkpoints, long before a log."""
    dump = tmp_path / "run"
    argv = tiny_argv(corpus, dump, steps=40) + ["logging.freq=40", "checkpoint.every=5", "checkpoint.keep=3",
                                                 "optim.lr=300", "optim.warmup=40", "optim.clip=0"]
    status, err = run_main(argv, capsys)
    assert status == loop.EXIT_DIVERGED
    assert_one_line(err, "the run stops without saving (the newest checkpoint, ")
    bad_step = int(err.split(" at step ")[1].split(":")[0])
    kept = checkpoint_names(dump)
    assert kept and all(int(name) < bad_step for name in kept), (kept, bad_step)
    for name in kept:
        model, _, _ = load_model(dump / "checkpoints" / name)
        assert all(torch.isfinite(p).all() for p in model.parameters()), name
    assert not (dump / "consolidated.pt").exists()
    assert "NaN" not in (dump / "metrics.jsonl").read_text() and "Infinity" not in (dump / "metrics.jsonl").read_text()


def test_weights_that_are_not_finite_are_never_saved(tmp_path):
    model = torch.nn.Linear(2, 2)
    guard = loop.NonFiniteGuard(torch.device("cpu"), loop.CheckpointManager(tmp_path, loop.CheckpointArgs()).latest)
    guard.check_before_save(model, 1)
    with torch.no_grad():
        model.weight[0, 0] = math.inf
    with pytest.raises(loop.Diverged, match="the weights are not finite after step 2"):
        guard.check_before_save(model, 2)


def test_a_second_trainer_on_a_live_dump_dir_is_refused(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    dump.mkdir()
    with RunLock(RunFolder(dump)):  # a live run: a thread, process or node holding the dump_dir
        status, err = run_main(tiny_argv(corpus, dump, steps=2), capsys)
        assert sorted(p.name for p in dump.iterdir()) == [".lock"]  # the refused start wrote nothing
    assert status == 2
    assert_one_line(err, "is in use by a running training (pid")


def test_a_killed_trainer_leaves_no_stuck_lock(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    argv = tiny_argv(corpus, dump, steps=100_000) + ["checkpoint.every=5"]
    proc = start([sys.executable, "-m", "apps.bert.train", *argv], stdout=subprocess.DEVNULL,
                 stderr=subprocess.DEVNULL)
    checkpoints = loop.CheckpointManager(dump / "checkpoints", loop.CheckpointArgs())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and checkpoints.latest() is None:
            time.sleep(0.2)
        status, err = run_main(tiny_argv(corpus, dump, steps=100_000), capsys)
        assert status == 2 and f"pid {proc.pid}" in err
    finally:
        end(proc)
    resumed_at = int(checkpoints.latest().name)
    status, _ = run_main(tiny_argv(corpus, dump, steps=resumed_at + 2) + ["checkpoint.every=5"], capsys)
    assert status == 0 and max(read_metrics(dump)) == resumed_at + 2


def test_extending_a_finished_run_follows_the_schedule_of_its_new_length(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    assert run_main(tiny_argv(corpus, dump, steps=20), capsys)[0] == 0
    first = read_metrics(dump)
    assert run_main(tiny_argv(corpus, dump, steps=40), capsys)[0] == 0
    logged, optim = read_metrics(dump), load_config(BERT.args_cls, tiny_argv(corpus, dump, 40)).optim
    assert [logged[s]["loss"] for s in range(1, 21)] == [first[s]["loss"] for s in range(1, 21)]
    assert [logged[s]["lr"] for s in range(21, 41)] == pytest.approx([lr_at(s, optim, 40) for s in range(20, 40)])
    log = (dump / "train.log").read_text()
    assert "resuming with changed settings: steps 20 -> 40" in log
    assert f"the learning-rate schedule is now that of a 40-step run: step 21 uses lr {lr_at(20, optim, 40):.3g}" in log


def test_resuming_with_another_model_refuses_before_writing(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    assert run_main(tiny_argv(corpus, dump, steps=10), capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in dump.iterdir() if p.is_file() and p.name != "train.log"}
    status, err = run_main(tiny_argv(corpus, dump, steps=20) + ["model.encoder.dim=64"], capsys)
    assert status == 2
    assert_one_line(err, "holds a model of another shape (model.encoder.dim 32 -> 64)")
    status, err = run_main(tiny_argv(corpus, dump, steps=20), capsys, app=CROSSBERT)
    assert status == 2
    assert_one_line(err, "holds a run of apps.bert.train, not apps.crossbert.train")
    assert {p.name: p.read_bytes() for p in dump.iterdir() if p.is_file() and p.name != "train.log"} == before
    assert checkpoint_names(dump) == ["0000000010"]


DAMAGE = [(name, how) for name in ("__0_0.distcp", ".metadata", "params.json", "train_state_00000.json",
                                   "manifest.json") for how in ("missing", "truncated")] + [
    ("__0_0.distcp", "overwritten"), ("params.json", "overwritten"), ("train_state_00000.json", "overwritten"),
    ("manifest.json", "overwritten")]


def damage(file: Path, how: str) -> None:
    if how == "missing":
        file.unlink()
    elif how == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif file.suffix == ".json":  # valid JSON of the wrong content
        file.write_text('{"apq": 1}' if file.name == "params.json" else "[1, 2]" if "manifest" in file.name else "{}")
    else:  # the same size, bytes of NaN in the middle
        data = bytearray(file.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 4000] = b"\xff" * 4000
        file.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny corpus, a finished 20-step BERT run on it: checkpoints 10 and 20), trained once for the module;
    the tests damage copies of it."""
    root = tmp_path_factory.mktemp("finished_run")
    corpus, full = write_corpus(root / "data"), root / "full"
    loop.train(BERT, load_config(BERT.args_cls, tiny_argv(corpus, full, steps=20)))
    return corpus, full


@pytest.mark.parametrize("name, how", DAMAGE)
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(finished_run, tmp_path, capsys, name, how):
    (corpus, full), damaged = finished_run, tmp_path / "damaged"
    shutil.copytree(full, damaged)
    (damaged / "consolidated.pt").unlink()
    damage(damaged / "checkpoints" / "0000000020" / name, how)
    status, _ = run_main(tiny_argv(corpus, damaged, steps=20), capsys)
    assert status == 0
    log = (damaged / "train.log").read_text()
    if (name, how) == ("manifest.json", "missing"):  # a checkpoint of an older version: it loads as it is
        assert "resumed from" in log and "0000000020" in log.split("resumed from")[-1].splitlines()[0]
        return
    nan_bytes = how == "overwritten" and name.endswith(".distcp")
    reason = "its weights or optimizer state are not all finite" if nan_bytes else name
    assert f"checkpoint 0000000020 is damaged ({reason}" in log
    assert checkpoint_names(damaged) == ["0000000010", "0000000020", "0000000020.damaged"]
    reference, continued = read_metrics(full), read_metrics(damaged)
    assert [continued[s]["loss"] for s in range(11, 21)] == [reference[s]["loss"] for s in range(11, 21)]


@pytest.mark.parametrize("how", ["dangling link", "file", "checkpoints deleted"])
def test_a_run_whose_checkpoints_cannot_be_found_is_not_restarted(corpus, tmp_path, capsys, how):
    dump = tmp_path / "run"
    run_main(tiny_argv(corpus, dump, steps=10), capsys)
    shutil.rmtree(dump / "checkpoints")
    if how == "dangling link":  # a scratch disk that is not mounted
        (dump / "checkpoints").symlink_to(tmp_path / "unmounted")
    elif how == "file":
        (dump / "checkpoints").write_text("")
    metrics, config = (dump / "metrics.jsonl").read_bytes(), (dump / "config.yaml").read_bytes()
    status, err = run_main(tiny_argv(corpus, dump, steps=20), capsys)
    assert status == 2
    assert_one_line(err, {"dangling link": "checkpoints is a symbolic link, which the library never writes through",
                          "file": "is a file, not the run's checkpoint",
                          "checkpoints deleted": "holds the consolidated.pt of a finished run but no checkpoint"}[how])
    assert (dump / "metrics.jsonl").read_bytes() == metrics and (dump / "config.yaml").read_bytes() == config


@pytest.mark.parametrize("change", ["n_heads=4", "scale_embeddings=true"])
def test_architecture_changes_that_keep_the_shapes_are_refused(corpus, tmp_path, capsys, change):
    dump = tmp_path / "run"
    run_main(tiny_argv(corpus, dump, steps=10) + ["model.encoder.scale_embeddings=false"], capsys)
    (dump / "consolidated.pt").unlink()
    status, err = run_main(tiny_argv(corpus, dump, steps=20) + ["model.encoder.scale_embeddings=false",
                                                                 f"model.encoder.{change}"], capsys)
    assert status == 2
    key, new = change.split("=")
    old = {"n_heads": "2", "scale_embeddings": "False"}[key]
    assert_one_line(err, f"holds a model of another shape (model.encoder.{key} {old} -> {new.capitalize()})")


def test_odd_files_in_the_run_folder(corpus, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    status, err = run_main(tiny_argv(corpus, tmp_path / "a_file", steps=2), capsys)
    assert status == 2
    assert_one_line(err, "dump_dir " + str(tmp_path / "a_file") + " is a file, not a folder")
    dump = tmp_path / "run"
    (dump / "checkpoints").mkdir(parents=True)
    (dump / "checkpoints" / "notes.tmp").write_text("mine")  # not a leftover of the library's: kept
    assert run_main(tiny_argv(corpus, dump, steps=2), capsys)[0] == 0
    assert (dump / "checkpoints" / "notes.tmp").read_text() == "mine"


def test_when_no_checkpoint_loads_the_run_is_not_restarted_from_scratch(corpus, tmp_path, capsys):
    dump = tmp_path / "run"
    run_main(tiny_argv(corpus, dump, steps=10), capsys)
    (dump / "checkpoints" / "0000000010" / ".metadata").unlink()
    metrics = (dump / "metrics.jsonl").read_bytes()
    for _ in range(2):  # the second start finds only the set-aside checkpoint, and still refuses
        status, err = run_main(tiny_argv(corpus, dump, steps=10), capsys)
        assert status == 2
        assert_one_line(err, "loads (the damaged ones are kept as *.damaged)")
    assert (dump / "metrics.jsonl").read_bytes() == metrics
    assert checkpoint_names(dump) == ["0000000010.damaged"]


def test_a_kill_during_the_metrics_rewrite_loses_nothing(corpus, tmp_path, capsys, monkeypatch):
    """On resume metrics.jsonl is rewritten without the lines past the checkpoint: a kill just before the rename
    leaves the old file whole, and the next start removes what the killed one left."""
    dump = tmp_path / "run"
    run_main(tiny_argv(corpus, dump, steps=20), capsys)
    shutil.rmtree(dump / "checkpoints" / "0000000020")
    before = (dump / "metrics.jsonl").read_bytes()

    def killed(*args):
        raise KeyboardInterrupt  # what SIGINT does outside the loop; a SIGKILL here would leave the temporary file

    monkeypatch.setattr("lingua.files.safe.os.replace", killed)
    status, _ = run_main(tiny_argv(corpus, dump, steps=20), capsys)
    assert status == 130 and (dump / "metrics.jsonl").read_bytes() == before
    monkeypatch.undo()
    (dump / "metrics.jsonl.tmp4242").write_text('{"step": 1')  # left by a SIGKILL mid-write
    (dump / "checkpoints" / "0000000015.tmp").mkdir()  # a save killed half-way
    (dump / "checkpoints" / "0000000005.deleting").mkdir()  # a prune killed half-way
    assert run_main(tiny_argv(corpus, dump, steps=20), capsys)[0] == 0
    assert sorted(read_metrics(dump)) == list(range(1, 21))
    assert not list(dump.glob("*.tmp*")) and checkpoint_names(dump) == ["0000000010", "0000000020"]


BAD_KNOBS = [
    (["steps=0"], "config key 'steps' must be >= 1, got 0"),
    (["steps=-3"], "config key 'steps' must be >= 1"),
    (["logging.freq=0"], "config key 'logging.freq' must be >= 1"),
    (["logging.peak_tflops=0"], "config key 'logging.peak_tflops' must be > 0"),
    (["checkpoint.every=0"], "config key 'checkpoint.every' must be >= 1"),
    (["checkpoint.keep=-1"], "config key 'checkpoint.keep' must be >= 0"),
    (["grad_acc_steps=0"], "config key 'grad_acc_steps' must be >= 1"),
    (["validation.every=-1"], "config key 'validation.every' must be >= 0"),
    (["validation.n_sequences=0"], "config key 'validation.n_sequences' must be >= 1"),
    (["validation.batch_size=0"], "config key 'validation.batch_size' must be >= 1"),
    (["eval.every=-1"], "config key 'eval.every' must be >= 0"),
    (["model.encoder.n_layers=0"], "config key 'model.encoder.n_layers' must be >= 1"),
    (["model.encoder.n_heads=0"], "config key 'model.encoder.n_heads' must be >= 1"),
    (["model.encoder.dim=-8"], "config key 'model.encoder.dim' must be >= 1"),
    (["model.encoder.head_dim=0"], "config key 'model.encoder.head_dim' must be >= 1"),
    (["model.encoder.attn_backend=flash"], "config key 'model.encoder.attn_backend' must be one of sdpa"),
    (["data.seq_len=0"], "config key 'data.seq_len' must be >= 1"),
    (["data.batch_size=0"], "config key 'data.batch_size' must be >= 1"),
    (["data.prefetch=-1"], "config key 'data.prefetch' must be >= 0"),
    (["data.sources.tiny=-1"], "config key 'data.sources' weights must be >= 0"),
    (["data.tokenizer.name=sentencepiece"], "config key 'data.tokenizer.name' must be 'gpt2', 'bytes' or 'hf'"),
    (["optim.lr=0"], "config key 'optim.lr' must be > 0"),
    (["optim.lr_min=1"], "config key 'optim.lr_min' must be between 0 and lr"),
    (["optim.warmup=-1"], "config key 'optim.warmup' must be >= 0"),
    (["optim.beta2=1"], "config key 'optim.beta2' must be in [0, 1)"),
    (["optim.clip=-1"], "config key 'optim.clip' must be >= 0"),
    (["model.mask_ratio=0"], "config key 'model.mask_ratio' must be strictly between 0 and 1"),
    (["model.mask_ratio=0.01"], "mask_ratio 0.01 masks 0 of 32 tokens per sequence"),
    (["device=tpu"], "device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["dump_dir="], "config key 'dump_dir' is empty"),
    (["lifecycle.stop_signal=SIGKILL"], "config key 'lifecycle.stop_signal' must be one of SIGUSR2"),
    (["distributed.fsdp_type=ddp"], "config key 'distributed.fsdp_type' must be one of full_shard"),
    (["distributed.compile=true", "distributed.compile_backend=tvm2"],
     "config key 'distributed.compile_backend' must be one of "),
    (["steps=ten"], "config key 'steps' expects an integer"),
    (["seed=1e30"], "config key 'seed' expects an integer (below 2^63 in size)"),
    (["seed=-1"], "config key 'seed' must be >= 0"),
    (["data.seed=-5"], "config key 'data.seed' must be >= 0"),
    (["optim.lr=inf"], "config key 'optim.lr' expects a finite number"),
    (["optim.eps=nan"], "config key 'optim.eps' expects a finite number"),
    (["data.sources.tiny=inf"], "config key 'data.sources.tiny' expects a finite number"),
]
if not torch.cuda.is_available():
    BAD_KNOBS.append((["device=cuda"], "device=cuda but no GPU is available"))


@pytest.mark.parametrize("extra, message", BAD_KNOBS, ids=[" ".join(extra) for extra, _ in BAD_KNOBS])
def test_bad_knobs_are_one_line_errors(corpus, tmp_path, capsys, extra, message):
    dump = tmp_path / "run"
    status, err = run_main(tiny_argv(corpus, dump, steps=2) + extra, capsys)
    assert status == 2
    assert_one_line(err, message)
    assert not (dump / "config.yaml").exists() and not (dump / "metrics.jsonl").exists()


def test_bad_crossbert_knobs_are_one_line_errors(corpus, tmp_path, capsys):
    status, err = run_main(tiny_argv(corpus, tmp_path / "run", 2) + ["model.predictor.n_layers=0"], capsys, CROSSBERT)
    assert status == 2
    assert_one_line(err, "config key 'model.predictor.n_layers' must be >= 1")


def test_bad_config_files_are_one_line_errors(corpus, tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("steps: 2\noptim:\n  lr: [1e-3\n")
    for path, message in [
        (tmp_path, "is a folder, not a file"),
        (broken, ": not valid YAML: expected ',' or ']', but got '<stream end>' at line 4, column 1"),
    ]:
        status, err = run_main([f"config={path}"] + tiny_argv(corpus, tmp_path / "run", 2), capsys)
        assert status == 2
        assert_one_line(err, message)


def test_ctrl_c_saves_a_checkpoint_and_exits_with_the_stop_status(corpus, tmp_path, capsys, monkeypatch):
    dump = tmp_path / "run"
    original, calls = training_step.clip_gradients, []

    def clip_then_interrupt(model, max_norm):  # Ctrl-C during step 3
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return original(model, max_norm)

    monkeypatch.setattr(training_step, "clip_gradients", clip_then_interrupt)
    before = signal.getsignal(signal.SIGINT)  # Python's handler, or SIG_IGN in a job started in the background
    status, _ = run_main(tiny_argv(corpus, dump, steps=40), capsys)
    assert status == loop.EXIT_STOPPED
    assert checkpoint_names(dump) == ["0000000003"]
    assert "received SIGINT: saving a checkpoint and stopping" in (dump / "train.log").read_text()
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    monkeypatch.undo()
    assert run_main(tiny_argv(corpus, dump, steps=6), capsys)[0] == 0
    assert sorted(read_metrics(dump)) == list(range(1, 7))


@pytest.mark.parametrize("saved_before", [0, 10])
def test_a_second_ctrl_c_during_the_save_says_what_the_run_resumes_from(corpus, tmp_path, capsys, monkeypatch,
                                                                         saved_before):
    """Ctrl-C during step 3 after the last checkpoint, then Ctrl-C again while its checkpoint is written (DCP
    wrapped it: "could not save ...: KeyboardInterrupt; the previous checkpoint is kept", with none)."""
    dump = tmp_path / "run"
    if saved_before:
        assert run_main(tiny_argv(corpus, dump, steps=saved_before), capsys)[0] == 0
    _signal_during_step(monkeypatch, 3, signal.SIGINT)
    original = FileSystemWriter.write_data

    def write_then_interrupt(self, plan, planner):
        os.kill(os.getpid(), signal.SIGINT)
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_then_interrupt)
    status, err = run_main(tiny_argv(corpus, dump, steps=40), capsys)
    assert status == 130
    resumes = f"the same command resumes from checkpoint {saved_before:010d}" if saved_before else \
        "there is no checkpoint, so the same command starts the run over"
    assert_one_line(err, f"interrupted without saving: {resumes}")
    assert checkpoint_names(dump) == ([f"{saved_before:010d}"] if saved_before else [])


def _signal_during_step(monkeypatch, step: int, signum: int) -> None:
    original, calls = training_step.clip_gradients, []

    def clip_then_signal(model, max_norm):
        calls.append(1)
        if len(calls) == step:
            os.kill(os.getpid(), signum)
        return original(model, max_norm)

    monkeypatch.setattr(training_step, "clip_gradients", clip_then_signal)


def test_the_evaluation_a_stop_skipped_runs_on_resume(corpus, tmp_path, capsys, monkeypatch):
    dump = tmp_path / "run"
    _signal_during_step(monkeypatch, 10, signal.SIGTERM)  # step 10 validates (validation.every=10)
    assert run_main(tiny_argv(corpus, dump, steps=20), capsys)[0] == loop.EXIT_STOPPED
    validated = lambda: [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()  # noqa
                         if "val/loss" in line]
    assert validated() == []
    monkeypatch.undo()
    assert run_main(tiny_argv(corpus, dump, steps=20), capsys)[0] == 0
    assert validated() == [10, 20]


def test_preemption_without_scontrol_still_exits_cleanly(corpus, tmp_path, capsys, monkeypatch):
    """SIGUSR2 in a SLURM job whose container has no scontrol: saved, a warning, exit 0."""
    dump = tmp_path / "run"
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    _signal_during_step(monkeypatch, 3, signal.SIGUSR2)
    status, err = run_main(tiny_argv(corpus, dump, steps=40), capsys)
    assert status == 0 and err == ""
    assert checkpoint_names(dump) == ["0000000003"]
    assert "cannot requeue SLURM job 42" in (dump / "train.log").read_text()


def test_a_failed_save_says_why_and_keeps_the_previous_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    """DCP reports a full disk as a torn zip record (RuntimeError), not ENOSPC: simulated here as it comes."""
    dump = tmp_path / "run"
    run_main(tiny_argv(corpus, dump, steps=10), capsys)
    original = checkpoint_module.dcp.save

    def save_on_a_full_disk(state, checkpoint_id):
        original(state, checkpoint_id=checkpoint_id)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint_module.dcp, "save", save_on_a_full_disk)
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    status, err = run_main(tiny_argv(corpus, dump, steps=20), capsys)
    assert status == 2
    assert_one_line(err, "could not save checkpoint")
    assert "0000000020: the disk is full (0 bytes free); the same command resumes from checkpoint 0000000010" in err
    assert checkpoint_names(dump) == ["0000000010"]


def test_a_data_file_truncated_during_a_run_stops_it_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    dump, chunk = tmp_path / "run", corpus / "tiny" / "train.00000.jsonl"
    original, calls = training_step.clip_gradients, []

    def clip_then_truncate(model, max_norm):  # during step 12, after the checkpoint of step 10 (the loader reads
        # ahead: it meets the cut a few steps later)
        calls.append(1)
        if len(calls) == 12:
            os.truncate(chunk, chunk.stat().st_size // 3)
        return original(model, max_norm)

    monkeypatch.setattr(training_step, "clip_gradients", clip_then_truncate)
    status, err = run_main(tiny_argv(corpus, dump, steps=100_000) + ["checkpoint.every=10"], capsys)
    assert status == 2
    assert_one_line(err, f"data file {chunk} ")
    assert "under the running job" in err and "0000000010" in checkpoint_names(dump)


def test_metrics_that_cannot_be_written_stop_the_run_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    class FullDisk:
        """metrics.jsonl on a disk that fills up after three records."""

        def __init__(self, file):
            self.file, self.writes = file, 0

        def write(self, text):
            self.writes += 1
            if self.writes > 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(text)

        def flush(self):
            self.file.flush()

        def close(self):
            self.file.close()

    init = loop.MetricLogger.__init__

    def init_on_a_full_disk(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.file = FullDisk(self.file)

    monkeypatch.setattr(loop.MetricLogger, "__init__", init_on_a_full_disk)
    dump = tmp_path / "run"
    status, err = run_main(tiny_argv(corpus, dump, steps=40), capsys)
    assert status == 2
    assert_one_line(err, f"cannot write {dump / 'metrics.jsonl'}: No space left on device")
    assert sorted(read_metrics(dump)) == [1, 2, 3] and not (dump / "consolidated.pt").exists()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_really_full_disk(corpus, tmp_path, capsys):
    """Where a small tmpfs can be mounted (root with the capability), a real disk fills up during the second save."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1500k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        dump = disk / "run"
        status, err = run_main(tiny_argv(corpus, dump, steps=20) + ["checkpoint.every=5"], capsys)
        assert status == 2
        assert_one_line(err, "0000000010: the disk is full")
        assert checkpoint_names(dump) == ["0000000005"]
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # lazy: this process's train.log is still open


def test_non_finite_guard_reads_the_device_only_when_asked(tmp_path):
    guard = loop.NonFiniteGuard(torch.device("cpu"), loop.CheckpointManager(tmp_path, loop.CheckpointArgs()).latest)
    guard.update(1, torch.tensor(2.0), torch.tensor(1.0))
    guard.update(2, torch.tensor(math.nan), torch.tensor(1.0))
    guard.update(3, torch.tensor(1.0), torch.tensor(math.inf))
    with pytest.raises(loop.Diverged, match="at step 2: .*no checkpoint was saved"):
        guard.check()


@pytest.mark.parametrize("fails", ["once", "always"])
def test_an_io_error_reading_the_newest_checkpoint_sets_nothing_aside(corpus, tmp_path, capsys, monkeypatch, fails):
    """EIO from the disk while DCP reads the newest checkpoint's shards: no proof of damage. Once: read again, the
    run resumes from that newest checkpoint. Always: one line, exit 2, every checkpoint where it was."""
    dump = tmp_path / "run"
    assert run_main(tiny_argv(corpus, dump, steps=20), capsys)[0] == 0
    (dump / "consolidated.pt").unlink()
    original, calls = safe_dcp.SafeReader.read_data, []

    def read_data_with_an_io_error(self, *args, **kwargs):
        calls.append(1)
        if fails == "always" or len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(safe_dcp.SafeReader, "read_data", read_data_with_an_io_error)
    monkeypatch.setattr("lingua.training.resume.RETRY_DELAY_S", 0.01)
    status, err = run_main(tiny_argv(corpus, dump, steps=20), capsys)
    assert checkpoint_names(dump) == ["0000000010", "0000000020"]
    log = (dump / "train.log").read_text()
    if fails == "once":
        assert status == 0, err
        assert "cannot read checkpoint" in log and "trying again" in log
        assert log.split("resumed from ")[-1].splitlines()[0] == str(dump / "checkpoints" / "0000000020")
    else:
        assert status == 2
        assert_one_line(err, f"cannot read checkpoint {dump / 'checkpoints' / '0000000020'} (Input/output error; "
                             "tried 4 times): an I/O error is no proof of damage, so every checkpoint is left in "
                             "place")
        assert "damaged" not in log
