#!/usr/bin/env bash
# Table 3 in miniature, on a CPU and offline: the debug BERT, CrossBERT and ELECTRA pre-trained on the sample corpus,
# probed, fine-tuned on GLUE and trained contrastively, scored on the offline MTEB stand-ins, and the table written to
# dump/pipelines/table3_debug/table3.md (about 30 minutes on 2 cores). Stopped or failed, the same command goes on
# from where it was (finished stages are skipped).
#   bash docs/pipelines/run_debug.sh [DATA]      DATA: the folder holding glue/ and retrieval/ (../shared/data)
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${1:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
[ -d data/sample ] || python setup/prepare_data.py sample
python -m lingua.stool pipeline pipeline=docs/pipelines/table3_debug.yaml cluster=local data="$DATA"
python -m lingua.stool status dump/pipelines/table3_debug
cat dump/pipelines/table3_debug/table3.md
