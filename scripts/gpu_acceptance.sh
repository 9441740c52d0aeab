#!/usr/bin/env bash
# The acceptance run for a GPU machine (scripts/gpu_acceptance.py has the details):
#   bash scripts/gpu_acceptance.sh OUT_DIR [--bundle FOLDER] | OUT_DIR --dry-run | --prepare FOLDER
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 scripts/gpu_acceptance.py "$@"
