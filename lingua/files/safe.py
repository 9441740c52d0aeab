"""Writing files that survive a kill at any moment: a reader sees the old content or the new, never half a file.
Nothing is written through a symbolic link: a link where a file is written (a run folder someone sent) is refused,
so no write lands outside the folder it belongs to."""

import errno
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

PARTIAL_WRITE = re.compile(r"\.tmp\d+$")  # what atomic_write leaves when killed before its rename

Fence = Callable[[], "str | None"]  # why this process may no longer write into its run folder (its run lease was
# taken over: lingua.training.lifecycle.RunLock.lost), checked right before each write; None while it may


def unfenced() -> None:
    """The fence of a writer that holds no run lease (a tool, a test): it may always write."""
    return None


class LinkRefused(OSError):
    """A symbolic link (or, for an appended file, anything but a regular file) where the library writes a file."""

    def __init__(self, path: Path, link: bool = True):
        reason = "a symbolic link, which the library never writes through" if link else \
            "not a regular file, so the library does not write to it"
        super().__init__(errno.ELOOP, f"{reason} (delete it)", str(path))

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}"


def refuse_link(path: str | Path) -> None:
    """Raises LinkRefused if `path` is a symbolic link (dangling or not)."""
    if Path(path).is_symlink():
        raise LinkRefused(Path(path))


def atomic_write(path: str | Path, data: str | bytes | Callable[[BinaryIO], None]) -> None:
    """Writes `data` (or what `data(file)` writes) to a temporary file beside `path`, flushes it to disk, then renames
    it over `path` and flushes the folder, so the new content survives a power loss too. A failure leaves `path` as it
    was. A link at `path` or at the temporary file's name is refused (LinkRefused) before anything is written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_link(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    descriptor = _create(tmp)
    try:
        with open(descriptor, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def _create(tmp: Path) -> int:
    """A new file at `tmp`, created exclusively and never through a link; the leftover of a killed process of the
    same pid there is removed first."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        return os.open(tmp, flags, 0o644)
    except FileExistsError:
        if not stat.S_ISREG(os.lstat(tmp).st_mode):
            raise LinkRefused(tmp, link=tmp.is_symlink()) from None
    tmp.unlink()
    return os.open(tmp, flags, 0o644)


def open_appending(path: str | Path, binary: bool = False) -> TextIO | BinaryIO:
    """`path` opened to append text, or bytes (created if absent). A link there is refused, never followed; so is
    anything but a regular file (a FIFO would block)."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO no process reads, or a socket
            raise LinkRefused(Path(path), link=e.errno == errno.ELOOP) from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise LinkRefused(Path(path), link=False)
    return open(descriptor, "ab" if binary else "a")


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
