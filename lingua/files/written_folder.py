"""Folders the library writes whole and may later replace or remove (an export, a prepared data source, and the
partial and previous copies beside one while it is replaced). A marker file in each lists the files written there,
and is written before any of them: only a file it lists is ever replaced or removed, so a folder the library did
not write (no marker) or one holding anything else (a user's `my_results.txt`, a sub-folder) is refused, untouched.
"""

import json
from collections.abc import Iterable
from pathlib import Path

from lingua.errors import UserError
from lingua.files import untrusted
from lingua.files.safe import PARTIAL_WRITE, RefusedFile, atomic_write, regular_file


def marker_text(names: Iterable[str], marker: str, **fields) -> str:
    """The marker's content: `fields` and the names of the files written into its folder (the marker among them)."""
    return json.dumps({**fields, "files": sorted({*names, marker})}, indent=1) + "\n"


def record(folder: Path, marker: str, names: Iterable[str], **fields) -> None:
    """Writes the marker, before the files it adds to the list are created: a kill never leaves one unlisted."""
    atomic_write(folder / marker, marker_text(names, marker, **fields))


def listed(folder: Path, marker: str) -> set[str]:
    """The names the folder's marker lists; none when it has no marker, or one that is not a marker. A marker that
    cannot be read (EIO) is a UserError: that is no proof the folder holds files the library did not write."""
    try:
        content = untrusted.parse_json(regular_file(folder / marker, inside=folder).read_bytes())
    except (RefusedFile, FileNotFoundError, untrusted.Malformed):
        return set()
    except OSError as e:
        raise UserError(f"cannot read {folder / marker}: {e.strerror}") from None
    files = content.get("files") if isinstance(content, dict) else None
    return {name for name in files if isinstance(name, str)} if isinstance(files, list) else set()


def not_written(folder: Path, marker: str) -> list[str]:
    """The entries of `folder` that its marker does not list as files written there (every one, without a marker):
    a sub-folder or a link is never the library's; a partial write of a listed file or of the marker is
    (atomic_write's leftover)."""
    names = listed(folder, marker)

    def written(entry: Path) -> bool:
        original = PARTIAL_WRITE.sub("", entry.name)
        listed_name = entry.name in names or original != entry.name and original in {*names, marker}
        return listed_name and entry.is_file() and not entry.is_symlink()

    return sorted(entry.name for entry in folder.iterdir() if not written(entry))


def remove(folder: Path, marker: str) -> None:
    """Deletes a folder the library wrote, its marker last; a link, or a folder holding anything its marker does
    not list, is refused in one line and nothing is deleted."""
    if folder.is_symlink() or folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is not a folder this library wrote: move it away, nothing was deleted")
    if not folder.exists():
        return
    foreign = not_written(folder, marker)
    if foreign:
        raise UserError(f"{folder} holds what this library did not write there ({', '.join(foreign[:3])}"
                        f"{', ...' if len(foreign) > 3 else ''}; its {marker} lists what it wrote): move it away, "
                        "nothing was deleted")
    for entry in sorted(folder.iterdir(), key=lambda entry: entry.name == marker):  # the marker last
        entry.unlink()
    folder.rmdir()
