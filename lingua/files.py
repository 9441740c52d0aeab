"""Writing files that survive a kill at any moment: a reader sees the old content or the new, never half a file."""

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PARTIAL_WRITE = re.compile(r"\.tmp\d+$")  # what atomic_write leaves when killed before its rename


def atomic_write(path: str | Path, data: str | bytes | Callable[[BinaryIO], None]) -> None:
    """Writes `data` (or what `data(file)` writes) to a temporary file beside `path`, flushes it to disk, then renames
    it over `path` and flushes the folder, so the new content survives a power loss too. A failure leaves `path` as it
    was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def fsync_dir(folder: str | Path) -> None:
    """Flushes a folder's entries (a rename or a new file in it) to disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_partial_writes(folder: str | Path) -> list[Path]:
    """Deletes the temporary files of atomic writes whose process was killed; returns them."""
    partial = [p for p in Path(folder).iterdir() if p.is_file() and PARTIAL_WRITE.search(p.name)]
    for path in partial:
        path.unlink()
    return partial


class RefusedFile(ValueError):
    """A file named by a checkpoint or a config that is missing, not a regular file, or outside its folder."""


def regular_file(path: str | Path, inside: str | Path | None = None) -> Path:
    """`path`, once it is known to be a regular file (never a FIFO or device, whose open or read can block for
    ever) and, with `inside`, to lie within that folder, links followed; checked without opening it. Else
    RefusedFile, one line naming the file."""
    path = Path(path)
    try:
        if inside is not None and Path(inside).resolve() not in path.resolve().parents:
            raise RefusedFile(f"{path} lies outside {Path(inside).resolve()}")
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise RefusedFile(f"{path} is missing") from None
    except RuntimeError:  # Path.resolve: links in a loop
        raise RefusedFile(f"{path} is a loop of links") from None
    if not stat.S_ISREG(mode):
        raise RefusedFile(f"{path} is not a regular file")
    return path
