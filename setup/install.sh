#!/usr/bin/env bash
# Sets up a fresh machine: Python packages, the GPT-2 (r50k_base) tokenizer file, the offline sample corpus.
# Idempotent: a step whose result is already there is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements.txt
python setup/fetch_tokenizer.py
if [ ! -d data/sample ]; then
  python setup/prepare_data.py sample
fi
