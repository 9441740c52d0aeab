#!/usr/bin/env bash
# GLUE fine-tuning of the three debug models on the five tasks available offline (RTE, SST-2, MRPC, CoLA, STS-B),
# on a CPU: pre-trains each debug model (skipped when done), fine-tunes it on each task for one epoch at lr 1e-4
# (one seed; the paper-scale grid: docs/finetuning.md), then prints the Table 3 layout. About an hour on 2 cores.
#   bash docs/finetune/run_debug.sh [GLUE_DIR]     # default ../shared/data/glue
set -euo pipefail
cd "$(dirname "$0")/../.."
GLUE=${1:-../shared/data/glue}
for app in bert crossbert electra; do
  python -m apps.$app.train config=apps/$app/configs/debug.yaml
  python -m tools.finetune.sweep init_from=dump/${app}_debug dump_dir=dump/finetune_debug/$app data="$GLUE" \
    tasks=rte,sst2,mrpc,cola,stsb lrs=1e-4 seeds=0 epochs=1 run_config=apps/finetune/configs/debug.yaml cluster=local
done
python -m tools.finetune.table dump/finetune_debug
