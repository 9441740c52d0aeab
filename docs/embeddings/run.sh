#!/usr/bin/env bash
# The embedding protocol on the debug models, as in the README's "Sentence embeddings" table (about 30 minutes on
# 2 CPU cores): pre-train the three debug models (skipped when dump/<app>_debug exists), build SciFact training
# triplets with BM25 negatives, train each backbone's pooler contrastively (frozen backbone; CrossBERT's pooler
# warm-started from its predictor) and, separately, the whole model (full fine-tuning), then score mean pooling and
# the trained models on SciFact test retrieval and on STS.
#   bash docs/embeddings/run.sh [DATA]      DATA: the folder holding retrieval/scifact, retrieval/sts, retrieval/sick
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${1:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# BERT and CrossBERT at lr 3e-3, the debug configs' learning rate when the README's table was made (now 1e-3)
for app in bert crossbert electra; do
  lr=$([ $app = electra ] || echo optim.lr=3e-3)
  [ -d "dump/${app}_debug/checkpoints" ] || python -m apps.$app.train config=apps/$app/configs/debug.yaml $lr
done
python -m lingua.eval.triplets beir="$DATA/retrieval/scifact" out=data/triplets/scifact_train.jsonl n_negatives=3
evaluate() {
  python -m tools.eval.embeddings ckpt="$1" retrieval="$DATA/retrieval/scifact" sts="$DATA/retrieval" \
    sts_sets=STSBenchmark/test,SICK/test out="dump/embedding_study/$2.json"
}
for app in bert crossbert electra; do
  evaluate "dump/${app}_debug" "${app}_mean"
  python -m apps.contrastive.train config=apps/contrastive/configs/debug.yaml init_from="dump/${app}_debug" \
    dump_dir="dump/contrastive_${app}" name="contrastive_${app}"
  evaluate "dump/contrastive_${app}" "${app}_pooler"
done
# full contrastive fine-tuning (the paper's other protocol): the backbone trains too, its pooler as above
for app in bert crossbert electra; do
  python -m apps.contrastive.train config=apps/contrastive/configs/debug.yaml init_from="dump/${app}_debug" \
    dump_dir="dump/contrastive_full_${app}" name="contrastive_full_${app}" model.frozen=false
  evaluate "dump/contrastive_full_${app}" "${app}_full"
done
# Appendix D's ablation: CrossBERT's pooler trained from scratch instead of warm-started from its predictor
python -m apps.contrastive.train config=apps/contrastive/configs/debug.yaml init_from=dump/crossbert_debug \
  dump_dir=dump/contrastive_crossbert_cold name=contrastive_crossbert_cold model.pooler.warm_start=false
evaluate dump/contrastive_crossbert_cold crossbert_pooler_cold
