"""python -m lingua.checkpoint consolidate CHECKPOINT_DIR OUT.pt [app=NAME]: see lingua/export/consolidate.py."""
import sys

from lingua.export.consolidate import main

main(sys.argv[1:])
