"""One rank's share of a source of shard files read in place (any format of lingua/data/documents.py): an endless
stream of tokens, and the state that resumes it exactly, on the same number of ranks or on another.

Order: every epoch, the source's shards are permuted from (seed, source, epoch), and rank r of W reads those at
positions r, r+W, ... of the permutation. Within a shard, documents are shuffled in blocks of `shuffle_buffer`
consecutive documents, each block permuted from (seed, epoch, shard, block). A position is a few integers (which
piece, which block, which document of the block's permutation, how many of its tokens are used), never a list of
documents: resuming re-reads one block, and a compressed shard is decompressed from its start up to that block
(docs/data.md measures what that costs per format). Nothing is opened before it is read: a source of 30,000 shards
costs its listing and one open file per rank.

A piece is [shard, epoch, block, document, token]: the rest of a shard from that position. An epoch's pieces are its
shards whole, except after a change in the number of ranks (`repartition_shards`), which deals the unread rest of
every old rank's epoch out to the new ranks: no document of it is read twice or skipped.
"""

import itertools
import logging
import os
import zlib
from typing import Any

import numpy as np

from lingua.data.documents import CHANGED, EpochLog, MalformedLine, SkippedRows, documents, tokens_of
from lingua.errors import UserError

logger = logging.getLogger(__name__)


def _key(text: str) -> int:
    return zlib.crc32(text.encode())


def own_pieces(source: str, shards: list[str], seed: int, epoch: int, rank: int, world_size: int) -> list[list]:
    """Rank `rank`'s shards in epoch `epoch`, each whole: [shard, epoch, 0, 0, 0]."""
    order = np.random.default_rng([seed, _key(source), epoch]).permutation(len(shards))
    return [[shards[i], epoch, 0, 0, 0] for i in order[rank::world_size]]


def listing_key(shards: list[str]) -> int:
    """What a saved state checks the source against: the same shard names, in the same order."""
    return _key("\n".join(shards))


class ShardStream:
    """One rank's share of one source of shards; `take(n)` hands out its next n tokens, documents packed end to end.

    Malformed rows are skipped; those of the first epoch are counted. The first one of a piece is reported at once,
    with why; a piece that had more is summed up when the rank leaves it."""

    def __init__(self, name: str, folder: str, shards: list[str], rank: int, world_size: int, tokenizer,
                 batch_tokens: float, seed: int, text_field: str, shuffle_buffer: int):
        if len(shards) < world_size:
            raise UserError(f"data source '{name}' has {len(shards)} training shard file(s) for {world_size} ranks: "
                            "each rank reads whole shards, so give at least one per rank (or write the source with "
                            "setup/prepare_data.py, whose layout is shared out by bytes)")
        self.name, self.folder, self.shards, self.rank, self.world_size = name, folder, shards, rank, world_size
        self.tokenizer, self.seed, self.text_field, self.block_size = tokenizer, seed, text_field, shuffle_buffer
        self.epoch_log = EpochLog(name, rank, batch_tokens)
        self.malformed = 0  # rows skipped in the first epoch
        self.epoch = 0
        self.doc: list[int] = []  # the current document (<s> ... </s>) and how much of it is handed out
        self.doc_off, self.doc_at = 0, (0, 0, 0)  # ... and its position: (piece, block, index in the block's order)
        self._last_position = self.doc_at  # of the document _next_doc returned last
        self.identity = None  # (size, mtime) of the open shard
        self._enter_epoch(own_pieces(name, shards, seed, 0, rank, world_size), own=True, position=None)

    # ---------------------------------------------------------------- reading

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.doc_off == len(self.doc):
                self.doc, self.doc_off, self.doc_at = self._next_doc(), self.skip_tokens, self._last_position
                self.skip_tokens = 0
            k = min(n - len(out), len(self.doc) - self.doc_off)
            out += self.doc[self.doc_off : self.doc_off + k]
            self.doc_off += k
        return out

    def _next_doc(self) -> list[int]:
        epochs_without_doc = 0
        while True:
            if self.piece >= len(self.pieces):
                epochs_without_doc += 1
                if epochs_without_doc > 1:  # a whole epoch passed without one valid document
                    raise UserError(f"data source '{self.name}' has no valid document in rank {self.rank}'s shards "
                                    f"of {self.folder}: every row is malformed")
                self._end_epoch()
                continue
            if self.block_texts is None and not self._read_block():
                self._next_piece()
                continue
            if self.index >= len(self.block_texts):
                if len(self.block_texts) < self.block_size:  # the shard's end
                    self._next_piece()
                else:
                    self.block, self.index, self.block_texts = self.block + self.block_size, 0, None
                continue
            text = self.block_texts[self.order[self.index]]
            self._last_position = (self.piece, self.block, self.index)
            self.index += 1
            try:
                if isinstance(text, MalformedLine):
                    raise text
                tokens = tokens_of(self.tokenizer, text)
                self.epoch_log.read(len(tokens))
                return tokens
            except MalformedLine as why:
                if self.pieces[self.piece][1] == 0:
                    self._skip(self.block + self.order[self.index - 1], why)

    def _read_block(self) -> bool:
        """Reads the current block and its order; False at the shard's end."""
        shard, epoch = self.pieces[self.piece][:2]
        if self.reader is None:
            path = os.path.join(self.folder, shard)
            identity = _identity(path, self.name)
            if self.expected_identity is not None and identity != self.expected_identity:
                raise UserError(f"data file {path} was replaced or changed under the running job: {CHANGED}")
            self.identity, self.expected_identity = identity, None
            self.reader = documents(path, self.text_field, start=self.block)
        self.block_texts = list(itertools.islice(self.reader, self.block_size))
        rng = np.random.default_rng([self.seed, epoch, _key(shard), self.block])
        self.order = rng.permutation(len(self.block_texts))
        return bool(self.block_texts)

    def _skip(self, document: int, why: MalformedLine) -> None:
        self.malformed += 1
        self.skipped.add(f"document {document:,}")
        if self.skipped.count == 1:
            logger.warning(f"{os.path.join(self.folder, self.pieces[self.piece][0])}: skipped a malformed row, "
                           f"document {document:,} ({why}); the progress lines count those skipped")

    def _next_piece(self) -> None:
        if self.skipped.count > 1:
            path = os.path.join(self.folder, self.pieces[self.piece][0])
            logger.warning(self.skipped.warning(path, "malformed rows"))
        self.close()
        self._start_piece(self.piece + 1, None)

    def _end_epoch(self) -> None:
        self.epoch_log.end_epoch(self.epoch)
        self.epoch += 1
        self._enter_epoch(own_pieces(self.name, self.shards, self.seed, self.epoch, self.rank, self.world_size),
                          own=True, position=None)

    def _enter_epoch(self, pieces: list[list], own: bool, position: tuple[int, int, int, int] | None) -> None:
        """`own`: the rank's own shards of the epoch, else pieces dealt out by repartition_shards (kept in the
        state)."""
        self.pieces, self.own, self.reader = pieces, own, None
        self._start_piece(position[0] if position else 0, position)

    def _start_piece(self, piece: int, position: tuple[int, int, int, int] | None) -> None:
        """At `position` (piece, block, index, tokens used) of a resumed state, else at the piece's own start."""
        self.piece, self.reader, self.block_texts, self.expected_identity = piece, None, None, None
        self.skipped = SkippedRows()
        self.block, self.index, self.skip_tokens = 0, 0, 0
        if position is not None:
            _, self.block, self.index, self.skip_tokens = position
        elif piece < len(self.pieces):
            _, _, self.block, self.index, self.skip_tokens = self.pieces[piece]

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        partial = self.doc_off < len(self.doc)  # the carry-over is the rest of this document
        piece, block, index = self.doc_at if partial else (self.piece, self.block, self.index)
        token = self.doc_off if partial else self.skip_tokens
        state = {"epoch": self.epoch, "piece": piece, "block": block, "document": index, "token": token,
                 "malformed_lines": self.malformed, "shards": len(self.shards), "listing": listing_key(self.shards),
                 "identity": self.identity if piece == self.piece and self.reader is not None else None}
        if not self.own:
            state["pieces"] = self.pieces
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["shards"], state["listing"]) != (len(self.shards), listing_key(self.shards)):
            raise UserError(f"data source '{self.name}' changed since the loader state was saved ({state['shards']:,} "
                            f"training shards then, {len(self.shards):,} now, or other names)")
        self.close()
        self.epoch, self.malformed = state["epoch"], state["malformed_lines"]
        self.doc, self.doc_off = [], 0
        self.epoch_log.resumed()
        own = "pieces" not in state
        pieces = own_pieces(self.name, self.shards, self.seed, self.epoch, self.rank, self.world_size) if own \
            else state["pieces"]
        self._enter_epoch(pieces, own, (state["piece"], state["block"], state["document"], state["token"]))
        self.expected_identity = state["identity"] and tuple(state["identity"])
        if state["token"]:  # the carry-over document, from its used tokens on
            self.doc, self.doc_off, self.doc_at = self._next_doc(), self.skip_tokens, self._last_position
            self.skip_tokens = 0

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def repartition_shards(name: str, shards: list[str], states: list[tuple[int, int, dict[str, Any]]], world_size: int,
                       seed: int) -> list[dict[str, Any]]:
    """This source's states for `world_size` ranks from those saved by another number of ranks: the unread rest of
    every old rank's epoch (its partly read shard from the saved position on, then its shards not yet opened), dealt
    out in turn to the new ranks, whose later epochs are their own. `states`: (old rank, old world size, state)."""
    rest, epoch = [], min(state["epoch"] for _, _, state in states)
    for old_rank, old_world_size, state in states:
        if (state["shards"], state["listing"]) != (len(shards), listing_key(shards)):
            raise UserError(f"data source '{name}' changed since the loader state was saved ({state['shards']:,} "
                            f"training shards then, {len(shards):,} now, or other names)")
        pieces = state["pieces"] if "pieces" in state else \
            own_pieces(name, shards, seed, state["epoch"], old_rank, old_world_size)
        if state["piece"] < len(pieces):
            shard, piece_epoch = pieces[state["piece"]][:2]
            rest += [[shard, piece_epoch, state["block"], state["document"], state["token"]],
                     *pieces[state["piece"] + 1 :]]
    malformed = sum(state["malformed_lines"] for _, _, state in states)
    new = []
    for rank in range(world_size):
        pieces = rest[rank::world_size]
        first = pieces[0][2:] if pieces else [0, 0, 0]
        new.append({"epoch": epoch, "piece": 0, "block": first[0], "document": first[1], "token": first[2],
                    "malformed_lines": malformed if rank == 0 else 0, "shards": len(shards),
                    "listing": listing_key(shards), "identity": None, "pieces": pieces})
    logger.info(f"data source '{name}': the unread rest of epoch {epoch} ({len(rest):,} shard(s) or parts) of "
                f"{len(states)} rank(s) is dealt out to {world_size} rank(s)")
    return new


def _identity(path: str, source: str) -> tuple[int, int]:
    """Size and modification time: a shard replaced or rewritten between a save and its resume differs."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"data file {path} of source '{source}' vanished under the running job: {CHANGED}") from None
    return stat.st_size, stat.st_mtime_ns
