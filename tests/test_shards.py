"""Sources read in place: shards of .jsonl, .jsonl.gz, .jsonl.zst and .parquet, shared out whole per epoch from the
seed, documents shuffled in blocks; every training document once per epoch on any number of ranks, the held-out
shard never trained on, exact resume on the same number of ranks and on another, nothing opened before it is read."""

import json
import os
from pathlib import Path

import pytest
from conftest import write_shard

from lingua.data import documents as documents_module
from lingua.data.documents import MalformedLine, documents
from lingua.data.loader import DataArgs, TrainLoader, load_validation, repartition, source_files
from lingua.data.shard_stream import ShardStream, repartition_shards
from lingua.errors import UserError


class NumberTokenizer:
    """A document is a few numbers, each its own token: which documents a stream handed out is read off its tokens."""

    bos_id, eos_id = 0, 1

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]


TOK = NumberTokenizer()
FORMATS = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


def texts(first: int, n: int) -> list[str]:
    """Documents first..first+n-1, of 1 to 4 tokens each, no token shared between documents."""
    return [" ".join(str(10 + 4 * d + k) for k in range(1 + d % 4)) for d in range(first, first + n)]


def write_source(folder: Path, n_shards: int, docs_per_shard: int, first: int = 0) -> list[str]:
    """Shards of every format in turn; returns all documents, shard by shard in name order."""
    written = []
    for shard in range(n_shards):
        rows = texts(first + shard * docs_per_shard, docs_per_shard)
        write_shard(folder / f"part-{shard:03d}{FORMATS[shard % 4]}", rows)
        written += rows
    return written


def numbers(tokens) -> list[int]:
    return [t for t in tokens if t > 1]


def tokens_of_texts(docs: list[str]) -> list[int]:
    return [int(word) for doc in docs for word in doc.split()]


@pytest.mark.parametrize("suffix", FORMATS)
def test_each_format_reads_from_any_document(tmp_path, suffix):
    rows = texts(0, 12)
    rows[7] = None
    write_shard(tmp_path / f"s{suffix}", rows)
    for start in (0, 3, 5, 7, 11, 12, 20):
        got = list(documents(str(tmp_path / f"s{suffix}"), start=start))
        assert [g if isinstance(g, str) else None for g in got] == rows[start:], start
    assert isinstance(list(documents(str(tmp_path / f"s{suffix}")))[7], MalformedLine)
    if suffix != ".jsonl":  # a truncated shard: one line naming it, whatever the decoder raised
        data = (tmp_path / f"s{suffix}").read_bytes()
        (tmp_path / f"s{suffix}").write_bytes(data[: len(data) // 2])
        with pytest.raises(UserError, match=f"data file .*s{suffix} cannot be read: "):
            list(documents(str(tmp_path / f"s{suffix}")))


def test_the_sources_files_the_held_out_shard_and_a_glob(tmp_path):
    write_source(tmp_path / "web" / "a", 2, 3)
    write_source(tmp_path / "web" / "b", 1, 3)
    write_shard(tmp_path / "web" / ".cache" / "x.jsonl", texts(0, 2))  # a hub download's cache: not a shard
    found = source_files(DataArgs(root_dir=str(tmp_path), sources={"web": 1}), "web")
    assert (found.valid, found.train) == (["a/part-000.jsonl"], ["a/part-001.jsonl.gz", "b/part-000.jsonl"])
    globbed = source_files(DataArgs(root_dir=str(tmp_path), sources={"web/*/part-000*": 1}), "web/*/part-000*")
    assert (globbed.folder, globbed.valid, globbed.train) == (str(tmp_path / "web"), ["a/part-000.jsonl"],
                                                               ["b/part-000.jsonl"])
    write_shard(tmp_path / "web" / "valid.parquet", texts(0, 3))  # a named validation shard: no shard held out
    found = source_files(DataArgs(root_dir=str(tmp_path), sources={"web": 1}), "web")
    assert found.valid == ["valid.parquet"] and len(found.train) == 3
    rows = load_validation(DataArgs(root_dir=str(tmp_path), sources={"web": 1}, seq_len=4), TOK, 2)
    assert rows.tokens.tolist() == [[0, 10, 1, 0], [14, 15, 1, 0]]


def epoch_zero(stream: ShardStream) -> list[int]:
    """The tokens the stream hands out until its first epoch ends."""
    out = []
    while True:
        token = stream.take(1)
        if stream.epoch > 0:
            return out
        out += token


def shard_stream(tmp_path: Path, rank: int, world_size: int, **kwargs) -> ShardStream:
    found = source_files(DataArgs(root_dir=str(tmp_path), sources={"web": 1}), "web")
    options = {"seed": 3, "text_field": "text", "shuffle_buffer": 4} | kwargs
    return ShardStream("web", found.folder, found.train, rank, world_size, TOK, 100, **options)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_training_document_once_per_epoch_and_never_the_held_out_shard(tmp_path, world_size):
    docs = write_source(tmp_path / "web", 7, 9)
    read = [t for rank in range(world_size) for t in numbers(epoch_zero(shard_stream(tmp_path, rank, world_size)))]
    assert sorted(read) == sorted(tokens_of_texts(docs[9:]))  # shard 0 is the validation shard


def test_shards_and_documents_are_shuffled_from_the_seed(tmp_path):
    docs = write_source(tmp_path / "web", 5, 12)
    in_file_order = tokens_of_texts(docs[12:])
    first = numbers(epoch_zero(shard_stream(tmp_path, 0, 1)))
    assert first == numbers(epoch_zero(shard_stream(tmp_path, 0, 1)))  # the same seed, the same order
    assert first != in_file_order and sorted(first) == sorted(in_file_order)
    assert first != numbers(epoch_zero(shard_stream(tmp_path, 0, 1, seed=4)))
    assert numbers(epoch_zero(shard_stream(tmp_path, 0, 1, shuffle_buffer=1))) != in_file_order  # shards permuted
    stream = shard_stream(tmp_path, 0, 1)
    epoch_zero(stream)
    assert numbers(epoch_zero(stream)) != first  # the next epoch has an order of its own


def mixed_args(tmp_path: Path, **kwargs) -> DataArgs:
    write_source(tmp_path / "web", 5, 11)
    write_source(tmp_path / "books", 4, 7, first=1000)
    return DataArgs(**({"root_dir": str(tmp_path), "sources": {"web": 0.7, "books": 0.3}, "seq_len": 7,
                        "batch_size": 3, "prefetch": 0, "shuffle_buffer": 4, "seed": 5} | kwargs))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_resumed_loader_gives_the_batches_of_an_uninterrupted_one(tmp_path, prefetch):
    """Cut in the middle of a document, of a block, of a shard and of a later epoch: the same batches after."""
    args = mixed_args(tmp_path, prefetch=prefetch)
    with TrainLoader(args, TOK, 0, 1) as loader:
        batches, states = zip(*[(next(loader).tolist(), loader.state_dict()) for _ in range(40)])
    for cut in (1, 4, 13, 27):
        with TrainLoader(args, TOK, 0, 1, state=states[cut - 1]) as resumed:
            assert [next(resumed).tolist() for _ in range(40 - cut)] == list(batches[cut:]), cut


def test_the_loaders_states_move_to_another_number_of_ranks(tmp_path):
    args = mixed_args(tmp_path)
    states = []
    for rank in range(2):
        with TrainLoader(args, TOK, rank, 2) as loader:
            [next(loader) for _ in range(3)]
            states.append(loader.state_dict())
    for rank, state in enumerate(repartition(states, 3, args)):
        with TrainLoader(args, TOK, rank, 3, state=state) as loader:
            assert next(loader).shape == (3, 7) and set(loader.state_dict()["sources"]) == {"web", "books"}


@pytest.mark.parametrize("old, new", [(2, 3), (3, 1), (2, 5)])
def test_another_number_of_ranks_reads_the_rest_of_the_epoch_once(tmp_path, old, new):
    docs = write_source(tmp_path / "web", 7, 9)
    found = source_files(DataArgs(root_dir=str(tmp_path), sources={"web": 1}), "web")
    read, saved = [], []
    for rank in range(old):
        stream = shard_stream(tmp_path, rank, old)
        read += numbers(stream.take(5 + 3 * rank))  # mid-document, mid-block
        saved.append((rank, old, stream.state_dict()))
    for rank, state in enumerate(repartition_shards("web", found.train, saved, new, seed=3)):
        stream = shard_stream(tmp_path, rank, new)
        stream.load_state_dict(json.loads(json.dumps(state)))
        read += numbers(epoch_zero(stream))
    assert sorted(read) == sorted(tokens_of_texts(docs[9:]))


def test_a_source_of_many_shards_opens_one_when_it_reads(tmp_path, monkeypatch):
    for shard in range(300):
        write_shard(tmp_path / "web" / f"{shard:05d}.jsonl", texts(shard, 1))
    opened = []
    real_open = documents_module.open_regular
    monkeypatch.setattr(documents_module, "open_regular", lambda path: opened.append(path) or real_open(path))
    args = DataArgs(root_dir=str(tmp_path), sources={"web": 1}, seq_len=4, batch_size=1, prefetch=0)
    with TrainLoader(args, TOK, 0, 1) as loader:
        assert opened == []
        next(loader)
        assert 1 <= len(opened) <= 4  # a row of 4 tokens takes at most a few one-document shards


def test_bad_sources_and_changed_shards_are_one_line(tmp_path):
    write_source(tmp_path / "web", 3, 4)
    with pytest.raises(UserError, match="has 2 training shard file\\(s\\) for 3 ranks"):
        shard_stream(tmp_path, 0, 3)
    write_shard(tmp_path / "one" / "a.jsonl.zst", texts(0, 3))
    with pytest.raises(UserError, match="has no training shard: its valid.* shards, else its first shard, are held"):
        TrainLoader(DataArgs(root_dir=str(tmp_path), sources={"one": 1}), TOK, 0, 1)
    assert load_validation(DataArgs(root_dir=str(tmp_path), sources={"one": 1}, seq_len=4), TOK, 1).tokens.shape \
        == (1, 4)  # a source validated on only
    write_shard(tmp_path / "cols" / "a.parquet", texts(0, 3), field="content")
    write_shard(tmp_path / "cols" / "b.parquet", texts(0, 3), field="content")
    with pytest.raises(UserError, match="has no column 'text' \\(it has content, id\\): set data.text_field"):
        load_validation(DataArgs(root_dir=str(tmp_path), sources={"cols": 1}, seq_len=4), TOK, 1)
    assert load_validation(DataArgs(root_dir=str(tmp_path), sources={"cols": 1}, seq_len=4, text_field="content"),
                           TOK, 1).tokens.shape == (1, 4)

    stream = shard_stream(tmp_path, 0, 1)
    stream.take(3)
    state = stream.state_dict()
    os.replace(tmp_path / "web" / "part-002.jsonl.zst", tmp_path / "part-002.jsonl.zst")
    with pytest.raises(UserError, match="changed since the loader state was saved \\(2 training shards then, 1 now"):
        shard_stream(tmp_path, 0, 1).load_state_dict(state)
    os.replace(tmp_path / "part-002.jsonl.zst", tmp_path / "web" / "part-002.jsonl.zst")
    shard = next(path for path in (tmp_path / "web").iterdir() if path.name in json.dumps(stream.pieces[0]))
    write_shard(shard, texts(50, 5))  # rewritten in place: the saved position means nothing in it
    with pytest.raises(UserError, match="was replaced or changed under the running job"):
        resumed = shard_stream(tmp_path, 0, 1)
        resumed.load_state_dict(state)
        resumed.take(20)


def test_the_data_benchmark_measures_every_format(tmp_path, capsys):
    from tools import data_benchmark

    write_shard(tmp_path / "corpus" / "a.jsonl.gz", [f"word {k} " * (20 + k % 30) for k in range(200)])
    data_benchmark.main([f"corpus={tmp_path / 'corpus'}", "seconds=0.05", "shards=", "seq_len=16", "batch_size=2",
                         "shuffle_buffer=4", "tokenizer.name=bytes"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| .")]
    assert [row.split(" | ")[0] for row in rows] == ["| .jsonl", "| .jsonl.gz", "| .jsonl.zst", "| .parquet"]
    write_source(tmp_path / "many", 30, 2)
    data_benchmark.startup_in_child(str(tmp_path), "many", {"name": "bytes"})
    measured = json.loads(capsys.readouterr().out)
    assert measured["first_batch_s"] > 0 and measured["rss_growth_mib"] >= 0
