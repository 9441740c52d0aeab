"""Checkpoints with torch.distributed.checkpoint (DCP): saved, kept, read back; and consolidated weights (one file).

Layout of a run's checkpoints/ (the rest of its dump_dir: lingua/run_folder.py):
    0000001000/                    one complete checkpoint: DCP shards of model + optimizer (+ the weights'
                                   average, `ema.`, when the run keeps one: lingua/training/ema.py),
        params.json                the app and the resolved config (enough to rebuild the model),
        train_state_00000.json     each rank's loop state (`TrainState`: step, data loader, masking RNG),
        manifest.json              every file's size, written last: a missing or truncated file shows before loading
    0000000900.damaged             a checkpoint that failed to load, set aside: never loaded, counted or pruned
The run's consolidated.pt holds the final weights in one file, with the app and the config.

A checkpoint is written to a `.tmp` folder and renamed once every file and the folder are flushed to disk (the
manifest last), so a process killed while saving leaves the previous checkpoint in force; a save that fails (a full
disk) removes its `.tmp` folder and says why in one line. A step saved again moves its old copy aside as `.replaced`
until the new one is in place. Older checkpoints beyond `keep` are deleted through a `.deleting` rename, once the
new one's rename is on disk, so a half-deleted one never looks complete. When the next run starts, a `.replaced`
copy whose step has no other one is put back (the save was killed between its two renames); every other leftover of
a killed process is removed.

Nothing in a checkpoint folder is unpickled without restriction (`lingua.checkpoint.safe_dcp`), and the app it names
rebuilds the model only if it is one of this code's apps or the one the user named (`app=`), so opening one runs no
code. Every file a checkpoint names (in its manifest, its DCP metadata, or by its layout) must be a regular file inside
its folder, checked before it is opened (`lingua.files.safe.regular_file`): else it is damaged, never read from
elsewhere.

`python -m lingua.checkpoint consolidate CHECKPOINT_DIR OUT.pt [app=NAME]` writes any checkpoint's weights into one
file (the HuggingFace folder is lingua/export/hf_folder.py's).
"""

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from lingua.checkpoint import safe_dcp
from lingua.distributed import (
    all_reduce,
    collective_device,
    fail_together,
    on_rank_zero,
    parameters_finite,
    rank_and_world,
)
from lingua.errors import UserError, at_least
from lingua.files import untrusted
from lingua.files.safe import Fence, RefusedFile, atomic_write, fsync_dir, regular_file, unfenced
from lingua.run_folder import CONSOLIDATED, RunFolder

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"^\d{10}$")
LEFTOVER_NAME = re.compile(r"^\d{10}\.(tmp|deleting|replaced)$")
MANIFEST = "manifest.json"
PARAMS = "params.json"
LOW_DISK_BYTES = 2**20  # a save that fails with less free space than this failed because the disk is full


@dataclass
class CheckpointArgs:
    every: int = 1000  # steps between checkpoints (the last step and a stop signal always save)
    keep: int = 3  # most recent checkpoints kept; 0 keeps all

    def __post_init__(self):
        at_least(self, 1, "every")
        at_least(self, 0, "keep")


SAVED_ALWAYS = {"saved_always": True}  # the metadata of the TrainState fields that every saved state holds


@dataclass
class TrainState:
    """The loop's state on one rank, saved with every checkpoint (train_state_NNNNN.json) beside model and
    optimizer. A saved state holds the fields marked SAVED_ALWAYS, not None; the others may be absent."""

    step: int = field(default=0, metadata=SAVED_ALWAYS)
    data: dict | None = field(default=None, metadata=SAVED_ALWAYS)  # where the data loader is after `step`
    data_tokens: int = field(default=0, metadata=SAVED_ALWAYS)  # data tokens trained on so far, over all ranks
    generator: list[int] | None = None  # the masking generator's state (None: start it afresh)
    evaluation_skipped: bool = False  # the stop that saved this checkpoint skipped its step's evaluation
    best: dict | None = None  # the validation record where validation.keep_best was highest (best.pt's)
    compute: dict | None = None  # {"compute_flops": ..., "compute_flops_with_head": ...} spent up to `step`
    # the data tokens and compute spent before this run's phase (a run it continues, counted at that run's FLOPs per
    # token); None: none, or the whole run at this run's FLOPs per token
    phase_start: dict | None = None
    ema_from: int | None = None  # the step the weights' average (the checkpoint's `ema.`) started at; None: none

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> "TrainState":
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})

    @classmethod
    def saved_fields(cls) -> dict[str, type]:
        """{name: type} of the fields every saved state holds, from their annotations (None left out)."""
        hints = typing.get_type_hints(cls)
        return {f.name: _not_none(hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("saved_always")}


def _not_none(annotation) -> type:
    """The class an annotation such as `dict | None` asks for: dict."""
    kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)] or [annotation]
    return typing.get_origin(kinds[0]) or kinds[0]


class DamagedCheckpoint(Exception):
    """A checkpoint proven damaged: a file missing or of the wrong size, content that does not parse or is not what
    was saved. An I/O error while reading proves nothing (it may pass): it is raised as the OSError it is."""


def read_error(error: BaseException) -> OSError | None:
    """The I/O error behind a failed read (DCP wraps each rank's in a CheckpointException), unless it is a missing
    file, which is damage; None if there is none."""
    if isinstance(error, CheckpointException):
        return next(filter(None, (read_error(failure) for failure, _ in error.failures.values())), None)
    return error if isinstance(error, OSError) and not isinstance(error, FileNotFoundError) else None


def short_reason(error: BaseException) -> str:
    """One line for an exception, also for DCP's CheckpointException, whose text is a traceback per rank."""
    if isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _interruption(error: BaseException) -> bool:
    """A KeyboardInterrupt, or DCP's CheckpointException around one (DCP catches every exception on each rank)."""
    if isinstance(error, CheckpointException):
        return any(isinstance(failure[0], KeyboardInterrupt) for failure in error.failures.values())
    return isinstance(error, KeyboardInterrupt)


@contextlib.contextmanager
def _dcp_quietly():
    """DCP warns on every call that it runs in a single process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _read_json(path: Path, keys: dict[str, type] | None = None) -> dict:
    """A JSON object with the given keys of the given types, else DamagedCheckpoint."""
    try:
        data = regular_file(path, inside=path.parent).read_bytes()
    except RefusedFile as e:
        raise DamagedCheckpoint(str(e)) from None
    except FileNotFoundError:  # gone since it was checked; any other OSError is no proof of damage: it is raised as
        raise DamagedCheckpoint(f"{path.name} is missing") from None  # it is, and lingua.training.resume reads again
    try:
        content = untrusted.parse_json(data)
    except untrusted.Malformed as e:
        raise DamagedCheckpoint(f"{path.name}: {e}") from None
    wrong = not isinstance(content, dict) or any(not isinstance(content.get(k), t) for k, t in (keys or {}).items())
    if wrong:
        raise DamagedCheckpoint(f"{path.name} does not hold {', '.join(keys or {}) or 'a JSON object'}")
    return content


def verify(path: Path) -> dict:
    """The checkpoint's params.json, once every file its manifest lists is there with its size."""
    if (path / MANIFEST).exists():  # checkpoints of older versions have none: their load is the check
        manifest = _read_json(path / MANIFEST)
        if not all(isinstance(size, int) for size in manifest.values()):
            raise DamagedCheckpoint(f"{MANIFEST} does not hold file sizes")
        for name, size in manifest.items():
            file = path / name
            if not file.exists():
                raise DamagedCheckpoint(f"{name} is missing")
            try:
                regular_file(file, inside=path)
            except RefusedFile as e:
                raise DamagedCheckpoint(f"{MANIFEST} names {name}: {e}") from None
            if file.stat().st_size != size:
                raise DamagedCheckpoint(f"{name} has {file.stat().st_size} bytes, {size} were written")
    return _read_json(path / PARAMS, {"app": str, "config": dict})


def saved_shapes(path: Path, entry: str = "model") -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of an entry (`model`, `ema`) of a DCP checkpoint, from its metadata (no tensor is
    read)."""
    try:
        metadata = safe_dcp.read_metadata(path).state_dict_metadata
    except (Exception, CheckpointException) as e:
        if (unread := read_error(e)) is not None:
            raise unread from None
        raise DamagedCheckpoint(f".metadata: {short_reason(e)}") from None
    return {k.removeprefix(f"{entry}."): tuple(v.size) for k, v in metadata.items()
            if k.startswith(f"{entry}.") and hasattr(v, "size")}


class CheckpointManager:
    """A run's checkpoints folder. `fence` (the run lease's, lingua.files.safe.Fence) is checked by rank 0 right before
    each stage of a save, and every rank abides by it: a process whose lease was taken over writes no checkpoint."""

    def __init__(self, folder: str | Path, args: CheckpointArgs, fence: Fence = unfenced):
        self.folder, self.args, self.fence = Path(folder), args, fence

    def complete_checkpoints(self) -> list[Path]:
        """The step folders, oldest first; a link at one (to another run's checkpoint, say) is none of this run's:
        it is never loaded, counted or pruned."""
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir()
                      if CHECKPOINT_NAME.match(p.name) and p.is_dir() and not p.is_symlink())

    def latest(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def damaged_checkpoints(self) -> list[Path]:
        return sorted(self.folder.glob("*.damaged*")) if self.folder.is_dir() else []

    def remove_leftovers(self) -> None:
        """What processes killed while saving or pruning left: a `.replaced` checkpoint whose step has no other copy
        is put back (it is the newest complete one); half-written (`.tmp`), half-deleted (`.deleting`) and
        superseded (`.replaced`) folders are removed."""
        on_rank_zero(self._remove_leftovers)

    def _remove_leftovers(self) -> None:
        for leftover in self.folder.iterdir() if self.folder.is_dir() else []:
            if leftover.is_dir() and LEFTOVER_NAME.match(leftover.name):
                try:
                    self._recover(leftover)
                except OSError as e:
                    raise UserError(f"cannot recover {leftover}, left by a killed process: {e.strerror}") from None

    def _recover(self, leftover: Path) -> None:
        step = leftover.with_suffix("")
        if leftover.suffix == ".replaced" and not step.exists():  # killed between the two renames of `_complete`
            os.replace(leftover, step)
            fsync_dir(self.folder)
            logger.info(f"restored checkpoint {step.name}, set aside by a process killed while saving it again")
        else:
            shutil.rmtree(leftover)
            logger.info(f"removed {leftover.name}, left by a process killed while saving or pruning")

    def check_folder(self, run: RunFolder) -> None:
        """The checkpoints folder (`run`'s) is a folder, or absent: never a file, nor a link (dangling or not:
        checkpoints written through it would land, and older ones be pruned, outside the run folder)."""
        run.writable(self.folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise UserError(f"{self.folder} is a file, not the run's checkpoint folder")

    def set_aside(self, path: Path) -> Path:
        """Renames a damaged checkpoint so it is never loaded, counted or pruned again; its files stay. Rank 0 only."""
        target, n = path.with_name(path.name + ".damaged"), 1
        while target.exists():
            target, n = path.with_name(f"{path.name}.damaged-{n}"), n + 1
        os.replace(path, target)
        return target

    def save(self, step: int, model: nn.Module, optimizer, train_state: dict, params: dict,
             average: dict | None = None) -> Path:
        """Every rank calls it; `average`: the weights' average (lingua.training.ema), if the run keeps one. The
        stages (rank 0 makes the folder; every rank writes its part; rank 0 completes it) end in an agreement: a
        failure on any rank (a full disk, a lost mount) is raised on every rank, once the `.tmp` folder is removed,
        and the previous checkpoint stays in force."""
        rank, _ = rank_and_world()
        final = self.folder / f"{step:010d}"
        tmp = final.with_name(final.name + ".tmp")
        self._stage(final, tmp, lambda: tmp.mkdir(parents=True) if rank == 0 else None)
        self._stage(final, tmp, lambda: self._write(tmp, rank, model, optimizer, train_state, params, average))
        self._stage(final, tmp, lambda: self._complete(final, tmp) if rank == 0 else None)
        return final

    def _stage(self, final: Path, tmp: Path, write) -> None:
        """One stage of `save`, agreed over the ranks: first whether rank 0 still holds the lease (else no rank
        writes: the others would wait in DCP's collectives for it), then whether every rank wrote its part. A second
        Ctrl-C during it (which DCP hands back wrapped in a CheckpointException) on any rank is an interruption on
        every rank, once the ranks have agreed."""
        rank = rank_and_world()[0]
        fail_together(self.fence() if rank == 0 else None)
        failure, interrupted = None, False
        try:
            write()
        except (Exception, CheckpointException, KeyboardInterrupt) as e:
            interrupted = _interruption(e)
            failure = f"could not save checkpoint {final}: {self._save_failure(e)}; {self.kept()}"
        try:
            fail_together(failure)
        except UserError:
            if rank == 0 and self.fence() is None:
                shutil.rmtree(tmp, ignore_errors=True)
            if all_reduce(torch.tensor([interrupted], dtype=torch.int32, device=collective_device()), "max").item():
                raise KeyboardInterrupt from None
            raise

    def kept(self) -> str:
        """What the run resumes from, the truth at this moment: the newest complete checkpoint, or none."""
        latest = self.latest()
        return f"the same command resumes from checkpoint {latest.name}" if latest else \
            "there is no checkpoint, so the same command starts the run over"

    @staticmethod
    def _write(tmp: Path, rank: int, model: nn.Module, optimizer, train_state: dict, params: dict,
               average: dict | None) -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _dcp_quietly():
            dcp.save({"model": model_sd, "optim": optim_sd, **({"ema": average} if average else {})},
                     checkpoint_id=str(tmp))
        atomic_write(tmp / f"train_state_{rank:05d}.json", json.dumps(train_state))  # flushed, as DCP's files are
        if rank == 0:
            atomic_write(tmp / PARAMS, json.dumps(params))

    def _complete(self, final: Path, tmp: Path) -> None:
        """Rank 0, once every rank has written its part: the manifest, then the rename that makes it complete. At
        every moment a complete copy of the newest step is on disk where the next start finds it."""
        sizes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        atomic_write(tmp / MANIFEST, json.dumps(sizes))  # last; it flushes the folder's entries too
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # the same step saved again: the old copy stays whole, put back if killed before the swap
            os.replace(final, replaced)
            fsync_dir(self.folder)
        os.replace(tmp, final)  # the folder's rename is atomic
        for folder in (self.folder, self.folder.parent):  # the rename (and, at the first save, the checkpoints
            fsync_dir(folder)  # folder itself) on disk before any older checkpoint goes
        self._prune(replaced)
        logger.info(f"saved checkpoint {final}")

    def _save_failure(self, error: BaseException) -> str:
        """DCP reports a full disk as a torn zip record, not ENOSPC: the free space tells."""
        if _interruption(error):
            return "interrupted (Ctrl-C)"
        free = shutil.disk_usage(self.folder if self.folder.exists() else self.folder.parent).free
        if getattr(error, "errno", None) == errno.ENOSPC or free < LOW_DISK_BYTES:
            return f"the disk is full ({free:,} bytes free)"
        return short_reason(error)

    def load(self, path: Path, model: nn.Module, optimizer, average: dict | None = None) -> list[dict]:
        """Resumes from one of this run's checkpoints (`Checkpoint.load_training`). Called by every rank."""
        return Checkpoint.read(path).load_training(model, optimizer, average)

    def _prune(self, replaced: Path) -> None:
        """Deletes the checkpoints beyond `keep` and the `replaced` copy of a step saved again; one that cannot be
        deleted is named and left (removed when the next run starts): the new checkpoint is saved, the run goes on."""
        doomed = [old.with_name(old.name + ".deleting") for old in
                  (self.complete_checkpoints()[: -self.args.keep] if self.args.keep > 0 else [])]
        try:
            for folder in doomed:  # renamed first: no longer looks complete, even if killed mid-delete
                os.replace(folder.with_name(folder.name.removesuffix(".deleting")), folder)
            for folder in [*self.folder.glob("*.deleting"), *([replaced] if replaced.exists() else [])]:
                shutil.rmtree(folder)
        except OSError as e:
            logger.warning(f"could not delete an old checkpoint ({e.strerror}: {e.filename}): it is left in place")


def save_consolidated(model: nn.Module, params: dict, path: str | Path, fence: Fence = unfenced) -> Path:
    """All weights in one file (gathered from every rank), with the app and config that rebuild the model; written
    by rank 0 once `fence` has said it still may."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    path = Path(path)

    def write() -> None:
        lost = fence()
        if lost is not None:
            raise UserError(lost)
        try:
            atomic_write(path, lambda file: torch.save({**params, "model": weights}, file))
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            reason = e.strerror if isinstance(e, OSError) and e.strerror else short_reason(e)
            raise UserError(f"cannot write {path}: {reason}") from None

    on_rank_zero(write)  # rank 0 writes; its failure is every rank's
    return path


class Checkpoint:
    """The one reader of what the library saves: a checkpoint folder (DCP shards), a run's dump_dir (its newest
    complete checkpoint, else its consolidated.pt: a run extended after its consolidated.pt has newer weights in its
    checkpoints) or a consolidated file. Opening reads the app, the config and every model tensor's shape, no
    weight; `load_into` puts the weights into a model as it is (full or sharded). The model is built by its app
    (`lingua.app.load_model`): one of this code's or `named_app`, the one the user named for this command (any other
    is refused unimported: the app is a name read from the file). Every problem is one line naming the file."""

    def __init__(self, path: Path, params: dict, shapes: dict[str, tuple[int, ...]], weights: dict | None = None,
                 named_app: str | None = None, average_shapes: dict[str, tuple[int, ...]] | None = None):
        self.path, self.params, self.shapes, self.named_app = path, params, shapes, named_app
        self.average_shapes = average_shapes or {}  # of the weights' average (`ema.`), when it holds one
        self._weights = weights  # a consolidated file's tensors, memory-mapped

    @property
    def app_name(self) -> str:
        return self.params["app"]

    @property
    def config(self) -> dict:
        return self.params["config"]

    @classmethod
    def open(cls, path: str | Path, app: str | None = None) -> "Checkpoint":
        """`app`: the app the user named on the command line (app=NAME), trusted to rebuild it beside this code's."""
        path = cls.resolve(path)
        try:
            return cls.read(path, app)
        except DamagedCheckpoint as e:
            raise UserError(f"checkpoint {path} is damaged: {e}") from None
        except OSError as e:
            raise UserError(f"cannot read checkpoint {path}: {e.strerror or e}") from None

    @staticmethod
    def resolve(path: str | Path) -> Path:
        """The folder or file that `open` reads for `path`."""
        path = Path(path)
        if not path.exists():
            raise UserError(f"checkpoint not found: {path}")
        if path.is_dir() and not (path / PARAMS).exists():
            run = RunFolder(path)
            latest = CheckpointManager(run.checkpoints, CheckpointArgs()).latest()
            if latest is not None:
                return latest
            if not run.finished:
                raise UserError(f"no complete checkpoint, {CONSOLIDATED} or {PARAMS} found in {path}")
            try:
                return regular_file(run.consolidated, inside=path)
            except RefusedFile as e:
                raise UserError(f"run {path} is damaged: {e}") from None
        return path

    @classmethod
    def read(cls, path: Path, named_app: str | None = None) -> "Checkpoint":
        """A checkpoint folder or a consolidated file; DamagedCheckpoint for a folder with a missing, truncated or
        unparsable file, OSError for a file that could not be read."""
        if path.is_dir():
            return cls(path, verify(path), saved_shapes(path), named_app=named_app,
                       average_shapes=saved_shapes(path, "ema"))
        try:
            regular_file(path)  # a FIFO would block torch.load for ever
        except RefusedFile as e:
            raise UserError(f"{e}: not a checkpoint") from None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except OSError as e:  # the disk failed to read it (EIO): that says nothing of what it holds
            raise UserError(f"cannot read {path}: {e.strerror or e}") from None
        except Exception as e:  # pickle, zip and torch errors of every kind: this is not one of our files
            raise UserError(f"{path} is not a checkpoint (torch.load: {type(e).__name__})") from None
        if not isinstance(saved, dict) or not {"app", "config", "model"} <= saved.keys() or \
                not isinstance(saved["app"], str) or not isinstance(saved["config"], dict):
            raise UserError(f"{path} is not a checkpoint of this library (no app, config and model in it)")
        shapes = {k: tuple(v.shape) for k, v in saved["model"].items()}
        return cls(path, {"app": saved["app"], "config": saved["config"]}, shapes, saved["model"], named_app)

    @property
    def averaged(self) -> bool:
        """It holds the weights' average (a run with ema.decay saves it in every checkpoint)."""
        return bool(self.average_shapes)

    def mismatches(self, model: nn.Module) -> list[str]:
        """Parameter names whose saved shape differs from the model's, or that only one side has (global shapes of
        a sharded model; no communication)."""
        return shape_mismatches(self.shapes, model)

    def load_into(self, model: nn.Module) -> None:
        """The model weights (no optimizer state, no step) into `model` as it is: sharded, compiled or plain. Every
        rank calls it. A model of another shape is refused before anything is read."""
        mismatched = self.mismatches(model)
        if mismatched:
            raise UserError(f"{self.path} holds a model of another shape (first difference: {mismatched[0]})")
        try:
            if self._weights is None:
                state = {"model": get_model_state_dict(model)}
                with _dcp_quietly():
                    safe_dcp.load(state, self.path)
                set_model_state_dict(model, state["model"])
            else:
                set_model_state_dict(model, self._weights, options=StateDictOptions(full_state_dict=True))
        except (Exception, CheckpointException) as e:
            raise self._load_failure(e) from None

    def _load_failure(self, error: BaseException) -> UserError:
        """The one line for weights that could not be loaded: an I/O error (it may pass) or damage."""
        if (unread := read_error(error)) is not None:
            return UserError(f"cannot read checkpoint {self.path}: {unread.strerror or unread}")
        return UserError(f"checkpoint {self.path} is damaged: {short_reason(error)}")

    def load_average_into(self, model: nn.Module) -> None:
        """The weights' average in place of the raw weights of the parameters it covers (`model` holds this
        checkpoint's weights: `load_into`). Every rank calls it."""
        if not self.averaged:
            raise UserError(f"{self.path} holds no average of the weights (its run kept none: ema.decay)")
        weights = get_model_state_dict(model)
        mismatched = sorted(k for k, shape in self.average_shapes.items()
                            if k not in weights or tuple(weights[k].shape) != shape)
        if mismatched:
            raise UserError(f"{self.path} holds an average of another model (first difference: {mismatched[0]})")
        state = {"ema": {k: weights[k] for k in self.average_shapes}}
        try:
            with _dcp_quietly():
                safe_dcp.load(state, self.path)
            set_model_state_dict(model, state["ema"], options=StateDictOptions(strict=False))
        except (Exception, CheckpointException) as e:
            raise self._load_failure(e) from None

    def load_training(self, model: nn.Module, optimizer, average: dict | None = None) -> list[dict]:
        """Model and optimizer in place, to resume training (on any world size: DCP reshards), and `average` (the
        weights' average, WeightsAverage.state_dict) when the checkpoint holds one; the train state of
        every rank that saved the checkpoint. DamagedCheckpoint if it is damaged, OSError if a file could not be read
        (`read_error`). Called by every rank."""
        if self._weights is not None:
            raise UserError(f"{self.path} holds weights only (no optimizer state): it cannot be resumed")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        averaged = {"ema": average} if average and self.averaged else {}
        state = {"model": model_sd, "optim": optim_sd, **averaged}
        try:
            with _dcp_quietly():
                safe_dcp.load(state, self.path)
        except (Exception, CheckpointException) as e:
            if (unread := read_error(e)) is not None:
                raise unread from None
            raise DamagedCheckpoint(short_reason(e)) from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if not parameters_finite(model, optimizer, averaged.get("ema", {}).values()):  # bytes corrupted in place
            raise DamagedCheckpoint(f"its weights{', average' if averaged else ''} or optimizer state are not all "
                                    "finite")
        keys = TrainState.saved_fields()
        return [_read_json(file, keys) for file in sorted(self.path.glob("train_state_*.json"))]


def shape_mismatches(saved: dict[str, tuple[int, ...]], model: nn.Module) -> list[str]:
    """Parameter names whose saved shape differs from the model's, or that only one side has."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return sorted(k for k in saved.keys() | expected.keys() if saved.get(k) != expected.get(k))
