"""A run folder someone sent may hold links where the library writes (train.log, metrics.jsonl, config.yaml, ...):
none is followed out of the folder; each is refused in one line before anything is written."""

import os
import shutil

import pytest
from conftest import tiny_argv, write_corpus
from test_faults import assert_one_line, run_main

from apps.bert.train import APP as BERT
from lingua import train as loop
from lingua.files import atomic_write

OUTSIDE = "someone's file, outside the run\n"


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
