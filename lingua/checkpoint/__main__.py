"""python -m lingua.checkpoint consolidate CHECKPOINT_DIR OUT.pt [app=NAME]: see lingua/checkpoint/consolidate.py."""
import sys

from lingua.checkpoint.consolidate import main

main(sys.argv[1:])
