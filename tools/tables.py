"""The paper's tables from a pipeline's folder (lingua/jobs/pipeline.py), the paper's numbers beside ours:

    python -m tools.tables table=3|1|2|4|5|6|7|9 dir=PIPELINE_DIR [out=TABLE.md]

It reads, for each variant V of the pipeline (DIR/pipeline.json), what its stages wrote under DIR/V/:
- pretrain/: the pre-training run (parameters and processes from its log, training FLOPs in the paper's counting,
  the median token-views/s per GPU: the paper's tps, CrossBERT with CMS counting each sequence's 2 views);
- probes/results.json: the frozen GLUE probes (tools.eval.glue);
- probes_layers/results.json: the frozen GLUE probes of every layer (tools.eval.glue layers=all), Table 1's rows;
- finetune*/: the GLUE fine-tuning sweeps, each task at the learning rate chosen on dev (tools.finetune.table);
- mteb_*_frozen/ and mteb_*_full/results.json: MTEB after contrastive training over the frozen backbone or of the
  whole model (tools.eval.mteb), a section per benchmark.

A variant's `app` names the paper's row beside it in Table 3; in the ablations its `row` picks the paper's. Rows
and columns are labelled and ordered as the paper's (Table 6's tasks alphabetically, Tables 5 and 7's ✗/✓), columns
limited to the tasks that were run; each table names its metrics. GLUE: an average over fewer tasks than the paper's
is marked, and the paper's row beside it is averaged over the same tasks (from its per-task numbers). MTEB: the
paper's rows appear only beside a run of the whole benchmark (the paper gives no per-task numbers), a subset is shown
alone with its number of tasks. Table 3 ends with the literature the paper prints (ModernBERT, NeoBERT, OptiBERT,
DeBERTaV3), in a section of its own; under a paper's row that contradicts another of its tables or its own cells, a
note says how (tools/paper.yaml, notes). Prints Markdown, and writes it to `out` if given.
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from lingua.args import command_line, load_config
from lingua.errors import UserError
from lingua.eval.glue_data import TASKS
from lingua.eval.mteb import CATEGORIES
from lingua.files.safe import atomic_write
from tools import paper
from tools.finetune.table import metric_names
from tools.pipeline_results import Variant, read_pipeline

SHORT = {"Classification": "Class.", "Clustering": "Clust.", "PairClassification": "PairClass.",
         "Reranking": "Rerank.", "Retrieval": "Retriev.", "STS": "STS", "Summarization": "Summ."}


@dataclass
class TablesArgs:
    table: str = "3"  # 3 (the main table), 1 (the probes layer by layer), 2 (CrossBERT's masking ratio), 4
    # (predictor), 5 (CMS), 6 (BERT's masking ratio), 7 (the pooler's warm start) or 9 (the 1B models at 1e21 FLOPs)
    dir: str = ""  # the pipeline's folder (holding pipeline.json)
    out: str = ""  # also write the table here


def whole_benchmark(benchmark: str) -> bool:
    """Whether results named so (`benchmark_of`) are a whole benchmark of the paper's, beside which its rows belong."""
    return any(benchmark == published for published, _ in paper.MTEB)


# ------------------------------------------------------------------------------------------------ layout


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def footnotes(metrics: str, notes: list[str]) -> list[str]:
    """The lines under a table: its metrics, then each note on the paper's numbers, a paragraph each."""
    return ["", metrics] + [line for note in notes for line in ("", note)] + [""]


def glue_section(title: str, ours: list[tuple[str, list[str], dict[str, float]]],
                 theirs: list[tuple[str, list[str], tuple]], meta: list[str] = (),
                 order: tuple[str, ...] = tuple(TASKS), corner: str = "Model", notes: list[str] = ()) -> list[str]:
    """A GLUE block: our rows (label, meta cells, {task: score}), then the paper's (label, meta cells, scores in
    TASKS order then the average), then its metrics and the notes; columns are the tasks any of ours has, in `order`
    (the paper's table's), and on fewer tasks than the paper's the paper's rows are averaged over the same tasks, as
    the caption says. `corner` heads the labels' column."""
    tasks = [t for t in order if any(t in scores for _, _, scores in ours)]
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
    metrics = [metric_names(tasks)]
    if theirs and not full:
        metrics.append(f"The paper's rows: its numbers on these {len(tasks)} tasks, averaged here as ours (its own "
                       f"average is over all {len(TASKS)}).")
    header = [corner, *meta, *(TASKS[t].title for t in tasks), average]
    return [f"**{title}**", ""] + markdown_table(header, rows) + footnotes(" ".join(metrics), notes)


def mteb_metrics(runs: list[dict]) -> str:
    """The main score of each task type in these results.json (mteb's, per task), e.g. "STS cosine_spearman"."""
    by_type: dict[str, set] = {}
    for results in runs:
        for task in results.get("tasks", {}).values():
            by_type.setdefault(task["type"], set()).add(task["metric"])
    named = "; ".join(f"{SHORT.get(t, t)} {', '.join(sorted(by_type[t]))}"
                      for t in [*CATEGORIES, *sorted(set(by_type) - set(CATEGORIES))] if t in by_type)
    return ("Metrics (in %): each task's main score in mteb" + (f" ({named})" if named else "")
            + ", averaged per task type; Avg.: the mean over the types, Overall: over the tasks.")


def mteb_section(title: str, ours: list[tuple[str, list[str], dict]], theirs: list[tuple[str, list[str], tuple]],
                 meta: list[str] = (), whole: bool = True, notes: list[str] = ()) -> list[str]:
    """An MTEB block: our rows (label, meta cells, results.json), the paper's (label, meta cells, its numbers: only
    beside a whole benchmark of its), then the metrics and the notes on the paper's rows. Columns: the task types any
    of ours has, Avg. (the mean over those types) and Overall (the mean over tasks). A subset of a benchmark (`whole`
    false) is shown alone, with its number of tasks, since the paper gives no per-task numbers to average alike."""
    present = [c for c in CATEGORIES if any(c in results["summary"] for _, _, results in ours if results)]
    if not present:
        return []
    categories = CATEGORIES if whole else present
    if not whole:
        counts = sorted({len(results.get("tasks", {})) for _, _, results in ours if results})
        title += f" ({'/'.join(map(str, counts))} tasks: the paper's rows, over its whole benchmark, do not compare)"
        theirs, notes = [], []
    rows = [[label, *cells, *(_cell(results.get("summary", {}).get(c)) for c in [*categories, "Avg.", "Overall"])]
            for label, cells, results in ours]
    for label, cells, published in theirs:
        values = dict(zip([*CATEGORIES, "Avg.", "Overall"], published))
        rows.append([f"*{label}*", *cells, *(_cell(values[c]) for c in [*categories, "Avg.", "Overall"])])
    average = "Avg." if whole else f"Avg. ({len(categories)} types)"
    header = ["Model", *meta, *(SHORT[c] for c in categories), average, "Overall"]
    metrics = mteb_metrics([results for _, _, results in ours if results])
    return [f"**{title}**", ""] + markdown_table(header, rows) + footnotes(metrics, notes)


def number(value: float | None, spec: str = ".1e") -> str:
    """A table's number, "–" when there is none; exponents short (6.6e19, 1e5)."""
    return "–" if value is None else re.sub(r"e\+0?", "e", format(value, spec))


def _meta(variant: Variant) -> list[str]:
    run = variant.pretrain or {}
    params = f"{run['params'] / 1e6:.1f}M" if run.get("params") else "–"
    tps = f"{run['tps'] / 1e3:.1f}k" if run.get("tps") else "–"
    return [params, number(run.get("flops")), number(run.get("flops_with_heads")), tps]


def table1(variants: list[Variant]) -> list[str]:
    """A row per layer (0: the first block's output) per probe; the paper's numbers are not in tools/paper.yaml, so
    ours stand alone."""
    lines = ["# Table 1: GLUE probes on each layer's frozen features", "",
             "A row per layer (0: the first block's output, the last: the encoder's output); ours alone.", ""]
    for v in variants:
        for probe in dict.fromkeys(p for scores in v.layers.values() for p in scores):
            lines += glue_section(f"{v.model}, {probe} probe",
                                  [(f"Layer {layer}", [], scores.get(probe, {})) for layer, scores in v.layers.items()],
                                  [])
    if len(lines) == 4:
        raise UserError("no layer-wise probe results (VARIANT/probes_layers/results.json: tools.eval.glue layers=all)")
    return lines


META = ["Params", "FLOPs eq. 7-8", "FLOPs, all heads", "tps"]
FLOPS_COLUMNS = ("eq_7_8", "all_heads")  # tools/paper.yaml's names of the two FLOPs columns, in META's order
LITERATURE_META = ["Params", "FLOPs", "tps"]  # as the paper prints other models' sizes, their counting unknown


def paper_meta(app: str) -> list[str]:
    """The paper's Params, FLOPs and tps of an app's model in Table 3's columns: its FLOPs in the column of the
    convention they match (tools/paper.yaml, single_scale_flops), the other one empty."""
    params, flops, tps = paper.SINGLE_SCALE[app]
    return [params, *(flops if column == paper.SINGLE_SCALE_FLOPS[app] else "–" for column in FLOPS_COLUMNS), tps]


def table3(variants: list[Variant]) -> list[str]:
    apps = [v.keys.get("app") for v in variants if v.keys.get("app") in paper.SINGLE_SCALE]

    def published(numbers: dict) -> list:
        return [(f"{paper.NAMES[app]}, paper", paper_meta(app), numbers[app]) for app in apps if app in numbers]

    lines = ["# Table 3", "", "Ours: this pipeline's runs; *italic*: the paper's. FLOPs (eq. 6): eq. 7-8 as the paper "
             "defines them, every app's output heads left out (the logs' `compute_flops`), and with every head (BERT's "
             "and CrossBERT's tied head on the tokens they predict, ELECTRA's generator head and RTD head: "
             "`compute_flops_with_head`); the paper's number stands in the column it matches (notes below the "
             "table). tps, as the paper's: training token-views per second per GPU (the median over the "
             "pre-training run's log lines, divided by its processes; CrossBERT with CMS sees each sequence twice).",
             ""] + speedup(variants)
    lines += glue_section("GLUE, full fine-tuning (dev; median over seeds at the learning rate chosen on dev)",
                          [(v.model, _meta(v), v.finetune) for v in variants], published(paper.GLUE_FINETUNE), META)
    lines += glue_section("GLUE, linear probe on frozen features",
                          [(v.model, _meta(v), v.probes.get("linear", {})) for v in variants],
                          published(paper.GLUE_LINEAR), META)
    lines += glue_section("GLUE, kNN probe on frozen features (not in the paper's table)",
                          [(v.model, _meta(v), v.probes.get("knn", {})) for v in variants], [], META)
    sections = list(dict.fromkeys(key for v in variants for key in v.mteb_runs))
    for benchmark, protocol in sorted(sections, key=lambda key: (key[0], key[1] != "full")):
        how = "whole model" if protocol == "full" else "over frozen features, attention pooler"
        numbers = paper.MTEB.get((benchmark, protocol), {})
        notes = paper.NOTES.get(f"{benchmark} {protocol}", {})
        lines += mteb_section(f"{benchmark}, contrastive fine-tuning, {how}",
                              [(v.model, _meta(v), v.mteb_runs.get((benchmark, protocol), {})) for v in variants],
                              published(numbers), META, whole_benchmark(benchmark),
                              [notes[app] for app in apps if app in numbers and app in notes])
    counted = [paper.NOTES["single_scale"][app] for app in dict.fromkeys(apps)]
    return lines + (["**The paper's FLOPs and parameters, recounted**"] + footnotes(
        "Recounted from the paper's shapes and 50B tokens with this code's counts (Params with RoBERTa's "
        "vocabulary of 50,265).", counted) if counted else []) + literature()


def speedup(variants: list[Variant]) -> list[str]:
    """Section 5.2's throughput claim, ours beside it where the pipeline measured a CrossBERT's and a BERT's tps."""
    tps = {v.keys.get("app"): (v.pretrain or {}).get("tps") for v in variants}
    if not (tps.get("crossbert") and tps.get("bert")):
        return []
    published = paper.PROSE["speedup"]
    return [f"CrossBERT's tps over BERT's: ours {tps['crossbert'] / tps['bert']:.2f}x ({tps['crossbert'] / 1e3:.1f}k "
            f"vs {tps['bert'] / 1e3:.1f}k); the paper (section 5.2) {published['ratio']}x ({published['crossbert']} "
            f"vs {published['bert']} tokens/s on H100s).", ""]


def literature() -> list[str]:
    """The other models of the paper's Table 3 (published results), in its blocks and as it prints them: every
    task, its own averages, in a section of their own."""
    shape, marks = paper.LITERATURE["shape"], paper.LITERATURE["mteb_v1_full_marks"]
    lines = ["## The literature in the paper's Table 3", "",
             "Published results of other models, which the paper prints below its own three runs for context: neither "
             "this pipeline's runs nor the paper's. As the paper prints them: every task, its averages; no tps.", ""]
    for title, block in (("GLUE, full fine-tuning (dev)", "glue_finetune"),
                         ("GLUE, linear probe on frozen features", "glue_linear")):
        rows = [[name, *shape[name], "–", *map(_cell, scores)] for name, scores in paper.LITERATURE[block].items()]
        lines += [f"**{title}**", ""] + markdown_table(["Model", *LITERATURE_META, *(t.title for t in TASKS.values()),
                                                   "Avg."], rows)
        lines.append("")
    rows = [[name + marks[name], *shape[name], "–", *map(_cell, scores)]
            for name, scores in paper.LITERATURE["mteb_v1_full"].items()]
    header = ["Model", *LITERATURE_META, *(SHORT[c] for c in CATEGORIES), "Avg.", "Overall"]
    marked = " ".join(f"{mark}: {text}" for mark, text in paper.LITERATURE["mteb_v1_full_footnotes"].items())
    return lines + ["**MTEB(eng, v1), contrastive fine-tuning, whole model**", ""] + markdown_table(header, rows) + [
        "", f"The paper's marks: {marked}", "", paper.NOTES["literature"]["mteb_v1_full"], ""]


def glue_ablation(title: str, ours: list[tuple[str, list[str], dict]], theirs: list[tuple[str, list[str], list]],
                  **layout) -> list[str]:
    return [f"# {title}", ""] + glue_section("GLUE, linear probe on frozen features", ours, theirs, **layout)


def table2(variants: list[Variant]) -> list[str]:
    """The paper gives only its 8-task averages: one stands beside ours only where ours is over the same 8 tasks."""
    lines = ["# Table 2: CrossBERT's masking ratio at an equal data budget", "",
             "Average frozen GLUE score (linear probe) by masking ratio (%).", ""]
    averages, theirs = [], []
    for v in variants:
        scores = v.probes.get("linear", {})
        averages.append(_cell(sum(scores.values()) / len(scores) if scores else None))
        theirs.append(_cell(paper.CROSSBERT_MASK_RATIO.get(v.label) if len(scores) == len(TASKS) else None))
    tasks = sorted({len(v.probes.get("linear", {})) for v in variants})
    lines += markdown_table(["Masking ratio (%)", *(v.label for v in variants)],
                       [[f"CrossBERT (Avg. over {'/'.join(map(str, tasks))} tasks)", *averages],
                        [f"*CrossBERT, paper ({len(TASKS)} tasks)*", *theirs]])
    lines += ["", metric_names([t for t in TASKS if any(t in v.probes.get("linear", {}) for v in variants)])]
    if tasks != [len(TASKS)]:
        lines.append(f"The paper publishes only its {len(TASKS)}-task averages: none beside an average over fewer "
                     "tasks (–).")
    return lines + [""]


def table4(variants: list[Variant]) -> list[str]:
    lines = ["# Table 4: the predictor's shape and size", "",
             "The paper's text gives no numbers for this table (its table is empty there; its prose: 8M is a "
             "bottleneck, 25M close to the 42M default, 50M and 85M add little).", ""]
    return lines + glue_section("GLUE, linear probe on frozen features",
                                [(v.label, _meta(v), v.probes.get("linear", {})) for v in variants], [], META)


CHECK = {"off": "✗", "on": "✓", "cold": "✗", "warm": "✓"}  # Tables 5 and 7: the paper's CMS and Warm-start cells
PAPER_CROSSBERT = f"{paper.NAMES['crossbert']} {paper.SINGLE_SCALE['crossbert'][0]}"  # "CrossBERT 279M"


def sized(variant: Variant, name: str) -> str:
    """The paper's row label in Tables 5 and 7 (a model and its size), with our run's size when it is known."""
    params = _meta(variant)[0]
    return name if params == "–" else f"{name} {params}"


def table5(variants: list[Variant]) -> list[str]:
    shown = [v.label for v in variants if v.label in paper.CMS]
    return glue_ablation(
        "Table 5: CMS, CrossBERT",
        [(sized(v, "CrossBERT"), [CHECK.get(v.label, v.label)], v.probes.get("linear", {})) for v in variants],
        [(f"{PAPER_CROSSBERT}, paper", [CHECK[row]], paper.CMS[row]) for row in shown],
        meta=["CMS"], notes=[paper.NOTES["cms"][row] for row in shown if row in paper.NOTES["cms"]])


TABLE6_ORDER = ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb")  # the paper's Table 6 columns


def table6(variants: list[Variant]) -> list[str]:
    return glue_ablation(
        "Table 6: BERT's masking ratio",
        [(f"{v.label}%", [], v.probes.get("linear", {})) for v in variants],
        [(f"{v.label}%, paper", [], paper.BERT_MASK_RATIO[v.label]) for v in variants
         if v.label in paper.BERT_MASK_RATIO], order=TABLE6_ORDER, corner="BERT mask")


def table7(variants: list[Variant]) -> list[str]:
    lines = ["# Table 7: the pooler warm-started from CrossBERT's predictor, or cold", ""]
    for benchmark in dict.fromkeys(b for v in variants for b, protocol in v.mteb_runs if protocol == "frozen"):
        shown = [v.label for v in variants if v.label in paper.WARM_START and benchmark == "MTEB(eng, v2)"]
        lines += mteb_section(
            f"{benchmark}, contrastive fine-tuning over frozen features",
            [(sized(v, "CrossBERT"), [CHECK.get(v.label, v.label)], v.mteb_runs.get((benchmark, "frozen"), {}))
             for v in variants],
            [(f"{PAPER_CROSSBERT}, paper", [CHECK[row]], paper.WARM_START[row]) for row in shown], ["Warm-start"],
            whole_benchmark(benchmark), [paper.NOTES["warm_start"][row] for row in shown
                                         if row in paper.NOTES["warm_start"]])
        lines += warm_start_gain(variants, benchmark)
    return lines


def warm_start_gain(variants: list[Variant], benchmark: str) -> list[str]:
    """Appendix D's claim (warm-starting the pooler "improves MTEB scores by about 2 %"), ours beside it: the warm
    row's Avg. and Overall minus the cold row's, where the pipeline has both."""
    summaries = {v.label: v.mteb_runs.get((benchmark, "frozen"), {}).get("summary") for v in variants}
    if not (summaries.get("cold") and summaries.get("warm")):
        return []
    gains = {key: summaries["warm"][key] - summaries["cold"][key] for key in ("Avg.", "Overall")
             if key in summaries["warm"] and key in summaries["cold"]}
    cold, warm = paper.WARM_START["cold"], paper.WARM_START["warm"]
    return [f"Warm start minus cold: ours {', '.join(f'{key} {gain:+.1f}' for key, gain in gains.items())}; the "
            f"paper's text (section 4.2, Appendix D) about {paper.PROSE['warm_start_gain']} % (its Table 7: Avg. "
            f"{warm[-2] - cold[-2]:+.1f}, Overall {warm[-1] - cold[-1]:+.1f}).", ""]


def table9(variants: list[Variant]) -> list[str]:
    """Appendix I's zoom on the 1B models at 1e21 FLOPs; the paper's text has no numbers for it: ours alone, each
    row with the init std its pipeline variant gave (`init_std`), labelled by its `row` where it has one (Appendix
    I's variations: docs/pipelines/appendix_i.yaml)."""
    lines = ["# Table 9: the 1B models at 1e21 FLOPs (Appendix I)", "",
             "The paper's text gives no numbers for this table (its table is empty there; its prose: BERT and Electra "
             "collapse at 1B, CrossBERT 1B significantly outperforms Electra 1B): ours alone.", ""]
    return lines + glue_section(
        "GLUE, linear probe on frozen features",
        [(str(v.keys.get("row", v.model)), [*_meta(v), str(v.keys.get("init_std", "–"))], v.probes.get("linear", {}))
         for v in variants], [],
        [*META, "Init std"])


TABLES = {"1": table1, "2": table2, "3": table3, "4": table4, "5": table5, "6": table6, "7": table7,
          "9": table9}


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
