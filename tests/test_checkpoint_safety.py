"""A run folder from anyone is safe to open: no pickle in a checkpoint runs code, no file it names is read from
outside it or blocks the reader (a FIFO), a kill at any moment of a save leaves a complete newest (or previous)
checkpoint that the next start finds, every write is flushed to disk before it is relied on, and metrics.jsonl lines
that are not records are skipped."""

import contextlib
import dataclasses
import errno
import json
import logging
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import Killed, run_to_the_end, tiny_argv, write_corpus
from conftest import killed_before as counting_kills
from test_checkpoint import _model_and_optimizer
from torch.distributed.checkpoint.state_dict import get_state_dict

from apps.bert.train import APP
from lingua.app import load_model
from lingua.args import load_config
from lingua.checkpoint.store import (
    MANIFEST,
    PARAMS,
    Checkpoint,
    CheckpointArgs,
    CheckpointManager,
    DamagedCheckpoint,
    TrainState,
    verify,
)
from lingua.errors import UserError
from lingua.export.consolidate import main as checkpoint_main
from lingua.export.hf_folder import main as export_main
from lingua.files.safe import atomic_write
from lingua.metrics import LoggingArgs, MetricLogger, read_metrics
from lingua.run_folder import RunFolder
from lingua.train import train
from lingua.training import resume


class Creates:
    """Unpickling it creates `path` (what a crafted checkpoint would do, with a shell command instead)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def _train_state(step: int, tag: str) -> dict:
    return {"step": step, "data_tokens": 0, "data": {"tag": tag}}


def _saved(folder: Path, step: int = 1, seed: int = 0, tag: str = "old", keep: int = 1) -> Path:
    model, optimizer = _model_and_optimizer(seed)
    params = {"app": "apps.bert.train", "config": {}}
    return CheckpointManager(folder, CheckpointArgs(keep=keep)).save(step, model, optimizer, _train_state(step, tag),
                                                                      params)


def _crafted_metadata(checkpoint: Path, marker: Path, hidden: bool) -> None:
    """Replaces the checkpoint's .metadata with a pickle that creates `marker`: bare, or hidden in real metadata."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata() if hidden else None
    if hidden:
        metadata.storage_meta = Creates(marker)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata if hidden else Creates(marker)))
    (checkpoint / MANIFEST).unlink()  # or its sizes rewritten: a crafted folder is consistent with itself


@pytest.mark.parametrize("hidden", [False, True], ids=["bare", "inside_real_metadata"])
def test_crafted_metadata_runs_no_code_when_opened(tmp_path, hidden, capsys):
    checkpoint, marker = _saved(tmp_path / "checkpoints"), tmp_path / "ran"
    _crafted_metadata(checkpoint, marker, hidden)
    with pytest.raises(UserError) as refused:
        Checkpoint.open(checkpoint)
    assert not marker.exists()
    assert f"checkpoint {checkpoint} is damaged: .metadata: UnpicklingError: refused " in str(refused.value)
    assert len(str(refused.value).splitlines()) == 1
    with pytest.raises(SystemExit) as exit_info:  # python -m lingua.checkpoint consolidate
        checkpoint_main(["consolidate", str(tmp_path), str(tmp_path / "out.pt")])
    with pytest.raises(SystemExit) as export_exit:  # python -m lingua.export
        export_main([f"ckpt={tmp_path}", f"out={tmp_path / 'hf'}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == export_exit.value.code == 2
    assert err.count("error: ") == 2 and err.count(".metadata: UnpicklingError: refused") == 2, err
    assert len(err.splitlines()) == 2 and not marker.exists()


def test_crafted_metadata_refused_by_init_from(corpus, tmp_path):
    checkpoint, marker = _saved(tmp_path / "other" / "checkpoints"), tmp_path / "ran"
    _crafted_metadata(checkpoint, marker, hidden=False)
    argv = [*tiny_argv(corpus, tmp_path / "run", steps=1), f"init_from={checkpoint}"]
    with pytest.raises(UserError) as refused:
        train(APP, load_config(APP.args_cls, argv))
    assert not marker.exists()
    assert str(refused.value).startswith(f"init_from: checkpoint {checkpoint} is damaged: .metadata: UnpicklingError: "
                                         "refused io.open: ")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_crafted_optimizer_item_runs_no_code_when_resumed(tmp_path):
    """DCP stores the optimizer's hyper-parameters as pickles, and its planner unpickles them without restriction."""
    marker, folder = tmp_path / "ran", tmp_path / "0000000001"
    model, optimizer = _model_and_optimizer(0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    optim_sd["param_groups"][0]["lr"] = Creates(marker)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    (folder / "params.json").write_text(json.dumps({"app": "apps.bert.train", "config": {}}))
    with pytest.raises(DamagedCheckpoint) as refused:
        Checkpoint.read(folder).load_training(*_model_and_optimizer(1))
    assert not marker.exists()
    assert str(refused.value) == "UnpicklingError: item optim.param_groups.0.lr is not plain data (refused io.open)"


def test_real_checkpoint_loads_through_the_safe_reader(tmp_path):
    """Its metadata and optimizer hyper-parameters are all of what the safe reader allows."""
    path = _saved(tmp_path, seed=0)
    model, optimizer = _model_and_optimizer(1)
    assert Checkpoint.read(path).load_training(model, optimizer) == [_train_state(1, "old")]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model_and_optimizer(0)[0].parameters()))
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("saved", [{"step": 1, "data_tokens": 0}, {"step": 1, "data_tokens": 0, "data": None},
                                   {"step": "1", "data_tokens": 0, "data": {}}], ids=["missing", "none", "wrong_type"])
def test_a_train_state_without_the_fields_every_state_holds_is_damaged(tmp_path, saved):
    """The fields TrainState marks as always saved, of their annotated types, are checked when a checkpoint loads."""
    assert TrainState.saved_fields() == {"step": int, "data": dict, "data_tokens": int}
    path = _saved(tmp_path)
    (path / "train_state_00000.json").write_text(json.dumps(saved))
    (path / MANIFEST).unlink()
    with pytest.raises(DamagedCheckpoint, match="train_state_00000.json does not hold step, data, data_tokens"):
        Checkpoint.read(path).load_training(*_model_and_optimizer(1))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A finished one-step run: its checkpoint 0000000001 and its consolidated.pt."""
    root = tmp_path_factory.mktemp("tiny_run")
    train(APP, load_config(APP.args_cls, tiny_argv(write_corpus(root / "data"), root / "run", steps=1)))
    return root / "run"


def _run_and_other_run(tiny_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two copies of the run: the one a crafted file is put into, and another run beside it."""
    return (shutil.copytree(tiny_run, tmp_path / "run", symlinks=True),
            shutil.copytree(tiny_run, tmp_path / "other_run", symlinks=True))


def _storage_paths_to(checkpoint: Path, path: str) -> None:
    """Rewrites the checkpoint's .metadata so that every item lies in `path` (relative to the folder, or absolute)."""
    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    metadata.storage_data = {index: dataclasses.replace(info, relative_path=path)
                             for index, info in metadata.storage_data.items()}
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    (checkpoint / MANIFEST).unlink()


@pytest.mark.parametrize("named", ["relative", "absolute"])
def test_a_storage_path_outside_the_checkpoint_is_not_read(tiny_run, tmp_path, named, capsys):
    """.metadata pointing at another run's shard (its own shard gone): the checkpoint is damaged, never loaded with
    the other run's weights."""
    run, other = _run_and_other_run(tiny_run, tmp_path)
    checkpoint, shard = run / "checkpoints" / "0000000001", other / "checkpoints" / "0000000001" / "__0_0.distcp"
    _storage_paths_to(checkpoint, "../../../other_run/checkpoints/0000000001/__0_0.distcp" if named == "relative"
                      else str(shard))
    (checkpoint / "__0_0.distcp").unlink()
    with pytest.raises(DamagedCheckpoint, match=r"^\.metadata: RefusedFile: .*__0_0\.distcp lies outside "):
        Checkpoint.read(checkpoint)
    with pytest.raises(SystemExit) as exit_info:
        checkpoint_main(["consolidate", str(checkpoint), str(tmp_path / "out.pt")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "lies outside" in err, err
    assert not (tmp_path / "out.pt").exists()


def _link_out(file: Path, target: Path) -> None:
    file.unlink()
    file.symlink_to(target)


@pytest.mark.parametrize("file", ["params.json", "train_state_00000.json", "manifest", "consolidated.pt"])
def test_a_file_a_checkpoint_names_is_not_read_through_a_link_out_of_its_folder(tiny_run, tmp_path, file):
    run, other = _run_and_other_run(tiny_run, tmp_path)
    checkpoint, elsewhere = run / "checkpoints" / "0000000001", other / "checkpoints" / "0000000001"
    if file == "consolidated.pt":  # a finished run whose checkpoints are gone: its weights are there
        _link_out(run / file, other / file)
        shutil.rmtree(run / "checkpoints")
        with pytest.raises(UserError, match=f"^run {re.escape(str(run))} is damaged: .*consolidated.pt lies outside "):
            Checkpoint.open(run)
        return
    if file == "manifest":  # the manifest lists a file of the other run (and its size)
        name = "../../../other_run/checkpoints/0000000001/params.json"
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        (checkpoint / MANIFEST).write_text(json.dumps({**manifest, name: (elsewhere / PARAMS).stat().st_size}))
        expected = f"^{MANIFEST} names {re.escape(name)}: .* lies outside "
    else:
        _link_out(checkpoint / file, elsewhere / file)
        (checkpoint / MANIFEST).unlink()
        expected = f"^{re.escape(str(checkpoint / file))} lies outside "
    with pytest.raises(DamagedCheckpoint, match=expected):
        Checkpoint.read(checkpoint).load_training(*_tiny_model_and_optimizer(run))


def _tiny_model_and_optimizer(run: Path):
    model = load_model(Checkpoint.open(run / "consolidated.pt"))[0]
    return model, torch.optim.AdamW(model.parameters())


@pytest.mark.parametrize("fifo", ["storage_file", ".metadata", "params.json", "consolidated.pt"])
def test_a_fifo_a_checkpoint_names_is_refused_not_waited_on(tiny_run, tmp_path, fifo):
    """`consolidate` of a checkpoint (`export` of a finished run) with a FIFO where a file should be: one line, at
    once (it used to wait for a writer for ever; here a hang fails the test at the timeout)."""
    run, _ = _run_and_other_run(tiny_run, tmp_path)
    checkpoint = run / "checkpoints" / "0000000001"
    if fifo == "storage_file":
        _storage_paths_to(checkpoint, "pipe")
        path = checkpoint / "pipe"
    else:
        path = (run if fifo == "consolidated.pt" else checkpoint) / fifo
        path.unlink()
        (checkpoint / MANIFEST).unlink(missing_ok=True)
    os.mkfifo(path)
    if fifo == "consolidated.pt":
        shutil.rmtree(run / "checkpoints")
        command = ["lingua.export", f"ckpt={run}", f"out={tmp_path / 'out'}"]  # the weights of a finished run
    else:
        command = ["lingua.checkpoint", "consolidate", str(checkpoint), str(tmp_path / "out")]
    done = run_to_the_end([sys.executable, "-m", *command], timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, \
        done.stderr[-2000:]
    assert f"{path} is not a regular file" in done.stderr and not (tmp_path / "out").exists()


FILESYSTEM_OPERATIONS = [(os, "replace"), (os, "rename"), (os, "fsync"), (os, "mkdir"), (os, "unlink"),
                         (os, "rmdir"), (shutil, "rmtree")]


@contextlib.contextmanager
def killed_before(n: int):
    """The filesystem operations of a save counted; the n-th (from 1) is not done: the process is killed."""
    with counting_kills(n, FILESYSTEM_OPERATIONS) as calls, contextlib.suppress(Killed, UserError):
        yield calls  # UserError: DCP turned the kill into a failed save


@pytest.mark.parametrize("existing_step", [1, 2], ids=["new_step", "same_step_again"])
def test_a_kill_at_any_moment_of_a_save_leaves_the_newest_checkpoint(tmp_path, existing_step):
    """keep=1: after a kill between any two filesystem operations of saving step 2, the next start finds step 2
    (the new copy, or the old one of a step saved again), else step 1: never nothing."""
    base = tmp_path / "base"
    _saved(base, existing_step, seed=0, tag="old")
    model, optimizer = _model_and_optimizer(1)
    save = lambda folder: CheckpointManager(folder, CheckpointArgs(keep=1)).save(  # noqa: E731
        2, model, optimizer, _train_state(2, "new"), {"app": "apps.bert.train", "config": {}})
    with killed_before(10**9) as operations:
        save(tmp_path / "count")
    assert operations[0] > 5
    for n in range(1, operations[0] + 2):
        folder = tmp_path / f"killed_before_{n}"
        shutil.copytree(base, folder)
        with killed_before(n):
            save(folder)
        manager = CheckpointManager(folder, CheckpointArgs(keep=1))
        manager.remove_leftovers()  # what the next start does
        latest = manager.latest()
        assert latest is not None, f"killed before operation {n}: no checkpoint left"
        assert all(p.name.isdigit() for p in folder.iterdir()), n  # no leftover
        verify(latest)
        state = manager.load(latest, *_model_and_optimizer(2))[0]
        found = (state["step"], state["data"]["tag"])
        assert found in [(2, "new"), (existing_step, "old")], (n, found)
        assert n <= operations[0] or found == (2, "new")


def test_a_kill_while_saving_a_step_again_keeps_the_run_and_its_metrics(corpus, tmp_path):
    """The kill window between the two renames of a step saved again: the run resumes from that step and keeps its
    metrics (with keep=1 it used to restart from step 0 and cut metrics.jsonl)."""
    dump = tmp_path / "run"
    argv = [*tiny_argv(corpus, dump, steps=2), "checkpoint.keep=1"]
    train(APP, load_config(APP.args_cls, argv))
    (dump / "consolidated.pt").unlink()  # as if stopped at step 2 of a longer run
    checkpoint = dump / "checkpoints" / "0000000002"
    shutil.copytree(checkpoint, checkpoint.with_name("0000000002.tmp"))
    checkpoint.rename(checkpoint.with_name("0000000002.replaced"))
    logged = (dump / "metrics.jsonl").read_text().splitlines()
    assert train(APP, load_config(APP.args_cls, [*argv, "steps=3"]))["steps"] == 3
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    assert lines[:len(logged)] == logged  # kept as they were, timings included: not logged again
    assert {json.loads(line)["step"] for line in lines[len(logged):]} == {3}
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["0000000003"]


def _fsync_and_rename_log(patch: pytest.MonkeyPatch) -> list[tuple[str, Path]]:
    """('fsync', path) for every os.fsync, ('replace', destination) for every os.replace, ('rmtree', path)."""
    log: list[tuple[str, Path]] = []
    fsync, replace, rmtree = os.fsync, os.replace, shutil.rmtree

    def logged_fsync(descriptor):
        log.append(("fsync", Path(os.readlink(f"/proc/self/fd/{descriptor}"))))
        fsync(descriptor)

    def logged_replace(source, destination):
        replace(source, destination)
        log.append(("replace", Path(destination).resolve()))

    def logged_rmtree(path, *args, **kwargs):
        log.append(("rmtree", Path(path).resolve()))
        rmtree(path, *args, **kwargs)

    patch.setattr(os, "fsync", logged_fsync)
    patch.setattr(os, "replace", logged_replace)
    patch.setattr(shutil, "rmtree", logged_rmtree)
    return log


def test_a_save_is_on_disk_before_it_is_published_and_before_older_ones_go(tmp_path, monkeypatch):
    folder = tmp_path.resolve() / "checkpoints"
    _saved(folder, 1)
    log = _fsync_and_rename_log(monkeypatch)
    _saved(folder, 2)
    tmp, final = folder / "0000000002.tmp", folder / "0000000002"
    published = log.index(("replace", final))
    pruned = log.index(("replace", folder / "0000000001.deleting"))
    for name in ("params.json", "train_state_00000.json", MANIFEST):
        synced = [i for i, (op, path) in enumerate(log) if op == "fsync" and path.parent == tmp
                  and path.name.startswith(name)]
        written = log.index(("replace", tmp / name))
        assert synced and synced[0] < written < log.index(("fsync", tmp), written) < published, name
    assert published < log.index(("fsync", folder), published) < pruned
    assert published < log.index(("fsync", folder.parent), published) < pruned


def test_atomic_write_flushes_the_file_then_its_folder(tmp_path, monkeypatch):
    path = tmp_path.resolve() / "out.json"
    log = _fsync_and_rename_log(monkeypatch)
    atomic_write(path, "{}")
    assert [op for op, _ in log] == ["fsync", "replace", "fsync"]
    assert log[0][1].name.startswith("out.json.tmp") and log[1:] == [("replace", path), ("fsync", tmp_path.resolve())]


def test_metrics_lines_that_are_not_records_are_skipped(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n"text"\n7\n{"step": "x"}\n{"step": 2, "loss": 1.5}\n'
                    + "[" * 100_000 + '\n{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="lingua.metrics"):
        records = read_metrics(path)
    assert records == [{"step": 1, "loss": 2.0}, {"step": "x"}, {"step": 2, "loss": 1.5}]
    assert [r.getMessage() for r in caplog.records] == [f"{path}: skipped 5 line(s) that are not JSON objects"]
    with MetricLogger(path, 1, LoggingArgs(), {}):  # a resume keeps the records up to its step, drops the rest
        pass
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}]


TWO_RANKS_SAVE = '''
import sys

import torch
import torch.distributed as dist

from lingua.checkpoint import store as checkpoint
from lingua.errors import UserError
from lingua.checkpoint.store import CheckpointArgs, CheckpointManager

dist.init_process_group("gloo")
rank, how, fence_checks = dist.get_rank(), sys.argv[2], []


def fence():  # rank 0's lease, taken over between the first stage of the save and the second
    fence_checks.append(1)
    return "the run's lease was taken over" if how == "lease lost" and len(fence_checks) > 1 else None


if how == "ctrl_c on rank 1":  # after DCP's part (which hands an interruption to every rank), writing its state
    def interrupted(path, data):
        raise KeyboardInterrupt
    if rank == 1:
        checkpoint.atomic_write = interrupted
model, outcome = torch.nn.Linear(4, 4), "saved"
try:
    CheckpointManager(sys.argv[1], CheckpointArgs(), fence).save(
        10, model, torch.optim.AdamW(model.parameters()), {"step": 10}, {"app": "apps.bert.train", "config": {}})
except UserError as e:
    outcome = f"stopped: {e}"
except KeyboardInterrupt:
    outcome = "interrupted"
with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
    f.write(outcome)
'''


@pytest.mark.parametrize("how", ["lease lost", "ctrl_c on rank 1"])
def test_every_rank_of_a_save_stops_the_same_way(tmp_path, how):
    """Only rank 0 checked the lease: finding it lost, it skipped the write while the others waited in DCP's
    collectives for it (a hang). A second Ctrl-C on one rank stopped that rank with 130, the others with 2."""
    script = tmp_path / "save.py"
    script.write_text(TWO_RANKS_SAVE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(tmp_path / "checkpoints"), how]
    result = run_to_the_end(cmd, timeout=120)
    said = [(tmp_path / f"checkpoints.rank{rank}").read_text() for rank in (0, 1)]
    if how == "lease lost":
        assert said == ["stopped: the run's lease was taken over"] * 2, result.stderr[-2000:]
    else:
        assert said == ["interrupted"] * 2, result.stderr[-2000:]
        assert not (tmp_path / "checkpoints" / "0000000010.tmp").exists()
    assert not (tmp_path / "checkpoints" / "0000000010").exists()


def test_an_io_error_reading_a_consolidated_file_is_not_taken_for_another_file(tmp_path, monkeypatch):
    path = tmp_path / "consolidated.pt"
    path.write_bytes(b"weights")

    def failing_load(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(torch, "load", failing_load)
    with pytest.raises(UserError) as refused:
        Checkpoint.open(path)
    assert str(refused.value) == f"cannot read {path}: Input/output error"


def test_a_file_gone_since_the_checkpoint_was_listed_is_damage(tmp_path, monkeypatch):
    """A FileNotFoundError from a checkpoint's read (its file deleted since the folder was listed) escaped the
    resume as a bare OSError."""
    checkpoint = _saved(tmp_path / "run" / "checkpoints", step=10)

    def gone(path):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path / "train_state_00000.json"))
    monkeypatch.setattr(resume, "verify", gone)
    assert resume.resumed_config(RunFolder(tmp_path / "run")) is None  # damaged: resume() sets it aside
    with pytest.raises(DamagedCheckpoint, match="^train_state_00000.json is missing$"):
        resume.retrying_reads(lambda: gone(checkpoint), checkpoint)
