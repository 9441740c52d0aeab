"""A checkpoint's weights in one file, with the app and config that rebuild the model:

    python -m lingua.checkpoint consolidate CHECKPOINT_DIR OUT.pt [app=NAME]
"""
import sys

from lingua.app import load_model
from lingua.checkpoint.store import Checkpoint, save_consolidated
from lingua.errors import UserError

USAGE = """usage: python -m lingua.checkpoint consolidate CHECKPOINT_DIR OUT.pt [app=NAME]
  app=NAME  rebuild with this app (e.g. my_pkg.my_app) a checkpoint saved by it: only this code's apps are trusted
            otherwise"""


def main(argv: list[str]) -> None:
    named = [a.removeprefix("app=") for a in argv[3:] if a.startswith("app=")]
    if len(argv) - len(named) != 3 or argv[0] != "consolidate" or len(named) > 1:
        sys.exit(USAGE)
    try:
        path = Checkpoint.resolve(argv[1])
        if not path.is_dir():
            raise UserError(f"{path} is a file; consolidate takes a checkpoint folder or a run's dump_dir")
        checkpoint = Checkpoint.open(path, *named)
        model, _, _ = load_model(checkpoint)
        print(f"wrote {save_consolidated(model, checkpoint.params, argv[2])}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

