"""python -m lingua.export ckpt=DUMP_DIR_OR_CHECKPOINT out=FOLDER ...: see lingua/export/hf_folder.py."""
from lingua.export.hf_folder import main

main()
