"""Frozen GLUE evaluation of a checkpoint of any app (linear and kNN probes, paper section 4.1):

    python -m tools.eval.glue ckpt=DUMP_DIR_OR_CHECKPOINT data=GLUE_DIR_OR_hf [tasks=sst2,cola] [probes=linear,knn]
        [layers=last|all|0,3] [max_train=10000] [out=RESULTS_DIR_OR_JSON] [cache_dir=DIR] [device=auto] [app=NAME]

Prints the scores (one row per task, then the paper's table layout with the average) and writes results.json,
by default to DUMP_DIR/glue_eval/<checkpoint name>/. Features are cached in DUMP_DIR/glue_eval/cache, keyed by the
checkpoint's files, so probing again (other probes, λ grid or k) skips the forward passes; another train cap or seed
re-encodes only the train split.
"""

import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lingua.app import load_model
from lingua.args import command_line, load_config
from lingua.checkpoint.store import Checkpoint
from lingua.distributed import resolve_device
from lingua.errors import UserError
from lingua.eval.features import FeatureCache
from lingua.eval.glue import GlueEvalArgs, check_args, evaluate_glue, probe_length
from lingua.eval.report import format_table
from lingua.files import untrusted
from lingua.files.safe import atomic_write
from lingua.metrics import setup_logging
from lingua.run_folder import RESULTS, RunFolder


@dataclass
class GlueCommandArgs(GlueEvalArgs):
    ckpt: str = ""  # a run's dump_dir (its newest checkpoint, else consolidated.pt), a checkpoint folder or a .pt file
    out: str = ""  # results file (.json) or folder; default DUMP_DIR/glue_eval/<checkpoint name>/results.json
    cache_dir: str = ""  # feature cache; default DUMP_DIR/glue_eval/cache
    device: str = "auto"  # auto: cuda if available, else cpu
    app: str = ""  # ckpt's app when not one of this code's (e.g. my_pkg.my_app): trusted to rebuild it


def checkpoint_identity(checkpoint: Path) -> str:
    """Path, sizes and modification times of the checkpoint's files: changes whenever the weights are rewritten."""
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else [checkpoint]
    return json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files])


def results_path(out: str, run: RunFolder, checkpoint: Path) -> Path:
    if out:
        return Path(out) if out.endswith(".json") else Path(out) / RESULTS
    return run.evaluation("glue", checkpoint) / RESULTS


def read_summary(path: Path) -> dict[str, dict[str, dict[str, float]]]:
    """{layer: {probe: {task or "avg": score}}} of a results.json of this command; a file of another shape (copied,
    edited) is one line naming it."""
    summary = untrusted.read_json(path, "GLUE results").get("summary")
    scores = summary.values() if isinstance(summary, dict) else [None]
    if not all(isinstance(probes, dict) and all(isinstance(tasks, dict) and all(
            isinstance(score, (int, float)) for score in tasks.values()) for tasks in probes.values())
            for probes in scores):
        raise UserError(f"GLUE results {path} hold no summary of scores per layer, probe and task")
    return summary


def run(args: GlueCommandArgs) -> dict:
    if not args.ckpt:
        raise UserError("ckpt= is required: a consolidated.pt, a checkpoint folder or a run's dump_dir")
    check_args(args)  # before the (slow) model loading
    opened = Checkpoint.open(args.ckpt, args.app or None)
    device = resolve_device(args.device)
    model, config, tokenizer = load_model(opened, device)
    checkpoint = opened.path
    args = replace(args, max_len=probe_length(args, config.data.seq_len, config.model.encoder.max_seqlen))
    run = RunFolder.of(checkpoint)
    path = results_path(args.out, run, checkpoint)  # a link there is refused before the probes run
    cache = FeatureCache(args.cache_dir or run.feature_cache, checkpoint_identity(checkpoint))
    results = {"checkpoint": str(checkpoint), "args": asdict(args),
               **evaluate_glue(model, tokenizer, args, device, cache)}
    if not results["tasks"]:
        raise UserError("no GLUE task could be evaluated: " + "; ".join(
            f"{name}: {why}" for name, why in results["skipped"].items()))
    try:
        atomic_write(path, json.dumps(results, indent=1))
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    print(format_table(results))
    print(f"results: {path}")
    return results


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(GlueCommandArgs, sys.argv[1:] if argv is None else argv)
        setup_logging()
        run(args)


if __name__ == "__main__":
    main()
