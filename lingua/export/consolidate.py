"""A checkpoint's weights in one file, with the app and config that rebuild the model:

    python -m lingua.checkpoint consolidate CHECKPOINT_DIR OUT.pt [app=NAME] [weights=raw|ema]
"""
import sys

from lingua.app import load_model
from lingua.checkpoint.store import Checkpoint, save_consolidated
from lingua.errors import UserError

USAGE = """usage: python -m lingua.checkpoint consolidate CHECKPOINT_DIR OUT.pt [app=NAME] [weights=raw|ema]
  app=NAME     rebuild with this app (e.g. my_pkg.my_app) a checkpoint saved by it: only this code's apps are trusted
               otherwise
  weights=ema  the weights' average that a run with ema.decay keeps in its checkpoints, in place of the raw weights"""
OPTIONS = ("app", "weights")


def main(argv: list[str]) -> None:
    options = dict(a.split("=", 1) for a in argv[3:] if "=" in a and a.split("=", 1)[0] in OPTIONS)
    if len(argv) - len(options) != 3 or argv[0] != "consolidate" or options.get("weights", "raw") not in ("raw", "ema"):
        sys.exit(USAGE)
    try:
        path = Checkpoint.resolve(argv[1])
        if not path.is_dir():
            raise UserError(f"{path} is a file; consolidate takes a checkpoint folder or a run's dump_dir")
        checkpoint = Checkpoint.open(path, options.get("app"))
        model, _, _ = load_model(checkpoint)
        if options.get("weights") == "ema":
            checkpoint.load_average_into(model)
        print(f"wrote {save_consolidated(model, checkpoint.params, argv[2])}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
