"""What a run starts from (`Start`: read once, before its config is decided) and the resume policy: which checkpoint
a run in an existing dump_dir continues from, what is refused (another app, another architecture) and what is only
reported (changed settings).

A new run may also continue from another run's checkpoint (`continue_from`): a decay branch of a stable WSD run, or
a phase (a longer data.seq_len with the model's max_seqlen and rope_theta, another data mix or mask ratio). It
carries the weights, the optimizer state, the step, the token count and the data position; the parent run is only
read (its lock is not taken), and the new run writes into its own dump_dir."""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lingua.app import App
from lingua.args import config_changes, to_dict
from lingua.checkpoint.store import Checkpoint, CheckpointArgs, CheckpointManager, DamagedCheckpoint, verify
from lingua.distributed import Launch, agreed_failure, barrier, broadcast_object, fail_together, on_every_rank
from lingua.errors import UserError
from lingua.model.transformer import architecture_fields
from lingua.run_folder import CHECKPOINTS, RunFolder
from lingua.training.optim import lr_at

logger = logging.getLogger(__name__)

# what a phase may change in the model: the RoPE table's length and base (no tensor of the checkpoint depends on them)
GROWABLE = ("max_seqlen", "rope_theta")
# data settings a continued run may change and keep its data position (each source's position is in its own files)
KEEP_DATA_POSITION = ("sources", "validation_sources", "seq_len", "batch_size", "prefetch", "document_mask")

READ_ATTEMPTS = 4  # an I/O error while reading a checkpoint (a network file system's hiccup) is tried again,
RETRY_DELAY_S = 2.0  # after this, then twice as long each time; then the run stops, every checkpoint kept


@dataclass(frozen=True)
class Start:
    """How a run starts, read once, before its config is decided: its folder, and a new run (from init_from's
    weights when given) or a resumed one. The app's `configure` decides the config from it; the loop hands it to the
    run lock, the resume and the Trainer, which ask it rather than the dump_dir again."""

    run: RunFolder  # the run's folder (its dump_dir), the one object every part of the start is given
    init_from: Checkpoint | None = None  # a new run's init_from, opened: its config and shapes (its weights load into
    # the model later, through this same object)
    resumed: dict | None = None  # the config of the run in dump_dir, when it resumes (its newest checkpoint's)
    world_size: int = 1  # processes of this launch
    data: dict = field(default_factory=dict)  # what the data pipeline's `check` reports, e.g. {"train_rows": N}
    continued: Checkpoint | None = None  # a new run's continue_from, opened (a checkpoint folder of another run)


def open_start(app: App, config, run: RunFolder, world_size: int) -> Start:
    """How the run in `run` (config.dump_dir's folder) starts: the resumed run's config, else init_from opened (a
    resumed run has its own weights: its init_from may be gone), and the data's facts; a UserError for a bad
    init_from or bad data, before anything is written."""
    resumed, init_from, continued = resumed_config(run), None, None
    if config.continue_from:
        _check_continued_folder(run, config.continue_from, resumed)
    if resumed is None:
        init_from = _open("init_from", config.init_from, app)
        continued = _open("continue_from", config.continue_from, app)
    if continued is not None and not continued.path.is_dir():
        raise UserError(f"continue_from {continued.path} holds weights only: name a run or one of its checkpoint "
                        f"folders (DUMP_DIR/{CHECKPOINTS}/N), which hold the optimizer state and the data position")
    return Start(run, init_from, resumed, world_size, app.data.check(config.data), continued)


def _check_continued_folder(run: RunFolder, continue_from: str, resumed: dict | None) -> None:
    """A continued run has a folder of its own: continue_from in it would resume the parent itself, writing into it
    (and pruning its checkpoints); a folder holding another run (one not continued from that run, or from another of
    its checkpoints) would resume that run and never continue as asked."""
    parent = RunFolder.of(continue_from).root.resolve()
    if parent == run.root.resolve():
        raise UserError(f"continue_from {continue_from} is in this run's own folder: a continued run needs a dump_dir "
                        "of its own (its parent is only read)")
    recorded = (resumed or {}).get("continue_from")
    named_checkpoint = Path(continue_from).parent.name == CHECKPOINTS
    if resumed is not None and (not recorded or RunFolder.of(recorded).root.resolve() != parent or (
            named_checkpoint and Path(continue_from).resolve() != Path(recorded).resolve())):
        holds = f"a run continued from {recorded}" if recorded else "a run of its own"
        raise UserError(f"dump_dir {run.root} holds {holds}, not one continued from {continue_from}: name a new "
                        "dump_dir")


def _open(key: str, path: str, app: App) -> Checkpoint | None:
    """The checkpoint config key `key` names, opened (shapes and config, no weight); None when it names none."""
    if not path:
        return None
    try:
        return Checkpoint.open(path, app.name)  # this run's app is the one its command names
    except UserError as e:
        raise UserError(f"{key}: {e}") from None


def resumed_config(run: RunFolder) -> dict | None:
    """The config of the run's newest checkpoint whose files are all there (its params.json: no tensor, no pickle is
    read); None for a new run."""
    for path in reversed(CheckpointManager(run.checkpoints, CheckpointArgs()).complete_checkpoints()):
        try:
            return retrying_reads(lambda: verify(path), path)["config"]
        except DamagedCheckpoint:
            continue  # resume() sets it aside and tries the one before it
    return None


def resume(start: Start, checkpoints: CheckpointManager, model, optimizer, app: App, config, launch: Launch,
           average: dict | None = None) -> dict | None:
    """Loads the newest of the run's checkpoints (`checkpoints`: start.run's) that loads and returns this rank's
    train state; None for a new run. `average`: the weights' average, loaded too where the checkpoint holds one.

    Rank 0 picks the checkpoint and every rank loads that one. A checkpoint proven damaged (a missing or truncated
    file, content that does not parse) is set aside and the one before it is tried; an I/O error is no proof: the
    read is tried again (`READ_ATTEMPTS`), then the run stops in one line, every checkpoint left in place. A
    checkpoint of another app or model shape is refused in one line, before anything is loaded or written. A
    checkpoint saved by another number of processes loads too: DCP reshards the model and optimizer, and the data
    loader's unread data is re-partitioned.
    """
    failed_reads = 0
    while True:
        choice = broadcast_object(_pick_checkpoint(start.run, checkpoints, model, app, config)
                                  if launch.rank == 0 else None)
        if isinstance(choice, UserError) or choice is None:
            if choice is not None:
                raise choice
            return None
        path = Path(choice)
        states, damage, unread = None, None, None
        try:
            states = checkpoints.load(path, model, optimizer, average)
        except DamagedCheckpoint as e:
            damage = str(e)
        except OSError as e:
            unread = _unread(e)
        damage = agreed_failure(damage)  # a file that one rank alone found damaged is damaged for all of them
        if damage is not None:
            if launch.rank == 0:
                _set_aside(checkpoints, path, DamagedCheckpoint(damage))
            barrier()
            continue
        unread = agreed_failure(unread)
        if unread is not None:
            failed_reads += 1
            _wait_to_read_again(path, unread, failed_reads)
            continue
        logger.info(f"resumed from {path}")
        report_changes(Checkpoint.read(path).config, config, states[0]["step"])
        return this_ranks_state(states, app, config, launch)


def this_ranks_state(states: list[dict], app: App, config, launch: Launch, data_position: bool = True) -> dict:
    """This rank's train state from those a checkpoint's ranks saved; their data position re-partitioned when
    another number of processes saved them, or dropped (`data_position` false: the loader starts afresh)."""
    if len(states) == launch.world_size:
        return states[launch.rank] if data_position else {**states[launch.rank], "data": None}
    logger.warning(f"the checkpoint was saved by {len(states)} process(es), this run has {launch.world_size}: "
                   "the masking random state starts afresh on every rank")
    old = [s["data"] for s in states]
    data = on_every_rank(lambda: app.data.repartition(old, launch.world_size, config.data))[launch.rank] \
        if data_position else None
    return {**states[0], "data": data, "generator": None}


def continue_run(start: Start, model, optimizer, app: App, config, launch: Launch, average: dict | None = None) -> dict:
    """This rank's train state for a new run continuing from `start.continued`, its weights and optimizer state
    loaded into `model` and `optimizer` (and the weights' average into `average` when both runs keep one): step, token
    count, data position and masking generator carried over (not the parent's best record: its best.pt is the
    parent's). Another app, or a model the checkpoint cannot grow into (any architecture change but `GROWABLE`'s), is
    refused in one line before anything is read; the data position starts afresh, in one line, when the data
    settings it depends on changed."""
    parent = start.continued
    where = f"continue_from {parent.path}"
    if parent.app_name != app.name:
        raise UserError(f"{where} is a run of {parent.app_name}, not {app.name}")
    changed = [change for change in architecture_changes(parent.config, config)
               if change.split()[0].rsplit(".", 1)[-1] not in GROWABLE]
    mismatched = parent.mismatches(model)
    if changed or mismatched:
        difference = ", ".join(changed) or f"tensor {mismatched[0]}"
        raise UserError(f"{where} holds a model this one cannot grow from ({difference}): a continued run may change "
                        f"only the model's {' and '.join(GROWABLE)}")
    states, failure = [], None
    try:
        states = parent.load_training(model, optimizer, average)
    except DamagedCheckpoint as e:
        failure = f"{where} is damaged: {e}"
    except OSError as e:
        failure = f"cannot read {where}: {_unread(e)}"
    fail_together(failure)
    step = states[0]["step"]
    if step >= config.steps:
        raise UserError(f"{where} is at step {step}: this run's steps ({config.steps}) must be more")
    logger.info(f"continuing from {parent.path} at step {step} ({config.phase}); the parent run is only read")
    report_changes(parent.config, config, step, "continuing")
    moved = data_position_changes(parent.config["data"], to_dict(config.data))
    if moved:
        logger.warning(f"the data position starts afresh: {', '.join(moved)} changed")
    state = this_ranks_state(states, app, config, launch, not moved)
    counted = state.get("compute") and {"data_tokens": state["data_tokens"], **state["compute"]}  # None: saved before
    # the library counted compute in checkpoints; the parent's tokens are then counted at this run's FLOPs per token
    return {**state, "best": None, "evaluation_skipped": False, "phase_start": counted or None}


def data_setting_changes(old: dict, new: dict) -> list[str]:
    """The `data.` settings that differ between two runs' data configs, as settings, not spellings: the same folder
    however its path is written (stool makes root_dir absolute), the same tokenizer wherever its file lies (its name
    and, for a Hugging Face one, the sha256 of its files)."""
    def same(key: str) -> bool:
        a, b = old.get(key), new.get(key)
        if key == "root_dir" and a and b:
            return Path(a).resolve() == Path(b).resolve()
        if key == "tokenizer" and isinstance(a, dict) and isinstance(b, dict):
            return (a.get("name"), a.get("sha256")) == (b.get("name"), b.get("sha256"))
        return a == b

    return [f"data.{key}" for key in sorted(old.keys() | new.keys()) if not same(key)]


def data_position_changes(old: dict, new: dict) -> list[str]:
    """The data settings (`data.` keys) a saved data position depends on that differ: all but `KEEP_DATA_POSITION`'s,
    and the sources' names (their weights may change)."""
    changes = [key for key in data_setting_changes(old, new) if key.removeprefix("data.") not in KEEP_DATA_POSITION]
    renamed = sorted(old.get("sources", {})) != sorted(new.get("sources", {}))
    return changes + (["data.sources' names"] if renamed else [])


def _pick_checkpoint(run: RunFolder, checkpoints: CheckpointManager, model, app: App, config) \
        -> str | UserError | None:
    """Rank 0: the newest checkpoint whose files are all there and whose model fits, as a path; a UserError to
    raise on every rank; None for a new run."""
    for path in reversed(checkpoints.complete_checkpoints()):
        try:
            check_same_model(retrying_reads(lambda: Checkpoint.read(path), path), run, model, app, config)
            return str(path)
        except DamagedCheckpoint as e:
            _set_aside(checkpoints, path, e)
        except UserError as e:
            return e
    if checkpoints.damaged_checkpoints():
        return UserError(f"no checkpoint in {checkpoints.folder} loads (the damaged ones are kept as *.damaged): "
                         "delete them to start this run from scratch, or use another dump_dir")
    if run.finished:  # its history would be overwritten
        return UserError(f"{run.root} holds the consolidated.pt of a finished run but no checkpoint to "
                         "resume from: use another dump_dir (init_from= starts from its weights)")
    return None


def check_same_model(checkpoint: Checkpoint, run: RunFolder, model, app: App, config) -> None:
    """The checkpoint (one of `run`'s) is of this app, its tensors fit the model, and no architecture setting changed
    (some, like n_heads at a fixed dim, change the computation but not the shapes)."""
    if checkpoint.app_name != app.name:
        raise UserError(f"{run.root} holds a run of {checkpoint.app_name}, not {app.name}: use another dump_dir")
    architecture = architecture_changes(checkpoint.config, config)
    mismatched = checkpoint.mismatches(model)
    if architecture or mismatched:
        raise UserError(f"{run.root} holds a model of another shape "
                        f"({', '.join(architecture) or 'tensor ' + mismatched[0]}): resume with its config, or use "
                        "another dump_dir")


def architecture_changes(old_config: dict, config) -> list[str]:
    """'key old -> new' for each architecture field of the model (its config classes' `ARCHITECTURE`) and the
    tokenizer that differs from a saved config."""
    changes = config_changes(old_config, to_dict(config))
    architecture = {"data.tokenizer.name", "data.tokenizer.sha256", *architecture_fields(config.model, "model.")}
    return [f"{key} {old} -> {new}" for key, (old, new) in changes.items() if key in architecture]


def retrying_reads(read: Callable, path: Path):
    """`read()`, tried again after an I/O error (`READ_ATTEMPTS` in all); a UserError once it keeps failing. A
    missing file is no I/O error: DamagedCheckpoint."""
    for attempt in range(1, READ_ATTEMPTS + 1):
        try:
            return read()
        except FileNotFoundError as e:  # a checkpoint's file gone (deleted since it was listed) is damage
            raise DamagedCheckpoint(f"{Path(e.filename).name if e.filename else 'a file'} is missing") from None
        except OSError as e:
            _wait_to_read_again(path, _unread(e), attempt)


def _unread(error: OSError) -> str:
    return f"{error.strerror or error}{f': {error.filename}' if error.filename else ''}"


def _wait_to_read_again(path: Path, reason: str, failed_reads: int) -> None:
    """After the `failed_reads`-th I/O error reading checkpoint `path`: waits before the next try, or, after the
    last, stops the run (a UserError), leaving every checkpoint in place."""
    if failed_reads >= READ_ATTEMPTS:
        raise UserError(f"cannot read checkpoint {path} ({reason}; tried {READ_ATTEMPTS} times): an I/O error is no "
                        "proof of damage, so every checkpoint is left in place; start again once the disk reads")
    delay = RETRY_DELAY_S * 2 ** (failed_reads - 1)
    logger.warning(f"cannot read checkpoint {path} ({reason}): trying again in {delay:g} s")
    time.sleep(delay)


def _set_aside(checkpoints: CheckpointManager, path: Path, error: DamagedCheckpoint) -> None:
    aside = checkpoints.set_aside(path)
    logger.warning(f"checkpoint {path.name} is damaged ({error}): set aside as {aside.name}; trying the one before it")


def report_changes(old_config: dict, config, step: int, doing: str = "resuming") -> None:
    changes = config_changes(old_config, to_dict(config))
    if changes:
        listed = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in changes.items())
        logger.warning(f"{doing} with changed settings: {listed}")
    if "steps" in changes and step < config.steps:
        logger.warning(f"the learning-rate schedule is now that of a {config.steps}-step run: step {step + 1} uses lr "
                       f"{lr_at(step, config.optim, config.steps):.3g} (warm-up {config.optim.warmup} steps, "
                       f"{config.optim.decay} decay from step {config.optim.decay_window(config.steps)[0] + 1} to "
                       f"{config.optim.lr_min:g} at step {config.steps})")
