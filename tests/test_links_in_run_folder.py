"""A run folder someone sent may hold links where the library writes (train.log, metrics.jsonl, config.yaml,
checkpoints/, the evaluation folders, ...): none is followed out of the folder; each is refused in one line before
anything is written. A link at a checkpoint is not the run's, and a FIFO is refused, never waited on."""

import os
import shutil
from pathlib import Path

import pytest
from conftest import tiny_argv, write_corpus
from test_faults import assert_one_line, run_main

from apps.bert.train import APP as BERT
from lingua import train as loop
from lingua.checkpoint.store import Checkpoint, CheckpointArgs, CheckpointManager
from lingua.errors import UserError
from lingua.export.card import last_metrics
from lingua.files.safe import atomic_write
from lingua.run_folder import RunFolder
from tools.eval import embeddings as embeddings_command
from tools.eval import glue as glue_command
from tools.eval import mteb as mteb_command

OUTSIDE = "someone's file, outside the run\n"
GLUE = Path(__file__).parent / "fixtures" / "glue"


@pytest.fixture(scope="module")
def sent_run(tmp_path_factory):
    """A real tiny run's dump_dir as someone sends it: 10 steps, its checkpoint resumes to 20."""
    root = tmp_path_factory.mktemp("sent")
    corpus = write_corpus(root / "data")
    dump = root / "run"
    loop.main(BERT, tiny_argv(corpus, dump, steps=10))
    (dump / "consolidated.pt").unlink()
    return corpus, dump


@pytest.mark.parametrize("name", ["train.log", "metrics.jsonl", "config.yaml"])
def test_a_link_in_a_received_run_is_refused_on_resume(sent_run, tmp_path, capsys, name):
    corpus, sent = sent_run
    dump = tmp_path / "run"
    shutil.copytree(sent, dump)
    outside = tmp_path / "outside.txt"
    outside.write_text(OUTSIDE)
    (dump / name).unlink()
    (dump / name).symlink_to(outside)
    files = lambda: {p.name: p.read_bytes() for p in dump.iterdir()  # noqa: E731
                     if p.is_file() and not p.is_symlink() and p.name != "train.log"}  # the log tells of the start
    before = files()
    status, err = run_main(tiny_argv(corpus, dump, steps=20), capsys)
    assert status == 2
    assert_one_line(err, f"{dump / name}: a symbolic link, which the library never writes through (delete it)")
    assert outside.read_text() == OUTSIDE and (dump / name).is_symlink()
    assert files() == before
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["0000000010"]


@pytest.mark.parametrize("planted", ["target", "temporary file"])
def test_atomic_write_never_writes_through_a_link(tmp_path, planted):
    outside = tmp_path / "outside.txt"
    outside.write_text(OUTSIDE)
    path = tmp_path / "run" / "best.json"
    path.parent.mkdir()
    link = path if planted == "target" else path.with_name(f"best.json.tmp{os.getpid()}")  # a predictable name
    link.symlink_to(outside)
    with pytest.raises(OSError) as refused:
        atomic_write(path, "{}")
    assert str(refused.value) == f"{link} is a symbolic link, which the library never writes through (delete it)"
    assert outside.read_text() == OUTSIDE and link.is_symlink()
    assert not path.exists() or path.is_symlink()


def _files_under(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("target", ["another run's checkpoints", "a missing folder"])
def test_a_link_at_checkpoints_is_refused_before_anything_is_written(sent_run, tmp_path, capsys, target):
    """A received run whose checkpoints/ links to another run's: its checkpoints were written there, and the older
    ones of that run pruned."""
    corpus, sent = sent_run
    dump, other = tmp_path / "run", tmp_path / "other" / "checkpoints"
    shutil.copytree(sent, dump)
    if target == "another run's checkpoints":
        shutil.copytree(sent / "checkpoints", other)
    shutil.rmtree(dump / "checkpoints")
    (dump / "checkpoints").symlink_to(other)
    before, others = _files_under(dump), _files_under(tmp_path / "other") if other.exists() else {}
    status, err = run_main(tiny_argv(corpus, dump, steps=20) + ["checkpoint.keep=1"], capsys)
    assert status == 2
    assert_one_line(err, f"{dump / 'checkpoints'} is a symbolic link, which the library never writes through "
                         "(delete it; to keep checkpoints on another disk, put the whole dump_dir there)")
    assert (_files_under(tmp_path / "other") if other.exists() else {}) == others
    assert {k: v for k, v in _files_under(dump).items() if k.name != "train.log"} == \
        {k: v for k, v in before.items() if k.name != "train.log"}


@pytest.mark.parametrize("linked", ["glue_eval", "glue_eval/0000000010", "glue_eval/cache"])
def test_a_probe_is_never_filed_through_a_link_in_the_run(sent_run, tmp_path, capsys, linked):
    _, sent = sent_run
    dump, outside = tmp_path / "run", tmp_path / "another run's folder"
    shutil.copytree(sent, dump)
    outside.mkdir()
    (dump / linked).parent.mkdir(parents=True, exist_ok=True)
    (dump / linked).symlink_to(outside)
    with pytest.raises(SystemExit) as exit_status:
        glue_command.main([f"ckpt={dump}", f"data={GLUE}", "tasks=rte", "probes=linear"])
    assert exit_status.value.code == 2
    assert_one_line(capsys.readouterr().err,
                    f"{dump / linked} is a symbolic link, which the library never writes through (delete it)")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("kind", ["embedding", "mteb"])
def test_other_evaluations_are_never_filed_through_a_link_in_the_run(sent_run, tmp_path, kind):
    _, sent = sent_run
    dump, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(sent, dump)
    outside.mkdir()
    (dump / f"{kind}_eval").symlink_to(outside)
    with pytest.raises(UserError, match="is a symbolic link, which the library never writes through"):
        if kind == "embedding":
            embeddings_command.output_path("", dump / "checkpoints" / "0000000010")
        else:
            mteb_command.output_dir(mteb_command.MtebCommandArgs(ckpt=str(dump)))


def test_a_step_folder_that_links_to_another_runs_checkpoint_is_not_the_runs(sent_run, tmp_path):
    """It was listed (is_dir follows links) and its shards read: the checks that files lie inside the checkpoint
    resolved its folder first."""
    _, sent = sent_run
    dump = tmp_path / "run"
    shutil.copytree(sent, dump)
    shutil.rmtree(dump / "checkpoints" / "0000000010")
    (dump / "checkpoints" / "0000000010").symlink_to(sent / "checkpoints" / "0000000010")
    assert CheckpointManager(dump / "checkpoints", CheckpointArgs()).complete_checkpoints() == []
    with pytest.raises(UserError, match="no complete checkpoint"):
        Checkpoint.open(dump)


def test_a_fifo_at_metrics_is_refused_on_resume_not_waited_on(sent_run, tmp_path, capsys):
    corpus, sent = sent_run
    dump = tmp_path / "run"
    shutil.copytree(sent, dump)
    (dump / "metrics.jsonl").unlink()
    os.mkfifo(dump / "metrics.jsonl")
    status, err = run_main(tiny_argv(corpus, dump, steps=20), capsys)
    assert status == 2
    assert_one_line(err, f"metrics file {dump / 'metrics.jsonl'} is not a regular file")
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["0000000010"]


@pytest.mark.parametrize("metrics", ["not UTF-8", "fifo"])
def test_the_model_card_reads_any_metrics_file(tmp_path, metrics):
    run = RunFolder(tmp_path)
    if metrics == "fifo":
        os.mkfifo(run.metrics)
    else:
        run.metrics.write_bytes(b'{"step": 1, "data_tokens": 8}\n\xff\xfe\n{"step": 2, "data_tokens": 16}\n\xff\n')
    assert last_metrics(run) == (None if metrics == "fifo" else {"step": 2, "data_tokens": 16})
