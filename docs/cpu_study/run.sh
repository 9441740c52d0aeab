#!/usr/bin/env bash
# The CPU study of docs/cpu_study/README.md, from the repository root: data, the sweep, the frozen probes, the plots.
# GLUE=folder of the GLUE TSV files (default: ../shared/data/glue; data=hf works where the hub is reachable).
set -euo pipefail
cd "$(dirname "$0")/../.."
GLUE=${GLUE:-../shared/data/glue}
[ -d data/enwiki ] || python setup/prepare_data.py local --source enwiki "${WIKI:-../shared/data/pretrain/enwiki_2015}"
python -m lingua.stool sweep sweep=docs/cpu_study/sweep.yaml
python -m lingua.stool status dump/cpu_study
for metrics in dump/cpu_study/*/metrics.jsonl; do  # every run's dump_dir (not submitit's folder)
  python -m tools.eval.glue ckpt="$(dirname "$metrics")" data="$GLUE" tasks=sst2,mrpc,cola,stsb,rte max_train=1000
done
for kind in curves loss probes; do
  python -m tools.scaling plot kind=$kind runs=dump/cpu_study out=docs/cpu_study/$kind.png
done
python -m tools.scaling plot kind=probes probe=knn runs=dump/cpu_study out=docs/cpu_study/probes_knn.png
for probe in linear knn; do
  python -m tools.scaling table runs=dump/cpu_study probe=$probe | tee docs/cpu_study/glue_$probe.md
done
