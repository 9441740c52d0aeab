"""The paper's tables from a pipeline's folder (lingua/pipeline.py), the paper's numbers beside ours:

    python -m apps.tables table=3|2|4|5|6|7 dir=PIPELINE_DIR [out=TABLE.md]

It reads, for each variant V of the pipeline (DIR/pipeline.json), what its stages wrote under DIR/V/:
- pretrain/: the pre-training run (parameters from its log, training FLOPs in the paper's counting, the median
  tokens/s);
- probes/results.json: the frozen GLUE probes (apps.eval.glue);
- finetune*/: the GLUE fine-tuning sweeps, each task at the learning rate chosen on dev (apps.finetune.table);
- mteb_*_frozen/ and mteb_*_full/results.json: MTEB after contrastive training over the frozen backbone or of the
  whole model (apps.eval.mteb), a section per benchmark.

A variant's `app` names the paper's row beside it in Table 3; in the ablations its `row` labels its row and picks
the paper's. Columns are the tasks that were run; an average over fewer tasks than the paper's is marked, and the
paper's row beside it is averaged over the same tasks. Prints Markdown, and writes it to `out` if given.
"""

import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from apps import paper
from apps.eval.mteb import benchmark_of
from apps.finetune.table import choose, read_results
from lingua.args import UserError, command_line, load_config
from lingua.eval.glue import TASKS
from lingua.eval.mteb import CATEGORIES
from lingua.files import atomic_write
from lingua.metrics import read_metrics

SHORT = {"Classification": "Class.", "Clustering": "Clust.", "PairClassification": "PairClass.",
         "Reranking": "Rerank.", "Retrieval": "Retriev.", "STS": "STS", "Summarization": "Summ."}


@dataclass
class TablesArgs:
    table: str = "3"  # 3 (the main table), 2 (CrossBERT's masking ratio), 4 (predictor), 5 (CMS), 6 (BERT's
    # masking ratio) or 7 (the pooler's warm start)
    dir: str = ""  # the pipeline's folder (holding pipeline.json)
    out: str = ""  # also write the table here


# ------------------------------------------------------------------------------------------------ results


def pretraining(run: Path) -> dict | None:
    """Parameters, FLOPs and tokens/s of a pre-training run, or None before it has logged a step."""
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r] if run.is_dir() else []
    if not records:
        return None
    log = (run / "train.log").read_text(errors="replace") if (run / "train.log").exists() else ""
    found = re.search(r": ([\d,]+) parameters", log)
    return {"params": int(found.group(1).replace(",", "")) if found else None,
            "flops": records[-1]["compute_flops"],
            "tps": statistics.median(r["data_tokens_per_s"] for r in records[1:] or records)}


def probe_scores(folder: Path) -> dict[str, dict[str, float]]:
    """{probe: {task: score}} of a GLUE probe results file (the last layer)."""
    path = folder / "results.json"
    if not path.exists():
        return {}
    return {probe: {t: s for t, s in scores.items() if t != "avg"}
            for probe, scores in json.loads(path.read_text())["summary"]["last"].items()}


def finetune_scores(variant_dir: Path) -> dict[str, float]:
    """{task: score} of the variant's fine-tuning sweeps (its finetune*/ folders: e.g. MNLI first, then the tasks
    that start from it)."""
    results, _ = read_results(sorted(variant_dir.glob("finetune*")))
    chosen = choose(results)
    if len(chosen) > 1:
        raise UserError(f"{variant_dir} holds fine-tuning runs of {len(chosen)} pre-trained models: one expected")
    return {task: entry["score"] for tasks in chosen.values() for task, entry in tasks.items()}


def mteb_sections(folder: Path) -> dict[tuple[str, str], dict[str, float]]:
    """{(benchmark, protocol): {category: score, "Avg.", "Overall"}} of the variant's MTEB results."""
    sections = {}
    for path in sorted(folder.glob("mteb_*/results.json")):
        protocol = path.parent.name.rsplit("_", 1)[-1]
        if protocol not in ("frozen", "full"):
            continue
        results = json.loads(path.read_text())
        sections[(benchmark_of(results), protocol)] = results["summary"]
    return sections


@dataclass
class Variant:
    name: str
    keys: dict
    pretrain: dict | None
    probes: dict[str, dict[str, float]]
    finetune: dict[str, float]
    mteb: dict[tuple[str, str], dict[str, float]]

    @property
    def label(self) -> str:
        return str(self.keys.get("row", self.name))


def read_pipeline(folder: Path) -> list[Variant]:
    record = folder / "pipeline.json"
    if not record.exists():
        raise UserError(f"{folder} holds no pipeline (pipeline.json): python -m lingua.stool pipeline writes it")
    variants = json.loads(record.read_text())["variants"]
    return [Variant(name, keys, pretraining(folder / name / "pretrain"), probe_scores(folder / name / "probes"),
                    finetune_scores(folder / name), mteb_sections(folder / name))
            for name, keys in variants.items()]


# ------------------------------------------------------------------------------------------------ layout


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def glue_section(title: str, ours: list[tuple[str, list[str], dict[str, float]]],
                 theirs: list[tuple[str, list[str], tuple]], meta: list[str] = ()) -> list[str]:
    """A GLUE block: our rows (label, meta cells, {task: score}), then the paper's (label, meta cells, scores in
    TASKS order then the average); columns are the tasks any of ours has."""
    tasks = [t for t in TASKS if any(t in scores for _, _, scores in ours)]
    if not tasks:
        return []
    full = len(tasks) == len(TASKS)
    average = "Avg." if full else f"Avg. ({len(tasks)} of {len(TASKS)} tasks)"
    rows = []
    for label, cells, scores in ours:
        present = [scores[t] for t in tasks if t in scores]
        mean = sum(present) / len(present) if len(present) == len(tasks) else None
        rows.append([label, *cells, *(_cell(scores.get(t)) for t in tasks), _cell(mean)])
    for label, cells, published in theirs:
        values = dict(zip(TASKS, published))
        mean = published[-1] if full else sum(values[t] for t in tasks) / len(tasks)
        rows.append([f"*{label}*", *cells, *(_cell(values[t]) for t in tasks), _cell(mean)])
    return [f"**{title}**", ""] + _markdown(["Model", *meta, *(TASKS[t].title for t in tasks), average], rows) + [""]


def mteb_section(title: str, ours: list[tuple[str, list[str], dict[str, float]]],
                 theirs: list[tuple[str, list[str], tuple]], meta: list[str] = ()) -> list[str]:
    """An MTEB block: the paper's task types that any of ours has, then Avg. (the mean over those types, the
    paper's too) and Overall (the mean over tasks: the paper's only over all of its types)."""
    categories = [c for c in CATEGORIES if any(c in scores for _, _, scores in ours)]
    if not categories:
        return []
    full = len(categories) == len(CATEGORIES)
    rows = [[label, *cells, *(_cell(scores.get(c)) for c in [*categories, "Avg.", "Overall"])]
            for label, cells, scores in ours]
    for label, cells, published in theirs:
        values = dict(zip([*CATEGORIES, "Avg.", "Overall"], published))
        average = values["Avg."] if full else sum(values[c] for c in categories) / len(categories)
        rows.append([f"*{label}*", *cells, *(_cell(values[c]) for c in categories), _cell(average),
                     _cell(values["Overall"] if full else None)])
    average = "Avg." if full else f"Avg. ({len(categories)} of {len(CATEGORIES)} types)"
    header = ["Model", *meta, *(SHORT[c] for c in categories), average, "Overall"]
    return [f"**{title}**", ""] + _markdown(header, rows) + [""]


def _meta(variant: Variant) -> list[str]:
    run = variant.pretrain or {}
    params = f"{run['params'] / 1e6:.1f}M" if run.get("params") else "–"
    flops = f"{run['flops']:.1e}".replace("e+", "e") if run else "–"
    tps = f"{run['tps'] / 1e3:.1f}k" if run else "–"
    return [params, flops, tps]


def table3(variants: list[Variant]) -> list[str]:
    meta = ["Params", "FLOPs", "tps"]
    apps = [v.keys.get("app") for v in variants if v.keys.get("app") in paper.SINGLE_SCALE]

    def published(numbers: dict) -> list:
        return [(f"{app}, paper", list(paper.SINGLE_SCALE[app]), numbers[app]) for app in apps if app in numbers]

    lines = ["# Table 3", "", "Ours: this pipeline's runs; *italic*: the paper's. FLOPs in the paper's counting "
             "(eq. 6-8); tps: the median training tokens/s of the pre-training run.", ""]
    lines += glue_section("GLUE, full fine-tuning (dev; median over seeds at the learning rate chosen on dev)",
                          [(v.name, _meta(v), v.finetune) for v in variants], published(paper.GLUE_FINETUNE), meta)
    lines += glue_section("GLUE, linear probe on frozen features",
                          [(v.name, _meta(v), v.probes.get("linear", {})) for v in variants],
                          published(paper.GLUE_LINEAR), meta)
    lines += glue_section("GLUE, kNN probe on frozen features (not in the paper's table)",
                          [(v.name, _meta(v), v.probes.get("knn", {})) for v in variants], [], meta)
    sections = list(dict.fromkeys(key for v in variants for key in v.mteb))
    for benchmark, protocol in sorted(sections, key=lambda key: (key[0], key[1] != "full")):
        how = "whole model" if protocol == "full" else "over frozen features, attention pooler"
        known = (benchmark, protocol) in paper.MTEB
        theirs = published(paper.MTEB[(benchmark if known else "MTEB(eng, v1)", protocol)])
        note = "" if known else " (the paper's rows: MTEB(eng, v1), other tasks)"
        lines += mteb_section(f"{benchmark}, contrastive fine-tuning, {how}{note}",
                              [(v.name, _meta(v), v.mteb.get((benchmark, protocol), {})) for v in variants],
                              theirs, meta)
    return lines


def glue_ablation(title: str, variants: list[Variant], published: dict, row_name: str) -> list[str]:
    ours = [(f"{row_name} {v.label}", [], v.probes.get("linear", {})) for v in variants]
    theirs = [(f"{row_name} {v.label}, paper", [], published[v.label]) for v in variants if v.label in published]
    return [f"# {title}", ""] + glue_section("GLUE, linear probe on frozen features", ours, theirs)


def table2(variants: list[Variant]) -> list[str]:
    lines = ["# Table 2: CrossBERT's masking ratio at an equal data budget", "",
             "Average frozen GLUE score (linear probe) by masking ratio (%).", ""]
    averages = []
    for v in variants:
        scores = v.probes.get("linear", {})
        averages.append(_cell(sum(scores.values()) / len(scores) if scores else None))
    tasks = sorted({len(v.probes.get("linear", {})) for v in variants})
    lines += _markdown(["Masking ratio (%)", *(v.label for v in variants)],
                       [[f"CrossBERT (Avg. over {'/'.join(map(str, tasks))} tasks)", *averages],
                        ["*CrossBERT, paper (8 tasks)*",
                         *(_cell(paper.CROSSBERT_MASK_RATIO.get(v.label)) for v in variants)]])
    return lines + [""]


def table4(variants: list[Variant]) -> list[str]:
    lines = ["# Table 4: the predictor's shape and size", "",
             "The paper's text gives no numbers for this table (its prose: 8M is a bottleneck, 25M close to the "
             "42M default, 50M and 85M add little).", ""]
    return lines + glue_section("GLUE, linear probe on frozen features",
                                [(v.label, _meta(v), v.probes.get("linear", {})) for v in variants], [],
                                ["Params", "FLOPs", "tps"])


def table7(variants: list[Variant]) -> list[str]:
    lines = ["# Table 7: the pooler warm-started from CrossBERT's predictor, or cold", ""]
    for benchmark in dict.fromkeys(b for v in variants for b, protocol in v.mteb if protocol == "frozen"):
        theirs = [(f"{v.label}, paper", [], paper.WARM_START[v.label]) for v in variants
                  if v.label in paper.WARM_START and benchmark == "MTEB(eng, v2)"]
        lines += mteb_section(f"{benchmark}, contrastive fine-tuning over frozen features",
                              [(v.label, [], v.mteb.get((benchmark, "frozen"), {})) for v in variants], theirs)
    return lines


def table5(variants: list[Variant]) -> list[str]:
    return glue_ablation("Table 5: CMS, CrossBERT", variants, paper.CMS, "CMS")


def table6(variants: list[Variant]) -> list[str]:
    return glue_ablation("Table 6: BERT's masking ratio", variants, paper.BERT_MASK_RATIO, "mask %")


TABLES = {"2": table2, "3": table3, "4": table4, "5": table5, "6": table6, "7": table7}


def main(argv: list[str] | None = None) -> None:
    with command_line(__doc__):
        args = load_config(TablesArgs, sys.argv[1:] if argv is None else argv)
        if args.table not in TABLES:
            raise UserError(f"config key 'table' must be one of {', '.join(TABLES)}, got '{args.table}'")
        if not args.dir:
            raise UserError("dir= is required: the pipeline's folder")
        text = "\n".join(TABLES[args.table](read_pipeline(Path(args.dir))))
        print(text)
        if args.out:
            atomic_write(args.out, text + "\n")
            print(f"table: {args.out}")


if __name__ == "__main__":
    main()
