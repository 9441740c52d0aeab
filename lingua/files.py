"""Writing files that survive a kill at any moment: a reader sees the old content or the new, never half a file."""

import os
from pathlib import Path


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Writes `data` to a temporary file beside `path`, flushes it to disk, then renames it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
