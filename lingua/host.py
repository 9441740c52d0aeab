"""What identifies a process on this host, read from Linux's /proc: which boot this is and when a pid started.
Leases and pipeline stages record them to tell a live holder from a pid that was reused. No torch here: the job
commands that read these records (stool, a pipeline's stages) start without it."""

from pathlib import Path


def process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot: a reused pid starts later); None if none runs (a zombie
    has exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def boot_id() -> str | None:
    """This boot of this host (Linux): pids and start times compare only within one."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
