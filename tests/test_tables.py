"""tools.tables: the paper's tables from a pipeline's folder (made up here), ours beside the paper's numbers."""

import json

import pytest

from lingua.eval.glue import TASKS
from tools import paper, tables

CATEGORIES = ("Classification", "Clustering", "PairClassification", "Reranking", "Retrieval", "STS",
              "Summarization")
METRICS = {"Classification": "accuracy", "Clustering": "v_measure", "PairClassification": "max_ap",
           "Reranking": "map_at_1000", "Retrieval": "ndcg_at_10", "STS": "cosine_spearman",
           "Summarization": "cosine_spearman"}


def fake_pipeline(root, variants: dict, probes: dict | None = None, mteb: dict | None = None, world: int = 2):
    """DIR/pipeline.json and, per variant, a pre-training log (on `world` processes) and metrics (1000 x (i + 1)
    token-views/s per process), GLUE probe results and MTEB results ({folder: (benchmark, summary)}, or
    (benchmark, summary, tasks) for a run of those tasks: {name: (type, score)})."""
    root.mkdir(parents=True)
    (root / "pipeline.json").write_text(json.dumps({"variants": variants}))
    for i, name in enumerate(variants):
        run = root / name / "pretrain"
        run.mkdir(parents=True)
        (run / "train.log").write_text(f"10:00:00 I apps.bert.train: {1_000_000 * (i + 1):,} parameters (...) on "
                                       f"{world} process(es) (torchrun, cuda)\n")
        records = [{"step": s, "loss": 5.0, "compute_flops": 2e15 * s, "data_tokens_per_s": 7.0,
                    "token_views_per_s": 1000.0 * (i + 1) * world} for s in (10, 20, 30)]
        (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
        if probes:
            (root / name / "probes").mkdir()
            (root / name / "probes" / "results.json").write_text(json.dumps(
                {"summary": {"last": {"linear": {**probes[name], "avg": 0.0}}}}))
        for folder, (benchmark, summary, *subset) in (mteb or {}).get(name, {}).items():
            tasks = subset[0] if subset else {f"{c}Task": (c, summary[c]) for c in CATEGORIES if c in summary}
            (root / name / folder).mkdir()
            (root / name / folder / "results.json").write_text(json.dumps(
                {"args": {"benchmark": benchmark, "offline": "", "tasks": list(subset[0]) if subset else []},
                 "tasks": {task: {"type": kind, "metric": METRICS[kind], "score": score}
                           for task, (kind, score) in tasks.items()},
                 "summary": summary}))
    return root


def render(capsys, table: str, folder) -> list[str]:
    tables.main([f"table={table}", f"dir={folder}"])
    return capsys.readouterr().out.splitlines()


def test_table3_puts_the_papers_rows_beside_ours_with_our_runs_cost(tmp_path, capsys):
    scores = {task: 50.0 + i for i, task in enumerate(TASKS)}
    summary = {**{c: 40.0 for c in CATEGORIES}, "Avg.": 40.0, "Overall": 41.0}
    folder = fake_pipeline(tmp_path / "p", {"bert": {"app": "bert"}, "crossbert": {"app": "crossbert"}},
                           probes={"bert": scores, "crossbert": scores},
                           mteb={"crossbert": {"mteb_v1_frozen": ("MTEB(eng, v1)", summary)}})
    lines = render(capsys, "3", folder)
    linear = lines.index("**GLUE, linear probe on frozen features**")
    assert lines[linear + 2] == ("| Model | Params | FLOPs | tps | MNLI | QNLI | QQP | RTE | SST2 | MRPC | CoLA | STSB "
                                 "| Avg. |")
    assert lines[linear + 4] == "| bert | 1.0M | 6.0e16 | 1.0k | " + " | ".join(
        f"{50.0 + i:.1f}" for i in range(8)) + " | 53.5 |"
    assert lines[linear + 7] == "| *crossbert, paper* | 279M | 4.1e19 | 207k | " + " | ".join(
        f"{v:.1f}" for v in paper.GLUE_LINEAR["crossbert"]) + " |"
    frozen = next(i for i, line in enumerate(lines) if line.startswith("**MTEB(eng, v1), contrastive fine-tuning, "
                                                                       "over frozen features"))
    assert lines[frozen + 4] == "| bert | 1.0M | 6.0e16 | 1.0k | " + " | ".join(["–"] * 9) + " |"  # not run
    assert lines[frozen + 5].startswith("| crossbert | 2.0M | 6.0e16 | 2.0k | 40.0 | ")
    assert lines[frozen + 7] == "| *crossbert, paper* | 279M | 4.1e19 | 207k | " + " | ".join(
        f"{v:.1f}" for v in paper.MTEB[("MTEB(eng, v1)", "frozen")]["crossbert"]) + " |"
    assert not any("fine-tuning (dev" in line for line in lines)  # no fine-tuning run: no section


def test_fewer_glue_tasks_are_averaged_alike_on_both_sides_and_said_so(tmp_path, capsys):
    folder = fake_pipeline(tmp_path / "p", {"bert": {"app": "bert"}}, probes={"bert": {"rte": 60.0, "stsb": 80.0}})
    lines = render(capsys, "3", folder)
    assert "| Model | Params | FLOPs | tps | RTE | STSB | Avg. (2 of 8 tasks) |" in lines
    assert "| *bert, paper* | 239M | 6.8e19 | 123k | 59.9 | 79.5 | 69.7 |" in lines  # (59.9 + 79.5) / 2
    assert ("Metrics (dev, in %): RTE accuracy; STSB Spearman correlation. The paper's rows: its numbers on these 2 "
            "tasks, averaged here as ours (its own average is over all 8).") in lines


def test_tps_is_per_gpu_in_token_views_as_the_papers(tmp_path, capsys):
    folder = fake_pipeline(tmp_path / "p", {"bert": {"app": "bert"}}, probes={"bert": {"rte": 60.0}}, world=8)
    lines = render(capsys, "3", folder)
    assert any(line.startswith("| bert | 1.0M | 6.0e16 | 1.0k | 60.0 |") for line in lines)  # 8000 views/s over 8
    assert any("tps, as the paper's: training token-views per second per GPU" in line for line in lines)
    (folder / "bert" / "pretrain" / "train.log").write_text("no process count\n")
    assert any(line.startswith("| bert | – | 6.0e16 | – | 60.0 |") for line in render(capsys, "3", folder))


@pytest.mark.parametrize("tasks", [
    {"STS12": ("STS", 70.0), "SciFact": ("Retrieval", 30.0)},
    {f"{c}Task": (c, 50.0) for c in CATEGORIES},  # every type, still not the benchmark
], ids=["two tasks", "every type"])
def test_an_mteb_subset_is_shown_alone_with_its_number_of_tasks(tmp_path, capsys, tasks):
    benchmark = "MTEB(eng, v2)"
    types = sorted({kind for kind, _ in tasks.values()}, key=CATEGORIES.index)
    summary = {**{kind: 50.0 for kind in types}, "Avg.": 50.0, "Overall": 50.0}
    folder = fake_pipeline(tmp_path / "p", {"crossbert": {"app": "crossbert"}},
                           mteb={"crossbert": {"mteb_v2_full": (benchmark, summary, tasks)}})
    lines = render(capsys, "3", folder)
    title = (f"**{benchmark}: {', '.join(tasks)}, contrastive fine-tuning, whole model ({len(tasks)} tasks: the "
             f"paper's rows, over its whole benchmark, do not compare)**")
    assert title in lines
    header = lines[lines.index(title) + 2]
    assert header.endswith(f"| Avg. ({len(types)} types) | Overall |")
    assert not any("paper*" in line for line in lines)  # nothing re-averaged shown as the paper's


def test_a_whole_mteb_benchmark_sits_beside_the_papers_and_names_its_metrics(tmp_path, capsys):
    summary = {**{c: 40.0 for c in CATEGORIES}, "Avg.": 40.0, "Overall": 41.0}
    folder = fake_pipeline(tmp_path / "p", {"crossbert": {"app": "crossbert"}},
                           mteb={"crossbert": {"mteb_v2_full": ("MTEB(eng, v2)", summary)}})
    lines = render(capsys, "3", folder)
    title = lines.index("**MTEB(eng, v2), contrastive fine-tuning, whole model**")
    assert lines[title + 5] == "| *crossbert, paper* | 279M | 4.1e19 | 207k | " + " | ".join(
        f"{v:.1f}" for v in paper.MTEB[("MTEB(eng, v2)", "full")]["crossbert"]) + " |"
    assert lines[title + 7].startswith("Metrics (in %): each task's main score in mteb (Class. accuracy; ")
    assert "Retriev. ndcg_at_10; STS cosine_spearman" in lines[title + 7]


@pytest.mark.parametrize("table, published, label", [
    ("6", paper.BERT_MASK_RATIO, "mask %"),
    ("5", paper.CMS, "CMS"),
])
def test_glue_ablations_print_the_papers_row_for_each_of_ours(tmp_path, capsys, table, published, label):
    rows = list(published)
    folder = fake_pipeline(tmp_path / "p", {f"v{row}": {"row": row} for row in rows},
                           probes={f"v{row}": {task: 70.0 for task in TASKS} for row in rows})
    lines = render(capsys, table, folder)
    for row in rows:
        assert f"| {label} {row} | " + " | ".join(["70.0"] * 9) + " |" in lines
        assert f"| *{label} {row}, paper* | " + " | ".join(f"{v:.1f}" for v in published[row]) + " |" in lines


def test_table2_averages_each_masking_ratio_beside_the_paper(tmp_path, capsys):
    folder = fake_pipeline(tmp_path / "p", {"mask20": {"row": "20"}, "mask65": {"row": "65"}},
                           probes={"mask20": {"rte": 70.0, "sst2": 80.0}, "mask65": {"rte": 60.0, "sst2": 70.0}})
    lines = render(capsys, "2", folder)
    assert "| Masking ratio (%) | 20 | 65 |" in lines
    assert "| CrossBERT (Avg. over 2 tasks) | 75.0 | 65.0 |" in lines
    assert "| *CrossBERT, paper (8 tasks)* | – | – |" in lines  # its 8-task average is not beside our 2 tasks'
    assert "Metrics (dev, in %): RTE and SST2 accuracy." in lines
    folder = fake_pipeline(tmp_path / "all", {"mask20": {"row": "20"}, "mask65": {"row": "65"}},
                           probes={"mask20": {task: 70.0 for task in TASKS}, "mask65": {task: 60.0 for task in TASKS}})
    lines = render(capsys, "2", folder)
    assert "| CrossBERT (Avg. over 8 tasks) | 70.0 | 60.0 |" in lines
    assert "| *CrossBERT, paper (8 tasks)* | 73.8 | 72.4 |" in lines


def test_table7_compares_the_cold_and_warm_pooler_on_mteb(tmp_path, capsys):
    summary = {**{c: 50.0 for c in CATEGORIES}, "Avg.": 50.0, "Overall": 51.0}
    folder = fake_pipeline(tmp_path / "p", {"cold": {"row": "cold"}, "warm": {"row": "warm"}},
                           mteb={name: {"mteb_v2_frozen": ("MTEB(eng, v2)", summary)} for name in ("cold", "warm")})
    lines = render(capsys, "7", folder)
    assert "| warm | " + " | ".join(["50.0"] * 8) + " | 51.0 |" in lines
    assert "| *warm, paper* | " + " | ".join(f"{v:.1f}" for v in paper.WARM_START["warm"]) + " |" in lines


def test_a_folder_without_a_pipeline_and_an_unknown_table_are_one_line_errors(tmp_path, capsys):
    for argv, message in ((["table=3", f"dir={tmp_path}"], "holds no pipeline (pipeline.json)"),
                          (["table=9", f"dir={tmp_path}"], "must be one of 1, 2, 3, 4, 5, 6, 7")):
        with pytest.raises(SystemExit) as exit_:
            tables.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_table1_has_a_row_per_layer_with_each_tasks_score_and_the_average(tmp_path, capsys):
    folder = fake_pipeline(tmp_path / "p", {"bert": {"app": "bert"}})
    summary = {str(layer): {"linear": {"rte": 50.0 + layer, "sst2": 70.0 + layer, "avg": 0.0},
                            "knn": {"rte": 40.0, "sst2": 60.0, "avg": 0.0}} for layer in (10, 0, 1)}
    (folder / "bert" / "probes_layers").mkdir()
    (folder / "bert" / "probes_layers" / "results.json").write_text(json.dumps({"summary": summary}))
    lines = render(capsys, "1", folder)
    linear = lines.index("**bert, linear probe**")
    assert lines[linear + 2:linear + 7] == ["| Model | RTE | SST2 | Avg. (2 of 8 tasks) |", "|---|---|---|---|",
                                            "| Layer 0 | 50.0 | 70.0 | 60.0 |", "| Layer 1 | 51.0 | 71.0 | 61.0 |",
                                            "| Layer 10 | 60.0 | 80.0 | 70.0 |"]
    knn = lines.index("**bert, knn probe**")
    assert lines[knn + 4] == "| Layer 0 | 40.0 | 60.0 | 50.0 |"
    assert any(line.startswith("Metrics") and "RTE" in line for line in lines[linear:knn])


def test_table1_without_layer_wise_results_says_what_is_missing(tmp_path, capsys):
    folder = fake_pipeline(tmp_path / "p", {"bert": {"app": "bert"}}, probes={"bert": {"rte": 60.0}})
    with pytest.raises(SystemExit) as exit_:
        render(capsys, "1", folder)
    assert exit_.value.code == 2 and "probes_layers/results.json" in capsys.readouterr().err
