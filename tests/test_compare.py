"""tools.compare: runs side by side, on three tiny runs written as the trainer writes its folder."""

import json

import pytest
import yaml

from tools import compare


def write_run(folder, app: str, losses: list[float], logged_probe: float, filed_probe: float | None = None):
    """config.yaml, train.log's first line and metrics.jsonl as the loop writes them: a training record and a
    validation record every 10 steps (each step 1,000 data tokens, 2e12 FLOPs by eq. 7-8, 3e12 with the heads), then
    the GLUE probe logged at the end; `filed_probe`: a tools.eval.glue result filed with the run."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(
        {"optim": {"lr": 1e-3}, "model": {"encoder": {"dim": 32, "n_layers": 2}}}))
    (folder / "train.log").write_text(f"10:00:00 I apps.{app}.train: 12,345 parameters (...) on 1 process(es)\n")
    records = []
    for i, loss in enumerate(losses, 1):
        step = 10 * i
        records += [{"step": step, "loss": loss + 0.1, "data_tokens": 1000 * step, "compute_flops": 2e12 * step,
                     "compute_flops_with_head": 3e12 * step, "data_tokens_per_s": 500.0 * i,
                     "token_views_per_s": 1000.0 * i},
                    {"step": step, "val/loss": loss, "val/accuracy": 0.1}]
    records.append({"step": 10 * len(losses), "glue/avg/linear": logged_probe, "glue/rte/linear": logged_probe})
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    if filed_probe is not None:
        (folder / "glue_eval" / "consolidated").mkdir(parents=True)
        (folder / "glue_eval" / "consolidated" / "results.json").write_text(json.dumps(
            {"summary": {"last": {"linear": {"rte": filed_probe, "avg": filed_probe}}}}))


@pytest.fixture
def three_runs(tmp_path):
    write_run(tmp_path / "bert", "bert", [7.0, 6.0, 6.5], logged_probe=55.0)
    write_run(tmp_path / "crossbert", "crossbert", [7.2, 5.5, 5.0], logged_probe=58.0, filed_probe=61.25)
    write_run(tmp_path / "electra", "electra", [30.0, 20.0, 18.0], logged_probe=60.0)
    return [str(tmp_path / name) for name in ("bert", "crossbert", "electra")]


def test_compare_prints_each_runs_losses_cost_and_probes_and_draws_the_curves(three_runs, tmp_path, capsys):
    out = tmp_path / "figures" / "curves.png"
    compare.main([*three_runs, f"plot={out}"])
    lines = capsys.readouterr().out.splitlines()
    masked_lm, electra = "val loss, masked LM (final / best)", "val loss, electra: generator MLM + rtd_weight x RTD"
    assert lines[0] == (f"| run | app | {masked_lm} | {electra} (final / best) | steps | data tokens | FLOPs eq. 7-8 "
                        "| FLOPs, all heads | token-views/s | glue/avg/linear |")
    bert, crossbert, electra_row = (line.split(" | ") for line in lines[2:5])
    assert bert[1:9] == ["bert", "6.5000 / 6.0000", "", "30", "3.00e4", "6.00e13", "9.00e13", "2,500"]  # 1st left out
    assert crossbert[2:4] == ["5.0000 / 5.0000", ""] and crossbert[-1] == "61.2 |"  # the filed result, not 58.0
    assert electra_row[2:4] == ["", "18.0000 / 18.0000"] and electra_row[-1] == "60.0 |"  # logged in training
    assert any(line.startswith("The validation losses of different objectives are not comparable") for line in lines)
    assert lines[-1] == f"plot: {out}"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20000  # two panels drawn


def test_compare_shows_the_metrics_named_and_one_column_of_losses_for_masked_lm_runs(three_runs, capsys):
    compare.main(three_runs[:2] + ["metrics=glue/rte/linear,mteb/MTEB(eng, v2)/Avg."])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| token-views/s | glue/rte/linear | mteb/MTEB(eng, v2)/Avg. |")
    assert lines[0].count("val loss") == 1 and lines[3].endswith("| 61.2 | – |")  # no MTEB run: a dash
    assert not any("not comparable" in line for line in lines)


def test_a_folder_that_is_not_a_run_or_an_unknown_metric_is_one_line(three_runs, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    errors = []
    for folders in ([three_runs[0], str(tmp_path / "empty")], [str(tmp_path / "missing")], [],
                    [three_runs[0], "metrics=glue/avg/linear,val/loss"]):
        with pytest.raises(SystemExit) as exit:
            compare.main(folders)
        errors.append(capsys.readouterr().err)
        assert exit.value.code == 2 and errors[-1].count("\n") == 1
    assert errors[:2] == [f"error: {tmp_path / name} is not a run (no metrics.jsonl in it)\n"
                          for name in ("empty", "missing")]
    assert errors[2].startswith("error: name the runs to compare")
    assert errors[3] == "error: config key 'metrics' 'val/loss' is neither glue/TASK/PROBE nor mteb/BENCHMARK/TYPE\n"
