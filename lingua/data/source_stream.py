"""One rank's share of one training source: an endless stream of tokens, and the state that resumes it exactly. The
mixing of the sources and the loader's thread are lingua/data/loader.py's.

Sharding: the chunks of a source are treated as one byte stream of T bytes; rank r owns the lines that START in bytes
[r*T/W, (r+1)*T/W). Every line starts in exactly one range, so each line is used exactly once per epoch for any number
of ranks and chunks (fewer chunks than ranks, uneven sizes), and a rank reads only its own contiguous slice plus at
most one partial line to find its first line boundary.

The carry-over buffer of a source (lingua/data/loader.py packs rows from it) is always the unconsumed tail of a single
document, so the state stores where that document's line starts plus a token offset and rebuilds the buffer exactly
by re-reading that one line.
"""

import logging
import os
from typing import Any

from lingua.data.documents import CHANGED, EpochLog, MalformedLine, SkippedRows, read_document
from lingua.errors import UserError

logger = logging.getLogger(__name__)



def rank_segments(files: list[str], sizes: list[int], rank: int, world_size: int) -> list[list]:
    """[path, start, end, 0]: rank `rank` of `world_size` reads the lines of path that start in [start, end)."""
    total = sum(sizes)
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    segments, file_start = [], 0
    for path, size in zip(files, sizes):
        start, end = max(lo - file_start, 0), min(hi - file_start, size)
        if start < end and (start := line_start_at_or_after(path, start)) < end:
            segments.append([path, start, end, 0])
        file_start += size
    return segments


class SourceStream:
    """One rank's share of one source: an endless stream of tokens, epoch after epoch.

    A segment is [path, start, end, skip]: the lines starting in [start, end) of path, the first `skip` tokens of its
    first document already used. Every epoch reads the rank's own byte range, except an epoch resumed on another
    number of ranks, which reads the segments it was handed (`repartition`).

    Malformed lines are skipped; those of the first epoch are counted (later epochs meet the same lines again). The
    first one of each segment (the rank's share of one file) is reported at once, with why; a segment that had more
    is summed up when the rank leaves it."""

    def __init__(self, name: str, files: list[str], rank: int, world_size: int, tokenizer, batch_tokens: float):
        self.name, self.rank = name, rank
        self.identities = {f: _identity(os.stat(f)) for f in files}  # what each file was when the run started
        sizes = [identity[0] for identity in self.identities.values()]
        self.total_bytes = sum(sizes)
        self.own_segments = rank_segments(files, sizes, rank, world_size)
        if not self.own_segments:
            raise UserError(f"data source '{name}' is too small to give rank {rank} of {world_size} any line")
        self.segments = self.own_segments  # this epoch's
        self.tokenizer = tokenizer
        self.malformed = 0  # lines skipped in the first epoch
        self.skipped, self.skipped_from = SkippedRows(), self.segments[0][1]  # those of this segment, since that byte
        self.epoch, self.seg, self.pos = 0, 0, self.segments[0][1]  # next line to read
        self.doc: list[int] = []  # current document (with eos) and how much of it is already handed out
        self.doc_seg, self.doc_pos, self.doc_off = 0, 0, 0
        self.skip = 0  # tokens of the next document already used in an earlier run
        self.file = None
        self.wraps_without_doc = 0
        self.epoch_log = EpochLog(name, rank, batch_tokens)

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.doc_off == len(self.doc):
                self.doc, self.doc_off, self.skip = self._next_doc(), self.skip, 0
            k = min(n - len(out), len(self.doc) - self.doc_off)
            out += self.doc[self.doc_off : self.doc_off + k]
            self.doc_off += k
        return out

    def _next_doc(self) -> list[int]:
        while True:
            path, _, end, _ = self.segments[self.seg]
            if self.pos >= end:
                self._next_segment()
                continue
            if self.file is None:
                self.file = self._open(path)
                self.file.seek(self.pos)
            line = self.file.readline()
            if not line.endswith(b"\n") and self.pos + len(line) < self.identities[path][0]:
                size = os.fstat(self.file.fileno()).st_size
                raise UserError(f"data file {path} shrank under the running job ({self.identities[path][0]:,} bytes "
                                f"at the start, {size:,} now): {CHANGED}")
            offset, self.pos = self.pos, self.pos + len(line)
            try:
                doc = read_document(self.tokenizer, line)
            except MalformedLine as why:
                if self.epoch == 0:
                    self._skip(path, offset, why)
                continue
            self.wraps_without_doc = 0
            self.doc_seg, self.doc_pos = self.seg, offset
            self.epoch_log.read(len(doc))
            return doc

    def _skip(self, path: str, offset: int, why: MalformedLine) -> None:
        self.malformed += 1
        self.skipped.add(f"byte {offset:,}")
        if self.skipped.count == 1:
            logger.warning(f"{path}: skipped a malformed line at byte {offset:,} ({why}); the progress lines count "
                           "those skipped")

    def _next_segment(self) -> None:
        self.close()
        path, _, end, _ = self.segments[self.seg]
        if self.skipped.count > 1:
            logger.warning(self.skipped.warning(path, f"malformed lines in bytes [{self.skipped_from:,}, {end:,})"))
        self.seg += 1
        if self.seg >= len(self.segments):
            self.wraps_without_doc += 1
            if self.wraps_without_doc > 1:  # a whole epoch passed without one valid document
                raise UserError(f"data source '{self.name}' has no valid document in rank {self.rank}'s share of "
                                f"{os.path.dirname(self.own_segments[0][0])}: every line is malformed")
            self.epoch_log.end_epoch(self.epoch)
            self.epoch, self.seg, self.segments = self.epoch + 1, 0, self.own_segments
        self.pos, self.skip = self.segments[self.seg][1], self.segments[self.seg][3]
        self.skipped, self.skipped_from = SkippedRows(), self.pos

    def _open(self, path: str):
        """The file, if it is still the one the run started with (not removed, replaced, shrunk or rewritten)."""
        try:
            file = open(path, "rb")
        except FileNotFoundError:
            raise UserError(f"data file {path} vanished under the running job: {CHANGED}") from None
        if _identity(os.fstat(file.fileno())) != self.identities[path]:
            file.close()
            raise UserError(f"data file {path} was replaced or changed under the running job: {CHANGED}")
        return file

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def state_dict(self) -> dict[str, Any]:
        partial = self.doc_off < len(self.doc)  # the carry-over buffer is the rest of this document
        seg, pos = (self.doc_seg, self.doc_pos) if partial else (self.seg, self.pos)
        state = {"epoch": self.epoch, "segment": seg, "byte": pos, "token": self.doc_off if partial else self.skip,
                 "malformed_lines": self.malformed, "total_bytes": self.total_bytes}
        if self.segments is not self.own_segments:  # file names, not paths: the data folder may move
            state["segments"] = [[os.path.basename(path), *rest] for path, *rest in self.segments]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["total_bytes"] != self.total_bytes:
            raise UserError(f"data source '{self.name}' changed since the loader state was saved "
                            f"({state['total_bytes']} bytes then, {self.total_bytes} now)")
        self.close()
        folder = os.path.dirname(self.own_segments[0][0])
        self.segments = [[os.path.join(folder, name), *rest] for name, *rest in state["segments"]] \
            if "segments" in state else self.own_segments
        self.epoch, self.seg, self.pos = state["epoch"], state["segment"], state["byte"]
        self.doc, self.doc_off, self.skip = [], 0, 0
        self.malformed, self.skipped, self.skipped_from = state["malformed_lines"], SkippedRows(), self.pos
        self.epoch_log.resumed()
        if self.seg >= len(self.segments):  # handed nothing of the resumed epoch: start the next one
            self.seg = len(self.segments) - 1
            self._next_segment()
        elif state["token"]:
            self.doc, self.doc_off = self._next_doc(), state["token"]



def _identity(stat: os.stat_result) -> tuple[int, int, int]:
    """Size, inode and modification time: a file removed, replaced, truncated or rewritten in place differs."""
    return stat.st_size, stat.st_ino, stat.st_mtime_ns


def line_start_at_or_after(path: str, offset: int) -> int:
    """First line boundary >= offset: a line starts at 0 or right after a newline."""
    if offset == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        f.readline()  # the rest of the line that byte offset-1 belongs to
        return f.tell()
