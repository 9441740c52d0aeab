"""A pipeline's results as the paper's tables read them (tools.tables): for each variant of DIR/pipeline.json, its
pre-training run's parameters, FLOPs and tps, its frozen GLUE probes (last layer and every layer), its fine-tuning
sweeps' chosen scores and its MTEB results, gathered into a Variant.
"""

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from lingua.errors import UserError
from lingua.files import untrusted
from lingua.metrics import read_metrics
from lingua.run_folder import PIPELINE_RECORD, RESULTS, RunFolder
from tools import paper
from tools.eval.glue import read_summary
from tools.eval.mteb import benchmark_of
from tools.eval.mteb import read_results as read_mteb_results
from tools.finetune.table import choose, read_results


def pretraining(run: Path) -> dict | None:
    """Parameters, FLOPs (eq. 7-8, and with every head) and token-views/s per process (GPU) of a pre-training run,
    or None before it has logged a step. The processes are those of its latest start (train.log: "on N
    process(es)"); tps is None without it."""
    records = [r for r in read_metrics(RunFolder(run).metrics) if "loss" in r] if run.is_dir() else []
    if not records:
        return None
    log = RunFolder(run).log_text()
    found = re.search(r": ([\d,]+) parameters", log)
    worlds = re.findall(r" on (\d+) process\(es\)", log)
    views_per_s = median_views_per_s(records)
    return {"params": int(found.group(1).replace(",", "")) if found else None,
            "flops": records[-1]["compute_flops"], "flops_with_heads": records[-1].get("compute_flops_with_head"),
            "tps": views_per_s / int(worlds[-1]) if worlds else None}


def median_views_per_s(records: list[dict]) -> float:
    """The median token-views/s of a run's training records, all processes together, the first left out (it holds
    the start-up and the compiles) when there are others."""
    return statistics.median(r["token_views_per_s"] for r in records[1:] or records)


def probe_scores(folder: Path) -> dict[str, dict[str, float]]:
    """{probe: {task: score}} of a GLUE probe results file (the last layer)."""
    return layer_scores(folder).get("last", {})


def layer_scores(folder: Path) -> dict[str, dict[str, dict[str, float]]]:
    """{layer: {probe: {task: score}}} of a GLUE probe results file, its layers in order ("last" after the indices)."""
    path = folder / RESULTS
    if not path.exists():
        return {}
    summary = read_summary(path)
    return {layer: {probe: {t: s for t, s in scores.items() if t != "avg"} for probe, scores in summary[layer].items()}
            for layer in sorted(summary, key=lambda name: (name == "last", int(name) if name.isdigit() else 0))}


def finetune_scores(variant_dir: Path) -> dict[str, float]:
    """{task: score} of the variant's fine-tuning sweeps (its finetune*/ folders: e.g. MNLI first, then the tasks
    that start from it)."""
    results, _ = read_results(sorted(variant_dir.glob("finetune*")))
    chosen = choose(results)
    if len(chosen) > 1:
        raise UserError(f"{variant_dir} holds fine-tuning runs of {len(chosen)} pre-trained models: one expected")
    return {task: entry["score"] for tasks in chosen.values() for task, entry in tasks.items()}


def mteb_results(folder: Path) -> dict[tuple[str, str], dict]:
    """{(benchmark, protocol): results.json} of the variant's MTEB evaluations (benchmark: `benchmark_of`, which
    names a subset by its tasks)."""
    sections = {}
    for path in sorted(folder.glob(f"mteb_*/{RESULTS}")):
        protocol = path.parent.name.rsplit("_", 1)[-1]
        if protocol in ("frozen", "full"):
            results = read_mteb_results(path)
            sections[(benchmark_of(results), protocol)] = results
    return sections


@dataclass
class Variant:
    name: str
    keys: dict
    pretrain: dict | None
    probes: dict[str, dict[str, float]]
    layers: dict[str, dict[str, dict[str, float]]]  # probes_layers/: {layer: {probe: {task: score}}}
    finetune: dict[str, float]
    mteb_runs: dict[tuple[str, str], dict]  # results.json per (benchmark, protocol)

    @property
    def label(self) -> str:
        return str(self.keys.get("row", self.name))

    @property
    def model(self) -> str:
        """The paper's name of the model, e.g. BERT for the variant bert; another variant keeps its name."""
        return paper.NAMES.get(self.name, self.name)


def read_pipeline(folder: Path) -> list[Variant]:
    record = folder / PIPELINE_RECORD
    if not record.exists():
        raise UserError(f"{folder} holds no pipeline (pipeline.json): python -m lingua.stool pipeline writes it")
    variants = untrusted.read_json(record, "pipeline record").get("variants")
    if not isinstance(variants, dict) or not all(isinstance(keys, dict) for keys in variants.values()):
        raise UserError(f"pipeline record {record} holds no variants and their keys")
    return [Variant(name, keys, pretraining(folder / name / "pretrain"), probe_scores(folder / name / "probes"),
                    layer_scores(folder / name / "probes_layers"), finetune_scores(folder / name),
                    mteb_results(folder / name))
            for name, keys in variants.items()]
