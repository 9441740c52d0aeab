"""Offline embedding evaluation of any checkpoint, through `lingua.export.embedder.load_embedder`:

    python -m tools.eval.embeddings ckpt=DUMP_DIR_OR_CHECKPOINT [retrieval=BEIR_FOLDER] [sts=FOLDER]
        [sts_sets=STSBenchmark/test,SICK/test] [pooling=auto|mean] [max_len=0] [batch_size=32] [out=RESULTS.json]
        [app=NAME]

Retrieval: a BEIR-format folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv), dense search by cosine similarity,
nDCG@10, recall@100 and MRR@10 on its `split`. STS: every scored-pair set found under `sts` (SemEval STS 2012-2016,
STS Benchmark, SICK, or JSONL of sentence1/sentence2/score; see lingua/eval/sts.py), or those named in sts_sets,
Spearman of cosine similarity against the gold scores. Prints one table and writes results.json, by default to
DUMP_DIR/embedding_eval/<checkpoint name>/.
"""

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lingua.args import command_line, load_config
from lingua.checkpoint.store import Checkpoint
from lingua.errors import UserError
from lingua.eval.retrieval import evaluate_retrieval
from lingua.eval.sts import evaluate_sts, find_sts_sets
from lingua.export.embedder import POOLINGS, load_embedder
from lingua.files.safe import atomic_write
from lingua.metrics import setup_logging
from lingua.run_folder import RESULTS, RunFolder


@dataclass
class EmbeddingEvalArgs:
    ckpt: str = ""  # consolidated.pt, a checkpoint folder, or a run's dump_dir (its newest checkpoint)
    retrieval: str = ""  # a BEIR-format folder (e.g. SciFact); empty: no retrieval
    split: str = "test"  # the retrieval qrels split
    sts: str = ""  # a folder searched for STS sets; empty: no STS
    sts_sets: list[str] = field(default_factory=list)  # the STS sets to score (names as listed); empty: all found
    pooling: str = "auto"  # auto: the checkpoint's trained pooler if it has one, else mean | mean
    max_len: int = 0  # tokens per text; 0: the run's training length
    batch_size: int = 32  # texts per forward pass
    device: str = "auto"  # auto: cuda if available, else cpu
    out: str = ""  # results file (.json) or folder; default DUMP_DIR/embedding_eval/<checkpoint name>/results.json
    app: str = ""  # ckpt's app when not one of this code's (e.g. my_pkg.my_app): trusted to rebuild it


def run(args: EmbeddingEvalArgs) -> dict:
    if not args.ckpt:
        raise UserError("ckpt= is required: a consolidated.pt, a checkpoint folder or a run's dump_dir")
    if not args.retrieval and not args.sts:
        raise UserError("nothing to evaluate: give retrieval=BEIR_FOLDER and/or sts=FOLDER")
    if args.pooling not in POOLINGS:
        raise UserError(f"pooling must be one of {', '.join(POOLINGS)}, got '{args.pooling}'")
    sts_sets = select_sts_sets(args) if args.sts else {}  # reading the files first: bad input fails before the model
    path = output_path(args.out, Checkpoint.open(args.ckpt).path)  # a link there is refused before the evaluation
    embedder = load_embedder(args.ckpt, args.device, args.pooling, args.max_len, args.app or None)
    results: dict = {"checkpoint": args.ckpt, "args": asdict(args)}
    if args.retrieval:
        results["retrieval"] = {Path(args.retrieval).name: evaluate_retrieval(embedder, args.retrieval, args.split,
                                                                               args.batch_size)}
    if sts_sets:
        results["sts"] = {name: evaluate_sts(embedder, pairs, args.batch_size) for name, pairs in sts_sets.items()}
    try:
        atomic_write(path, json.dumps(results, indent=1))
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    print(format_results(embedder.name, results))
    print(f"results: {path}")
    return results


def select_sts_sets(args: EmbeddingEvalArgs) -> dict:
    found = find_sts_sets(args.sts)
    if not found:
        raise UserError(f"no STS set found under {args.sts}")
    unknown = [name for name in args.sts_sets if name not in found]
    if unknown:
        raise UserError(f"no STS set '{unknown[0]}' under {args.sts} (found: {', '.join(found)})")
    return {name: found[name] for name in args.sts_sets} if args.sts_sets else found


def output_path(out: str, checkpoint: Path) -> Path:
    if out:
        return Path(out) if out.endswith(".json") else Path(out) / RESULTS
    return RunFolder.of(checkpoint).evaluation("embedding", checkpoint) / RESULTS


def format_results(model: str, results: dict) -> str:
    lines = [f"{model}: embedding evaluation (scores in %)"]
    for name, r in results.get("retrieval", {}).items():
        lines.append(f"  retrieval {name:<20} nDCG@10 {r['ndcg@10']:5.1f}  recall@100 {r['recall@100']:5.1f}  "
                     f"MRR@10 {r['mrr@10']:5.1f}  ({r['n_queries']} queries, {r['n_docs']} documents)")
    for name, r in results.get("sts", {}).items():
        lines.append(f"  STS {name:<26} Spearman {r['spearman']:5.1f}  Pearson {r['pearson']:5.1f}  "
                     f"({r['n_pairs']} pairs)")
    if len(results.get("sts", {})) > 1:
        mean = sum(r["spearman"] for r in results["sts"].values()) / len(results["sts"])
        lines.append(f"  STS average Spearman {mean:.1f} over {len(results['sts'])} sets")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(EmbeddingEvalArgs, sys.argv[1:] if argv is None else argv)
        setup_logging()
        run(args)


if __name__ == "__main__":
    main()
