"""Checkpoints with torch.distributed.checkpoint (DCP), resume, and export of consolidated weights.

Layout of a run's dump_dir:
    checkpoints/0000001000/        one complete checkpoint: DCP shards of model + optimizer,
        params.json                the app and the resolved config (enough to rebuild the model),
        train_state_00000.json     each rank's loop state (step, scheduler, data loader, masking RNG)
    consolidated.pt                the final weights in one file, with the app and the config

A checkpoint is written to a `.tmp` folder and renamed once every file is on disk, so a process killed while
saving leaves the previous checkpoint in force. Older checkpoints beyond `keep` are deleted.

`python -m lingua.checkpoint export CHECKPOINT_DIR OUT.pt` consolidates any checkpoint into one file.
"""

import contextlib
import importlib
import json
import logging
import os
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from lingua.args import UserError, from_dict

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = re.compile(r"^\d{10}$")
CONSOLIDATED = "consolidated.pt"


@dataclass
class CheckpointArgs:
    every: int = 1000  # steps between checkpoints (the last step and a stop signal always save)
    keep: int = 3  # most recent checkpoints kept; 0 keeps all


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def _dcp_quietly():
    """DCP warns on every call that it runs in a single process; that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class CheckpointManager:
    def __init__(self, folder: str | Path, args: CheckpointArgs):
        self.folder, self.args = Path(folder), args

    def complete_checkpoints(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name))

    def latest(self) -> Path | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def save(self, step: int, model: nn.Module, optimizer, train_state: dict, params: dict) -> Path:
        rank, _ = rank_and_world()
        final = self.folder / f"{step:010d}"
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            for leftover in self.folder.glob("*.tmp"):  # left by a process killed while saving
                shutil.rmtree(leftover)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _dcp_quietly():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        (tmp / f"train_state_{rank:05d}.json").write_text(json.dumps(train_state))  # the folder's rename is atomic
        if rank == 0:
            (tmp / "params.json").write_text(json.dumps(params))
        _barrier()
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            self._prune()
            logger.info(f"saved checkpoint {final}")
        _barrier()
        return final

    def load(self, path: Path, model: nn.Module, optimizer) -> dict:
        """Loads model and optimizer in place; returns this rank's train state."""
        rank, _ = rank_and_world()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with _dcp_quietly():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        state_file = path / f"train_state_{rank:05d}.json"
        if not state_file.exists():
            raise UserError(f"{state_file} is missing: resume with the world size the checkpoint was saved with")
        logger.info(f"resumed from {path}")
        return json.loads(state_file.read_text())

    def _prune(self) -> None:
        if self.args.keep > 0:
            for old in self.complete_checkpoints()[: -self.args.keep]:
                doomed = old.with_name(old.name + ".deleting")  # no longer looks complete, even if killed mid-delete
                os.replace(old, doomed)
                shutil.rmtree(doomed)


def export_consolidated(model: nn.Module, params: dict, path: str | Path) -> Path:
    """All weights in one file (gathered from every rank), with the app and config that rebuild the model."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    path = Path(path)
    if rank_and_world()[0] == 0:
        tmp = path.with_name(path.name + ".tmp")
        torch.save({**params, "model": weights}, tmp)
        os.replace(tmp, path)
    return path


def build_from_params(params: dict, device: str | torch.device = "cpu"):
    """Rebuilds (initialised, untrained) model, config and tokenizer from {"app": module, "config": dict}."""
    from lingua.tokenizer import build_tokenizer

    app = importlib.import_module(params["app"]).APP
    config = from_dict(app.args_cls, params["config"])
    tokenizer = build_tokenizer(config.data.tokenizer)
    with torch.device("meta"):
        model = app.build_model(config.model, tokenizer)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model, config, tokenizer


def resolve_checkpoint(path: str | Path) -> Path:
    """A consolidated file, a checkpoint folder, or a run's dump_dir (its newest complete checkpoint, else its
    consolidated.pt: a run extended after its export has newer weights in its checkpoints)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint not found: {path}")
    if path.is_dir() and not (path / "params.json").exists():
        latest = CheckpointManager(path / "checkpoints", CheckpointArgs()).latest()
        if latest is not None:
            return latest
        if not (path / CONSOLIDATED).exists():
            raise UserError(f"no complete checkpoint, consolidated.pt or params.json found in {path}")
        return path / CONSOLIDATED
    return path


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """Model (eval mode), config and tokenizer from anything `resolve_checkpoint` accepts."""
    path = resolve_checkpoint(path)
    if path.is_dir():
        params = json.loads((path / "params.json").read_text())
        model, config, tokenizer = build_from_params(params, device)
        state = {"model": get_model_state_dict(model)}
        with _dcp_quietly():
            dcp.load(state, checkpoint_id=str(path))
        model.load_state_dict(state["model"])
    else:
        saved = torch.load(path, map_location=device, weights_only=True)
        model, config, tokenizer = build_from_params(saved, device)
        model.load_state_dict(saved["model"])
    return model.eval(), config, tokenizer


def main(argv: list[str]) -> None:
    if len(argv) != 3 or argv[0] != "export":
        sys.exit("usage: python -m lingua.checkpoint export CHECKPOINT_DIR OUT.pt")
    try:
        checkpoint = resolve_checkpoint(argv[1])
        if not checkpoint.is_dir():
            raise UserError(f"{checkpoint} is already a consolidated file")
        model, _, _ = load_model(checkpoint)
        params = json.loads((checkpoint / "params.json").read_text())
        print(f"wrote {export_consolidated(model, params, argv[2])}")
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
