import json
import logging

import pytest
import torch

from lingua.data.loader import DataArgs, ReadAhead, build_train_loader, load_validation
from lingua.data.tokenizer import BytesTokenizer, TokenizerArgs, build_tokenizer
from lingua.errors import UserError

BOS, EOS = 256, 257  # <s> and </s> of the "bytes" tokenizer, whose other ids are the UTF-8 bytes


TOK = build_tokenizer(TokenizerArgs(name="bytes"))


def write_source(root, name, chunks, valid=()):
    """chunks: one list of lines per train chunk; a str line is wrapped as a document, bytes are written raw."""
    folder = root / name
    folder.mkdir(parents=True)
    for i, lines in enumerate(chunks):
        raw = [ln if isinstance(ln, bytes) else (json.dumps({"text": ln}) + "\n").encode() for ln in lines]
        (folder / f"train.{i:05d}.jsonl").write_bytes(b"".join(raw))
    (folder / "valid.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in valid))


def stream(batches) -> list[int]:
    return [t for b in batches for t in b.flatten().tolist()]


def split_docs(tokens: list[int]) -> list[str]:
    """Complete documents in a token stream (the unfinished tail is dropped)."""
    docs, cur = [], []
    for t in tokens:
        if t == EOS:
            docs.append(bytes(cur).decode())
            cur = []
        elif t != BOS:
            cur.append(t)
    return docs


def take(loader, n):
    return [next(loader) for _ in range(n)]


def texts(n, prefix="doc"):
    # uneven lengths, so rows cut documents and byte ranges cut lines at varying places
    return [f"{prefix}{i}-" + "x" * (i * 7 % 23) for i in range(n)]


def test_packing_is_the_exact_document_stream(tmp_path):
    docs = texts(40)
    write_source(tmp_path, "a", [docs[:25], docs[25:]])
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 1.0}, seq_len=7, batch_size=3, prefetch=2)
    with build_train_loader(args, TOK, 0, 1) as loader:
        batches = take(loader, 20)
    assert all(b.shape == (3, 7) and b.dtype == torch.long for b in batches)
    expected = [t for d in docs for t in [BOS, *d.encode(), EOS]]
    assert stream(batches) == expected[: 20 * 3 * 7]


def epoch_docs(tmp_path, rank, world_size):
    """The documents one rank sees in its first epoch (they repeat, in order, once the epoch ends)."""
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 1.0}, seq_len=16, batch_size=2, prefetch=1)
    with build_train_loader(args, TOK, rank, world_size) as loader:
        tokens = []
        while True:
            tokens += stream(take(loader, 1))
            docs = split_docs(tokens)
            if docs[0] in docs[1:]:
                assert loader.state_dict()["sources"]["a"]["epoch"] >= 1
                assert loader.malformed_lines == 0  # no rank starts reading in the middle of a line
                return docs[: docs.index(docs[0], 1)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("chunk_sizes", [[17], [12, 5], [1, 6, 0, 7, 3]])
def test_each_line_is_read_by_exactly_one_rank(tmp_path, world_size, chunk_sizes):
    docs = texts(17)
    bounds = [sum(chunk_sizes[:i]) for i in range(len(chunk_sizes) + 1)]
    write_source(tmp_path, "a", [docs[lo:hi] for lo, hi in zip(bounds, bounds[1:])])
    per_rank = [epoch_docs(tmp_path, r, world_size) for r in range(world_size)]
    seen = [d for docs_r in per_rank for d in docs_r]
    assert sorted(seen) == sorted(docs)  # all of them, none twice
    assert seen == docs  # ranks own contiguous slices, in file order


def test_too_many_ranks_for_the_data_is_a_user_error(tmp_path):
    write_source(tmp_path, "a", [["one", "two"]])
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 1.0}, seq_len=4, batch_size=1)
    with pytest.raises(UserError, match="too small"):
        build_train_loader(args, TOK, 2, 3)


MALFORMED = [b"{not json\n", b'{"title": "no text"}\n', b'{"text": 5}\n', b'{"text": "bad \xff\xfe bytes"}\n', b"\n",
             b"[1, 2]\n", b'{"text": "past the digit limit", "n": ' + b"7" * 5000 + b"}\n", b"[" * 100_000 + b"\n"]


def test_malformed_lines_are_counted_once_with_the_first_reported_at_once(tmp_path, caplog):
    write_source(tmp_path, "a", [["first", *MALFORMED[:6], "second", b'{"text": "last, no newline"}'],
                                 [*MALFORMED[6:], "third"]])  # 40 tokens of documents per epoch
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 1.0}, seq_len=5, batch_size=2, prefetch=2)
    with caplog.at_level(logging.WARNING), build_train_loader(args, TOK, 0, 1) as loader:
        assert loader.malformed_lines == 0
        batches = take(loader, 2)  # 20 tokens: <s>first</s>, <s>second</s>, part of the last document
        assert loader.malformed_lines == 6
        state = loader.state_dict()
        batches += take(loader, 8)  # two epochs and a half: the same lines again, not counted again
        assert loader.malformed_lines == 8 and loader.state_dict()["sources"]["a"]["malformed_lines"] == 8
    assert split_docs(stream(batches)) == ["first", "second", "last, no newline", "third"] * 2 + ["first", "second"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # the first of each file as it is met, with why; the file's count when it ends
    assert warnings[0].endswith("train.00000.jsonl: skipped a malformed line at byte 18 (not valid JSON (Expecting "
                                "property name enclosed in double quotes at line 1, column 2)); the progress lines "
                                "count those skipped")
    assert "train.00000.jsonl: skipped 6 malformed lines" in warnings[1] and "the first at byte 18" in warnings[1]
    assert warnings[2].endswith("train.00001.jsonl: skipped a malformed line at byte 0 (holds a number of more than "
                                "4300 digits); the progress lines count those skipped")
    assert "train.00001.jsonl: skipped 2 malformed lines" in warnings[3] and "the first at byte 0" in warnings[3]
    with build_train_loader(args, TOK, 0, 1, state=state) as loader:  # a resumed run counts on exactly
        assert all(torch.equal(a, b) for a, b in zip(take(loader, 8), batches[2:]))
        assert loader.malformed_lines == 8


def resume_args(tmp_path, **kw):
    write_source(tmp_path, "a", [texts(9, "a"), texts(4, "A"), texts(6, "aa")])
    write_source(tmp_path, "b", [["b" * 50, "short", "b" * 31]])  # documents longer than a row
    return DataArgs(root_dir=str(tmp_path), sources={"a": 2.0, "b": 1.0}, seq_len=12, batch_size=3, **kw)


@pytest.mark.parametrize("n", [1, 7, 30])  # 30 batches run past the end of an epoch of both sources
def test_resume_gives_exactly_the_next_batches(tmp_path, n):
    args = resume_args(tmp_path, prefetch=4)
    with build_train_loader(args, TOK, 1, 2) as loader:
        reference = take(loader, n + 10)
    with build_train_loader(args, TOK, 1, 2) as loader:
        take(loader, n)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["sources"]["b"]["epoch"] >= (n == 30)
    with build_train_loader(args, TOK, 1, 2, state=state) as loader:
        resumed = take(loader, 10)
    assert all(torch.equal(a, b) for a, b in zip(resumed, reference[n:]))


def test_resume_without_prefetch_thread(tmp_path):
    args = resume_args(tmp_path, prefetch=0)
    with build_train_loader(args, TOK, 0, 1) as loader:
        reference = take(loader, 8)
    with build_train_loader(args, TOK, 0, 1) as loader:
        take(loader, 5)
        state = loader.state_dict()
    with build_train_loader(args, TOK, 0, 1, state=state) as loader:
        assert all(torch.equal(a, b) for a, b in zip(take(loader, 3), reference[5:]))


def test_state_from_other_rank_is_refused(tmp_path):
    args = resume_args(tmp_path, prefetch=0)
    with build_train_loader(args, TOK, 0, 2) as loader:
        state = loader.state_dict()
    with pytest.raises(UserError, match="rank 0 of 2"):
        build_train_loader(args, TOK, 1, 2, state=state)


def test_source_weights_are_respected(tmp_path):
    write_source(tmp_path, "a", [["a" * 10] * 20])
    write_source(tmp_path, "b", [["b" * 10] * 20])
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 3.0, "b": 1.0}, seq_len=4, batch_size=16, prefetch=2)
    with build_train_loader(args, TOK, 0, 1) as loader:
        rows = torch.cat(take(loader, 50))
    from_a = sum(ord("a") in row.tolist() for row in rows)
    assert 0.70 < from_a / len(rows) < 0.80


def test_missing_paths_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        build_train_loader(DataArgs(root_dir=str(tmp_path / "nowhere"), sources={"a": 1.0}), TOK, 0, 1)
    with pytest.raises(UserError, match="missing"):
        build_train_loader(DataArgs(root_dir=str(tmp_path), sources={"missing": 1.0}), TOK, 0, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no shard file"):
        build_train_loader(DataArgs(root_dir=str(tmp_path), sources={"empty": 1.0}), TOK, 0, 1)
    (tmp_path / "empty" / "train.00000.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(UserError, match="valid.jsonl"):
        load_validation(DataArgs(root_dir=str(tmp_path), sources={"empty": 1.0}), TOK, 2)


class FailingTokenizer(BytesTokenizer):
    def encode(self, text):
        if text == "boom":
            raise RuntimeError("tokenizer failed")
        return super().encode(text)


def test_background_errors_reach_the_caller(tmp_path):
    write_source(tmp_path, "a", [["fine"] * 3 + ["boom"]])
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 1.0}, seq_len=6, batch_size=1, prefetch=2)
    loader = build_train_loader(args, FailingTokenizer(), 0, 1)
    assert next(loader).tolist() == [[BOS, *b"fine", EOS]]
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        take(loader, 5)
    with pytest.raises(RuntimeError, match="tokenizer failed"):  # and again, instead of hanging
        next(loader)
    loader.close()
    assert not loader._thread.is_alive()


def test_source_without_any_valid_document_is_a_user_error(tmp_path):
    write_source(tmp_path, "a", [[b"junk\n", b"\n"]])
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 1.0}, seq_len=4, batch_size=1, prefetch=1)
    with build_train_loader(args, TOK, 0, 1) as loader, pytest.raises(UserError, match="no valid") as error:
        next(loader)
    assert str(tmp_path / "a") in str(error.value) and "\n" not in str(error.value)


def test_validation_is_fixed_weighted_and_rank_disjoint(tmp_path):
    write_source(tmp_path, "a", [["x"]], valid=texts(30, "va"))
    write_source(tmp_path, "b", [["x"]], valid=texts(30, "vb"))
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 3.0, "b": 1.0}, seq_len=8)
    val = load_validation(args, TOK, 4).tokens
    assert val.shape == (4, 8) and torch.equal(val, load_validation(args, TOK, 4).tokens)
    a_stream = [t for d in texts(30, "va") for t in [BOS, *d.encode(), EOS]]
    assert val[:3].flatten().tolist() == a_stream[:24]  # 3 rows from a, 1 from b
    assert val[3, 0] == BOS and bytes(val[3, 1:3].tolist()) == b"vb"
    ranks = [load_validation(args, TOK, 4, rank=r, world_size=2).tokens for r in range(2)]
    assert torch.equal(ranks[0], val)
    assert ranks[1][:3].flatten().tolist() == a_stream[24:48]
    with pytest.raises(UserError, match="valid.jsonl"):
        load_validation(args, TOK, 400)


def _shrink(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _replace(path):
    replacement = path.with_name("new.tmp")
    replacement.write_bytes(path.read_bytes())
    replacement.replace(path)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("change, message", [
    (_shrink, "shrank under the running job"),
    (lambda path: path.unlink(), "vanished under the running job"),
    (_replace, "was replaced or changed under the running job"),
])
def test_a_file_that_changes_under_the_loader_is_one_line_not_a_loop(tmp_path, prefetch, change, message):
    """A chunk truncated while it is read, removed or replaced: `prepare` says so (the loop agrees on it over the
    ranks before the next step) and `next` raises it, within one pass over the data; nothing loops on empty reads."""
    docs = [f"doc{i}-" + "y" * 500 for i in range(40)]  # chunks larger than a read buffer
    write_source(tmp_path, "a", [docs[:20], docs[20:]])
    args = DataArgs(root_dir=str(tmp_path), sources={"a": 1.0}, seq_len=16, batch_size=2, prefetch=prefetch)
    chunk = tmp_path / "a" / "train.00000.jsonl"
    with ReadAhead(build_train_loader(args, TOK, 0, 1)) as loader:
        assert loader.prepare(3) is None
        take(loader, 3)  # reading chunk 0, which stays open
        change(chunk)
        failure = None
        for _ in range(2 * 21_000 // 32):  # one pass over the data, in batches of 32 tokens
            failure = loader.prepare(1)
            if failure:
                break
            next(loader)
        with pytest.raises(UserError) as error:
            take(loader, 10)
    assert failure.startswith(f"data file {chunk} {message}") and "\n" not in failure
    assert str(error.value) == failure


def test_read_ahead_gives_the_loaders_batches_and_the_state_of_those_taken(tmp_path):
    """The training loop's loader fetches (and, on a GPU, copies) batches ahead of the steps: it gives the loader's
    batches in order, and its state is that after the last batch taken, so a run saved while batches were fetched
    ahead resumes with the first of those. (The GPU's pinned copy on a side stream cannot run here; on the CPU a
    batch is the loader's.)"""
    args = resume_args(tmp_path, prefetch=2)
    with build_train_loader(args, TOK, 0, 1) as loader:
        reference = take(loader, 9)
    taken = []
    with ReadAhead(build_train_loader(args, TOK, 0, 1), torch.device("cpu")) as loader:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(3):
                assert loader.prepare(3) is None
                taken += take(loader, 2)
        assert len(loader.ready) == 1  # fetched, not taken
        state = loader.state_dict()
    assert "data/copy" in {event.name for event in profile.events()}
    assert all(torch.equal(a, b) for a, b in zip(taken, reference[:6], strict=True))
    with build_train_loader(args, TOK, 0, 1, state=state) as loader:
        assert all(torch.equal(a, b) for a, b in zip(take(loader, 3), reference[6:], strict=True))
