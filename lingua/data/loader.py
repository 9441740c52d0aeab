"""Training data: JSONL chunks -> tokenized documents -> packed rows of seq_len tokens -> mixed batches.

Layout: ROOT/SOURCE/train.*.jsonl (chunks, read in name order) and ROOT/SOURCE/valid.jsonl, one {"text": ...}
document per line. Documents are tokenized as `<s> text </s>` (RoBERTa's format, which is also how evaluation,
lingua/eval/features.py, feeds the encoder), concatenated and cut into rows of exactly seq_len tokens (no padding), a
document that does not fit continuing in the next row of its source.

Mixing: each packed row is drawn from one source, chosen by weight with a per-rank seeded numpy RNG. Sampling per row
(rather than per document) makes the weights token proportions, whatever the document lengths, and keeps one carry-over
buffer per source. Which lines of a source each rank reads, and the state that resumes it exactly, are those of
lingua/data/source_stream.py.

Documents: with `document_mask`, each token attends only to the tokens of its own document in its row; the apps
read which document each token is from the rows' <s> tokens (`document_ids`).

Validation: fixed rows, each source's valid.jsonl packed like training rows from its start and split over the
ranks (`load_validation`), apart from the endless, sharded and resumable training stream; lingua/training/validation.py
reports the loss on them.
"""

import collections
import glob
import json
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from lingua.data.documents import SUFFIXES, MalformedLine, SkippedRows, documents, is_shard, tokens_of
from lingua.data.shard_stream import ShardStream, repartition_shards
from lingua.data.source_stream import SourceStream, line_start_at_or_after, rank_segments
from lingua.data.tokenizer import TokenizerArgs
from lingua.errors import UserError, at_least, require

logger = logging.getLogger(__name__)

@dataclass
class DataArgs:
    root_dir: str = ""  # the folder of the sources (setup/prepare_data.py writes data/<source>/)
    sources: dict[str, float] = field(default_factory=dict)  # source folder -> sampling weight
    validation_sources: dict[str, float] = field(default_factory=dict)  # the validation rows' sources and weights
    # (default: sources): a source validated on need not be trained on (the paper's Figure 5 reads Wikipedia's loss)
    seq_len: int = 512  # tokens per training sequence
    batch_size: int = 8  # sequences per rank per micro-batch
    seed: int = 42  # document order and source sampling
    prefetch: int = 8  # batches loaded ahead in a background thread (0: load in the caller's thread)
    text_field: str = "text"  # the JSON field or parquet column of a shard that holds a document's text
    shuffle_buffer: int = 1024  # a shard's documents are shuffled in blocks of this many (1: in file order)
    document_mask: bool = False  # each token attends only to its own document of a packed row (off in the paper's
    # tables: the paper does not say whether it packs across documents)
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)

    def __post_init__(self):
        at_least(self, 1, "seq_len", "batch_size", "shuffle_buffer")
        at_least(self, 0, "prefetch", "seed")
        for name in ("sources", "validation_sources"):
            weights = getattr(self, name).values()
            require(all(w >= 0 for w in weights) and (not weights or sum(weights) > 0), name,
                    f"weights must be >= 0 with a positive sum, got {getattr(self, name)}")


def check_args(args: DataArgs) -> None:
    if args.root_dir and not os.path.isdir(args.root_dir):
        raise UserError(f"data root_dir not found: '{args.root_dir}'")
    if not args.sources:
        raise UserError("data.sources is empty: give at least one source folder with a weight")


@dataclass(frozen=True)
class SourceFiles:
    """Where a source's documents are: its folder, and the names (relative to it) of its training and validation
    files. `prepared`: setup/prepare_data.py's layout (train.*.jsonl chunks shared out by bytes, valid.jsonl); else
    shards as published, shared out whole."""

    folder: str
    train: list[str]
    valid: list[str]
    prepared: bool = False

    def paths(self, names: list[str]) -> list[str]:
        return [os.path.join(self.folder, name) for name in names]


def source_files(args: DataArgs, name: str) -> SourceFiles:
    """A source is a folder (searched through for shards), a glob of shards (`dclm/**/*.jsonl.zst`), or a folder in
    prepare_data's layout; relative to data.root_dir unless absolute. Its validation files are those named valid.*,
    else its first shard in name order, held out of training."""
    path = os.path.join(args.root_dir, name)
    if any(magic in name for magic in "*?["):
        parts = path.split(os.sep)
        plain = next(i for i, part in enumerate(parts) if any(magic in part for magic in "*?["))
        folder = os.sep.join(parts[:plain]) or os.sep
        names = sorted(os.path.relpath(found, folder) for found in glob.glob(path, recursive=True)
                       if is_shard(found) and os.path.isfile(found))
    elif os.path.isdir(path):
        folder = path
        chunks = sorted(f for f in os.listdir(path) if f.startswith("train.") and f.endswith(".jsonl"))
        if chunks:
            return SourceFiles(path, chunks, ["valid.jsonl"], prepared=True)
        names = _shards_under(path)
    else:
        raise UserError(f"data source not found: '{path}' (a folder of shards, a glob of them, or a folder written "
                        "by setup/prepare_data.py)")
    if not names:
        raise UserError(f"data source '{path}' holds no shard file ({', '.join(SUFFIXES)})")
    valid = [n for n in names if os.path.basename(n).startswith("valid.")]
    train = [n for n in names if not os.path.basename(n).startswith("valid.")]
    if not valid:
        valid, train = train[:1], train[1:]
    return SourceFiles(folder, train, valid)  # no training shard: a source validated on only (Figure 5's)


def _shards_under(folder: str) -> list[str]:
    names = []
    for parent, folders, files in os.walk(folder):
        folders[:] = [f for f in folders if not f.startswith(".")]  # not into a hub download's .cache/
        names += [os.path.relpath(os.path.join(parent, f), folder) for f in files
                  if is_shard(f) and not f.startswith(".")]
    return sorted(names)


def _open_stream(args: DataArgs, name: str, batch_tokens: float, tokenizer, rank: int, world_size: int):
    """Rank `rank`'s stream of source `name`; `batch_tokens`: what a batch takes from it on average."""
    files = source_files(args, name)
    if not files.train:
        raise UserError(f"data source '{os.path.join(args.root_dir, name)}' has no training shard: its valid.* shards, "
                        "else its first shard, are held out for validation, so give it another shard")
    if files.prepared:
        return SourceStream(name, files.paths(files.train), rank, world_size, tokenizer, batch_tokens)
    return ShardStream(name, files.folder, files.train, rank, world_size, tokenizer, batch_tokens, args.seed,
                       args.text_field, args.shuffle_buffer)


class TrainLoader:
    """Endless iterator of LongTensor [batch_size, seq_len]; state_dict() is the position after the last batch returned.

    With prefetch > 0 a daemon thread runs up to `prefetch` batches ahead; each queued batch carries a snapshot of
    the state right after it, so prefetched but unconsumed batches are not lost on resume.
    """

    def __init__(self, args: DataArgs, tokenizer, rank: int, world_size: int, state: dict[str, Any] | None = None):
        check_args(args)
        self.args, self.rank, self.world_size = args, rank, world_size
        self.names = sorted(args.sources)
        weights = np.array([args.sources[n] for n in self.names], dtype=np.float64)
        self.weights = weights / weights.sum()
        self.rng = np.random.default_rng([args.seed, rank])
        self.streams = [_open_stream(args, n, args.batch_size * args.seq_len * weight, tokenizer, rank, world_size)
                        for n, weight in zip(self.names, self.weights)]
        if state is not None:
            self._load_state_dict(state)
        self._state = self._snapshot()
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(args.prefetch, 1))
        self._thread = None
        if args.prefetch > 0:
            self._thread = threading.Thread(target=self._produce, name="data-loader", daemon=True)
            self._thread.start()

    def _next_batch(self) -> torch.Tensor:
        picks = self.rng.choice(len(self.streams), size=self.args.batch_size, p=self.weights)
        # numpy reads the lists of ints in C, about 3x faster than torch.tensor (docs/performance.md)
        rows = np.array([self.streams[i].take(self.args.seq_len) for i in picks], dtype=np.int64)
        return torch.from_numpy(rows)

    def _snapshot(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "rng": self.rng.bit_generator.state,
                "sources": {n: s.state_dict() for n, s in zip(self.names, self.streams)}}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise UserError(f"data loader state is for rank {state['rank']} of {state['world_size']}, "
                            f"not rank {self.rank} of {self.world_size}")
        if sorted(state["sources"]) != self.names:
            raise UserError(f"data loader state is for sources {sorted(state['sources'])}, not {self.names}")
        self.rng.bit_generator.state = state["rng"]
        for name, stream in zip(self.names, self.streams):
            stream.load_state_dict(state["sources"][name])

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self._next_batch()
                self._put((batch, self._snapshot()))
        except BaseException as e:  # handed to the consumer, which re-raises it instead of waiting forever
            self._put((None, e))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise RuntimeError("data loader is closed")
        if self._thread is None:
            batch, state = self._next_batch(), self._snapshot()
        else:
            batch, state = self._queue.get()
            if batch is None:
                self._error = state
                raise state
        self._state = state
        return batch

    def state_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._state))  # a deep copy, and proof that it is plain JSON

    @property
    def malformed_lines(self) -> int:
        """Malformed lines skipped up to the last batch returned."""
        return sum(s["malformed_lines"] for s in self._state["sources"].values())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for stream in self.streams:
            stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReadAhead:
    """Any app's loader (the `DataPipeline` contract), able to fetch the next step's batches before the step:
    `prepare(n)` says why they cannot be had, so that the ranks agree on a data failure (a file that changed under
    the run) before any of them starts a step it could not finish. `next` returns a batch on `device`. `state_dict`
    and `malformed_lines` are those after the last batch `next` returned, never after one only prepared.

    On a GPU each batch is copied as soon as it is fetched, from pinned memory on a side stream, so the next step's
    copy overlaps this step's compute and the host never waits on a copy from pageable memory; on the CPU a batch
    stays where the loader made it."""

    def __init__(self, loader, device: torch.device = torch.device("cpu")):
        self.loader, self.device = loader, device
        self.copies = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ready: collections.deque = collections.deque()  # (batch, state after it, malformed lines after it)
        self.state, self.malformed_lines = loader.state_dict(), loader.malformed_lines
        self.malformed_counted = self.malformed_lines  # by `new_malformed_lines`
        self.failure: str | None = None

    def new_malformed_lines(self) -> int:
        """The malformed lines skipped since the previous call (since the start, at the first): a progress line's."""
        new, self.malformed_counted = self.malformed_lines - self.malformed_counted, self.malformed_lines
        return new

    def prepare(self, n: int) -> str | None:
        """Fetches batches until the next n are at hand, waiting for them; returns why they cannot be (one line),
        or None."""
        try:
            with record_function("data/copy"):
                while self.failure is None and len(self.ready) < n:
                    batch = self._copy(next(self.loader))
                    self.ready.append((batch, self.loader.state_dict(), self.loader.malformed_lines))
        except UserError as e:
            self.failure = str(e)
        except OSError as e:
            self.failure = f"cannot read the training data: {e.strerror or e}{f': {e.filename}' if e.filename else ''}"
        return self.failure if len(self.ready) < n else None

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        if not self.ready and self.prepare(1):
            raise UserError(self.failure)
        batch, self.state, self.malformed_lines = self.ready.popleft()
        if self.copies is None:
            return batch
        with record_function("data/copy"):
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copies)
            batch.record_stream(compute)  # allocated on the copy stream: not reused until the step using it is done
        return batch

    def _copy(self, batch: torch.Tensor) -> torch.Tensor:
        """The batch on the device, its copy queued on the copy stream (pinned memory is kept alive by torch until the
        copy is done)."""
        if self.copies is None:
            return batch.to(self.device)
        with torch.cuda.stream(self.copies):
            return batch.pin_memory().to(self.device, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def close(self) -> None:
        self.loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def document_start(args: DataArgs, tokenizer) -> int | None:
    """The token that starts each document of a packed row (<s>) when each token attends only to its own document
    (`document_mask`), else None."""
    return tokenizer.bos_id if args.document_mask else None


def document_ids(rows: torch.Tensor, start: int) -> torch.Tensor:
    """The document of each token of packed rows [B, S]: the count of documents started (`start`, <s>) up to it in its
    row, so a row's leading tokens, continued from the previous row, are document 0. Read from the rows as packed,
    never from a corrupted copy (a <mask> may hide a <s>, a sampled token be one). The gpt2 and bytes tokenizers never
    encode text as <s> (their text ids lie below it); an hf tokenizer may, where its vocabulary holds a piece spelled
    as its <s> (a converted sentencepiece's): that document is then split there, and two are still never joined."""
    return (rows == start).cumsum(1)


def build_train_loader(args: DataArgs, tokenizer, rank: int, world_size: int,
                       state: dict[str, Any] | None = None) -> TrainLoader:
    return TrainLoader(args, tokenizer, rank, world_size, state)


def repartition(states: list[dict[str, Any]], world_size: int, args: DataArgs) -> list[dict[str, Any]]:
    """Loader states for `world_size` ranks from the states saved by another number of ranks.

    The unread rest of each source's current epoch, over all old ranks (a partly used document included, with the
    count of its tokens already used), is cut into `world_size` pieces of about equal bytes at line boundaries: no
    line is read twice or skipped. The epochs after it use the new ranks' own byte ranges.
    """
    check_args(args)
    new = [{"rank": r, "world_size": world_size, "rng": np.random.default_rng([args.seed, r]).bit_generator.state,
            "sources": {}} for r in range(world_size)]
    for name in sorted(args.sources):
        found = source_files(args, name)
        if not found.prepared:
            olds = [(old["rank"], old["world_size"], old["sources"][name]) for old in states]
            for rank, state in enumerate(repartition_shards(name, found.train, olds, world_size, args.seed)):
                new[rank]["sources"][name] = state
            continue
        files = found.paths(found.train)
        sizes = [os.path.getsize(f) for f in files]
        rest, epoch, malformed = [], min(old["sources"][name]["epoch"] for old in states), 0
        for old in states:
            source = old["sources"][name]
            if source["total_bytes"] != sum(sizes):
                raise UserError(f"data source '{name}' changed since the loader state was saved "
                                f"({source['total_bytes']} bytes then, {sum(sizes)} now)")
            segments = [[os.path.join(os.path.dirname(files[0]), name), *rest] for name, *rest in source["segments"]] \
                if "segments" in source else rank_segments(files, sizes, old["rank"], old["world_size"])
            if source["segment"] < len(segments):
                path, _, end, _ = segments[source["segment"]]
                rest += [[path, source["byte"], end, source["token"]], *segments[source["segment"] + 1:]]
            malformed += source["malformed_lines"]
        for rank, piece in enumerate(_split_segments([s for s in rest if s[1] < s[2]], world_size)):
            first = piece[0] if piece else [None, 0, 0, 0]
            new[rank]["sources"][name] = {"epoch": epoch, "segment": 0, "byte": first[1], "token": first[3],
                                          "malformed_lines": malformed if rank == 0 else 0, "total_bytes": sum(sizes),
                                          "segments": [[os.path.basename(path), *rest] for path, *rest in piece]}
        unread = sum(end - start for _, start, end, _ in rest)
        logger.info(f"data source '{name}': the {unread:,} unread bytes of epoch {epoch} of {len(states)} rank(s) "
                    f"are re-partitioned over {world_size} rank(s) at line boundaries")
    return new


def _split_segments(segments: list[list], n: int) -> list[list[list]]:
    """n consecutive pieces of about equal bytes, cut only at line starts (a partly used first line stays whole)."""
    total = sum(end - start for _, start, end, _ in segments)
    targets = [total * (k + 1) // n for k in range(n)]
    pieces, piece, done = [], [], 0
    for path, start, end, skip in segments:
        while start < end:
            room = targets[len(pieces)] - done if len(pieces) < n - 1 else end - start
            cut = end if end - start <= room else line_start_at_or_after(path, start + room) if room > 0 else start
            cut = min(cut, end)
            if cut > start:
                piece.append([path, start, cut, skip])
                done, start, skip = done + cut - start, cut, 0
            if start < end:  # this piece is full
                pieces.append(piece)
                piece = []
    pieces.append(piece)
    return pieces + [[] for _ in range(n - len(pieces))]


@dataclass(frozen=True)
class ValidationRows:
    """Fixed validation rows, the batch first, and how many come from each source ({source: rows}, in row order;
    empty when the rows are of one kind), from which lingua.training.validation reports each source's loss."""

    tokens: torch.Tensor
    source_rows: dict[str, int] = field(default_factory=dict)


def load_validation(args: DataArgs, tokenizer, n_sequences: int, rank: int = 0, world_size: int = 1) -> ValidationRows:
    """Fixed validation rows [n_sequences, seq_len] from each source's valid.jsonl, packed like training rows.

    Sources (sorted by name) get n_sequences * weight rows (largest remainder); a source's rows are packed from its
    own file from the start, and rank r takes rows [r*k, (r+1)*k) of them, so ranks are disjoint. Too little text
    raises UserError rather than returning fewer rows: a silently smaller set would make losses incomparable. The
    rows come source after source, counted per source in `source_rows`. `validation_sources`, when given, stands for
    the training's sources here.
    """
    check_args(args)
    rows, source_rows = [], {}
    for name, k in _split_by_weight(n_sequences, args.validation_sources or args.sources).items():
        if k == 0:
            continue
        source_rows[name] = k
        files = source_files(args, name)
        paths = files.paths(files.valid)
        if files.prepared and not os.path.isfile(paths[0]):
            raise UserError(f"validation file not found: '{paths[0]}'")
        need = world_size * k * args.seq_len
        tokens, skipped = _read_tokens(paths, tokenizer, need, args.text_field)
        if len(tokens) < need:
            held_out = paths[0] if len(paths) == 1 else f"the {len(paths)} validation shards of {files.folder}"
            raise UserError(f"'{held_out}' has {len(tokens) // args.seq_len} rows of {args.seq_len} tokens, "
                            f"{k} per rank x {world_size} ranks needed ({skipped} malformed lines skipped)")
        mine = tokens[rank * k * args.seq_len : (rank + 1) * k * args.seq_len]
        rows.append(torch.tensor(mine, dtype=torch.long).view(k, args.seq_len))
    return ValidationRows(torch.cat(rows), source_rows)


def _split_by_weight(n: int, weights: dict[str, float]) -> dict[str, int]:
    names = sorted(weights)
    exact = [n * weights[s] / sum(weights.values()) for s in names]
    counts = [int(x) for x in exact]
    # stable sort: ties go to the source first in name order
    for i in sorted(range(len(names)), key=lambda i: counts[i] - exact[i])[: n - sum(counts)]:
        counts[i] += 1
    return dict(zip(names, counts))


def _read_tokens(paths: list[str], tokenizer, limit: int, text_field: str) -> tuple[list[int], int]:
    """The documents' tokens from the start of the files, in order, until there are `limit`, and the count of the
    malformed rows skipped (each file with some is warned of)."""
    out: list[int] = []
    total_skipped = 0
    for path in paths:
        skipped = SkippedRows()
        for number, text in enumerate(documents(path, text_field), 1):
            if len(out) >= limit:
                break
            try:
                if isinstance(text, MalformedLine):
                    raise text
                out += tokens_of(tokenizer, text)
            except MalformedLine:
                skipped.add(f"line {number}" if ".jsonl" in path else f"row {number}")
        if skipped.count:
            logger.warning(skipped.warning(path, "malformed lines"))
        total_skipped += skipped.count
        if len(out) >= limit:
            break
    return out, total_skipped
