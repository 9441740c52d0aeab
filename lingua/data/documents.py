"""A corpus's documents: the rows of a shard as published (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one JSON object per
line; `.parquet`: one row per document), a document's tokens (`<s> text </s>`), and what a reader reports (the
malformed rows it skips, its epochs). Every reader of rows shares it: the training streams
(lingua/data/shard_stream.py, lingua/data/source_stream.py), the validation rows (lingua/data/loader.py),
setup/prepare_data.py, the GLUE TSV files (lingua/eval/glue_data.py) and the contrastive pairs.

A shard is read in place, from any document index: a compressed shard is decompressed from its start up to it (a
zstd or gzip stream has no index), a parquet shard skips whole row groups by their metadata, then rows. Parquet is
read one column at a time through pyarrow and turned into Python strings: no pandas metadata and no extension type
is ever loaded from the file.
"""

import contextlib
import gzip
import logging
import os
import stat
import time
from collections.abc import Iterator

from lingua.errors import UserError
from lingua.files.untrusted import Malformed, parse_json

logger = logging.getLogger(__name__)

EPOCH_LOG_INTERVAL_S = 60  # a source read through many times a minute (one smaller than a batch) logs its epochs
# at most this often
CHANGED = ("the data must not change while a run reads it: restore it and run the same command to resume from the "
           "newest checkpoint, or start a new run (another dump_dir) on the changed data")


class SkippedRows:
    """The bad rows of one file (or of one rank's share of it), skipped and counted: the file gets one warning, with
    the count and where the first one is."""

    def __init__(self):
        self.count, self.first = 0, ""

    def add(self, where: str) -> None:
        self.count += 1
        self.first = self.first or where

    def warning(self, path, rows: str) -> str:
        return f"{path}: skipped {self.count} {rows} (the first at {self.first})"


class MalformedLine(ValueError):
    """A line that holds no document; its text says why."""


def text_of_json(line: bytes, text_field: str = "text") -> str:
    """The text of one JSON line's document; raises MalformedLine saying why there is none."""
    if not line.strip():
        raise MalformedLine("an empty line")
    try:
        doc = parse_json(line)
    except Malformed as e:  # bad UTF-8 or JSON, a number past the digit limit, nesting
        raise MalformedLine(str(e)) from None
    text = doc.get(text_field) if isinstance(doc, dict) else None
    if not isinstance(text, str):
        raise MalformedLine(f'no "{text_field}" string in it')
    return text


def tokens_of(tokenizer, text: str) -> list[int]:
    """A document's tokens, <s> text </s>; raises MalformedLine when the text is not valid Unicode."""
    try:
        return [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
    except ValueError:  # lone surrogates
        raise MalformedLine("its text is not valid Unicode") from None


def read_document(tokenizer, line: bytes) -> list[int]:
    """The tokens of one JSONL line's document (<s> text </s>); raises MalformedLine saying why there is none."""
    return tokens_of(tokenizer, text_of_json(line))


def document(tokenizer, line: bytes) -> list[int] | None:
    """The tokens of one JSONL line's document (<s> text </s>), or None when the line is malformed."""
    try:
        return read_document(tokenizer, line)
    except MalformedLine:
        return None


class EpochLog:
    """A rank's epochs of one source, logged at most once a minute; an epoch read whole that is smaller than what
    a batch takes from the source on average (`batch_tokens`) is said once, with the numbers."""

    def __init__(self, source: str, rank: int, batch_tokens: float):
        self.source, self.rank, self.batch_tokens = source, rank, batch_tokens
        self.docs, self.tokens, self.whole_epoch = 0, 0, True  # read in this epoch; from its start?
        self.told_small, self.logged_at = False, -float("inf")

    def read(self, tokens: int) -> None:
        self.docs, self.tokens = self.docs + 1, self.tokens + tokens

    def resumed(self) -> None:
        self.docs, self.tokens, self.whole_epoch = 0, 0, False

    def end_epoch(self, epoch: int) -> None:
        if self.whole_epoch and self.docs and self.tokens < self.batch_tokens and not self.told_small:
            self.told_small = True
            logger.warning(
                f"data source '{self.source}' is smaller than a batch: rank {self.rank}'s share of it holds "
                f"{self.docs:,} document(s), {self.tokens:,} tokens, and each batch takes about "
                f"{self.batch_tokens:,.0f} tokens from it (data.batch_size x data.seq_len x its weight), so every "
                f"batch reads it through about {self.batch_tokens / self.tokens:,.1f} times: add documents, or "
                "lower data.batch_size or data.seq_len")
        now = time.monotonic()
        if now - self.logged_at >= EPOCH_LOG_INTERVAL_S:
            self.logged_at = now
            logger.info(f"data source '{self.source}': rank {self.rank} starts epoch {epoch + 1:,}")
        self.docs, self.tokens, self.whole_epoch = 0, 0, True


# ---------------------------------------------------------------- shards as published

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
ZSTD_READ_BYTES = 2**20
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: bounded memory whatever a row group holds


def is_shard(name: str) -> bool:
    return name.endswith(SUFFIXES)


def documents(path: str, text_field: str = "text", start: int = 0,
              text_setting: str = "data.text_field") -> Iterator[str | MalformedLine]:
    """The texts of the documents of `path` from the start-th on, in file order; a row that holds none is yielded
    as the MalformedLine saying why (the reader counts it and goes on); `text_setting` names, in an error, the
    setting that chooses the field. A file that cannot be decoded (truncated,
    corrupt, not of its format) is a UserError naming it."""
    try:
        if path.endswith(".parquet"):
            yield from _parquet_documents(path, text_field, start, text_setting)
            return
        with open_regular(path) as raw, _decompressed(path, raw) as decompressed:
            lines = _zstd_lines(raw) if path.endswith(".zst") else decompressed
            for index, line in enumerate(lines):
                if index >= start:
                    yield _text_of_line(line, text_field)
    except UserError:
        raise
    except Exception as e:  # zstandard.ZstdError, gzip's BadGzipFile and EOFError, pyarrow's ArrowInvalid, OSError
        raise UserError(f"data file {path} cannot be read: {type(e).__name__}: {e}") from None


def _text_of_line(line: bytes, text_field: str) -> str | MalformedLine:
    try:
        return text_of_json(line, text_field)
    except MalformedLine as why:
        return why


def open_regular(path: str):
    """A binary file object for a regular file (a FIFO named like a shard would block the reader forever)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UserError(f"data file not found: {path}") from None
    except OSError as e:
        raise UserError(f"cannot read data file {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise UserError(f"data file {path} is not a regular file")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def _decompressed(path: str, raw):
    return gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else contextlib.nullcontext(raw)


def _zstd_lines(raw) -> Iterator[bytes]:
    """The lines of a zstd stream of one frame or several. zstandard's stream reader ends quietly where a truncated
    frame does: here the frame must end with the file, or the file is refused."""
    import zstandard  # only where a zstd shard is read

    decompressor = zstandard.ZstdDecompressor()
    frame, inside, pending = decompressor.decompressobj(), False, b""
    while chunk := raw.read(ZSTD_READ_BYTES):
        while chunk:
            pending += frame.decompress(chunk)
            inside, chunk = not frame.eof, frame.unused_data if frame.eof else b""
            if frame.eof:
                frame = decompressor.decompressobj()
        *lines, pending = pending.split(b"\n")
        yield from (line + b"\n" for line in lines)
    if inside:
        raise EOFError("the file ends inside a zstd frame (truncated)")
    if pending:
        yield pending


def _parquet_documents(path: str, text_field: str, start: int, text_setting: str) -> Iterator[str | MalformedLine]:
    import pyarrow.parquet as pq  # only where a parquet shard is read

    with open_regular(path) as raw:
        shard = pq.ParquetFile(raw)
        names = shard.schema_arrow.names
        if text_field not in names:
            raise UserError(f"data file {path} has no column '{text_field}' (it has {', '.join(names)}): "
                            f"set {text_setting}")
        first, skip = 0, start  # the row group holding document `start`, and its rows before it
        while first < shard.num_row_groups and skip >= (rows := shard.metadata.row_group(first).num_rows):
            first, skip = first + 1, skip - rows
        groups = list(range(first, shard.num_row_groups))
        if not groups:
            return
        for batch in shard.iter_batches(PARQUET_BATCH_ROWS, row_groups=groups, columns=[text_field]):
            for text in batch.column(0).to_pylist()[skip:]:
                yield text if isinstance(text, str) else MalformedLine(f'no "{text_field}" string in it')
            skip = max(skip - batch.num_rows, 0)
