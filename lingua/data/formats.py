"""The documents of one shard file as published: `.jsonl`, `.jsonl.gz`, `.jsonl.zst` (one JSON object per line) or
`.parquet` (one row per document), its text in a configurable field or column. Read in place, from any document
index: a compressed shard is decompressed from its start up to it (a zstd or gzip stream has no index), a parquet
shard skips whole row groups by their metadata, then rows.

Every reader of a corpus shares it: the training stream over shards (lingua/data/shard_stream.py), the validation
rows (lingua/data/loader.py) and setup/prepare_data.py. Parquet is read one column at a time through pyarrow and
turned into Python strings: no pandas metadata and no extension type is ever loaded from the file.
"""

import contextlib
import gzip
import os
import stat
from collections.abc import Iterator

from lingua.data.documents import MalformedLine, text_of_json
from lingua.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
ZSTD_READ_BYTES = 2**20
PARQUET_BATCH_ROWS = 1024  # rows decoded at a time: bounded memory whatever a row group holds


def is_shard(name: str) -> bool:
    return name.endswith(SUFFIXES)


def documents(path: str, text_field: str = "text", start: int = 0) -> Iterator[str | MalformedLine]:
    """The texts of the documents of `path` from the start-th on, in file order; a row that holds none is yielded
    as the MalformedLine saying why (the reader counts it and goes on). A file that cannot be decoded (truncated,
    corrupt, not of its format) is a UserError naming it."""
    try:
        if path.endswith(".parquet"):
            yield from _parquet_documents(path, text_field, start)
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


def _parquet_documents(path: str, text_field: str, start: int) -> Iterator[str | MalformedLine]:
    import pyarrow.parquet as pq  # only where a parquet shard is read

    with open_regular(path) as raw:
        shard = pq.ParquetFile(raw)
        names = shard.schema_arrow.names
        if text_field not in names:
            raise UserError(f"data file {path} has no column '{text_field}' (it has {', '.join(names)}): "
                            "set data.text_field")
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
