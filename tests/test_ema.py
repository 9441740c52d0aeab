"""The weights' exponential moving average (lingua/training/ema.py): its arithmetic and swap, a run that keeps one
(saved with every checkpoint, resumed bit for bit, scored by the evaluations, written to consolidated_ema.pt, exported
and loaded by transformers' AutoModel; any checkpoint's consolidated) and a run that turns it on when it resumes. Two
ranks: tests/test_distributed.py (fsdp_steps' `ema` configuration, ELECTRA under torchrun)."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import read_metrics, tiny_argv, write_corpus

from apps.bert.train import APP as BERT
from lingua.args import load_config
from lingua.checkpoint.store import Checkpoint, saved_shapes
from lingua.distributed import Launch
from lingua.errors import UserError
from lingua.export.consolidate import main as consolidate
from lingua.export.embedder import load_embedder
from lingua.train import train
from lingua.training.ema import WeightsAverage
from lingua.training.memory import estimate
from lingua.training.validation import OfTheAverage

DECAY = 0.9


def run(argv: list[str]) -> dict:
    return train(BERT, load_config(BERT.args_cls, argv))


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)["model"]


def saved_average(checkpoint: Path) -> dict[str, torch.Tensor]:
    """A checkpoint folder's `ema.` entries, read with DCP."""
    state = {"ema": {name: torch.empty(shape) for name, shape in saved_shapes(checkpoint, "ema").items()}}
    with warnings.catch_warnings():  # DCP warns that it reads in a single process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(checkpoint))
    return state["ema"]


@pytest.fixture(scope="module")
def averaged_run(tmp_path_factory) -> tuple[Path, Path]:
    """(the tiny corpus, a finished 10-step BERT run keeping an average, checkpoints at 5 and 10, each evaluation
    scoring both weights, best.pt kept by the average's validation accuracy)."""
    root = tmp_path_factory.mktemp("averaged")
    corpus, dump = write_corpus(root / "data"), root / "run"
    run(averaged_argv(corpus, dump))
    return corpus, dump


def averaged_argv(corpus: Path, dump: Path) -> list[str]:
    return [*tiny_argv(corpus, dump, 10), "checkpoint.every=5", "validation.every=5", f"ema.decay={DECAY}",
            "ema.evaluate=both", "validation.keep_best=ema/val/accuracy"]


@pytest.mark.parametrize("setting, message", [
    ("ema.decay=1", "config key 'ema.decay' must be in [0, 1), got 1.0"),
    ("ema.decay=-0.1", "config key 'ema.decay' must be in [0, 1), got -0.1"),
    ("ema.evaluate=best", "config key 'ema.evaluate' must be one of raw, ema, both, got 'best'"),
    ("ema.evaluate=ema", "config key 'ema.evaluate' is 'ema', but no average is kept: set ema.decay (e.g. 0.999)"),
])
def test_a_bad_setting_is_one_line(setting, message):
    with pytest.raises(UserError) as error:
        load_config(BERT.args_cls, ["dump_dir=x", setting])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_average_follows_each_step_and_swaps_in_and_back_exactly():
    """After each step average = decay * average + (1 - decay) * weights; swapped in, the model holds the average,
    and afterwards its raw weights and the optimizer state bit for bit; a frozen parameter is not averaged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    model[1].bias.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    average = WeightsAverage(model, 0.5)
    expected = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    for _ in range(3):
        model(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        average.update()
        for name, p in model.named_parameters():
            if name in expected:
                expected[name] = 0.5 * expected[name] + 0.5 * p.detach()
    assert average.state_dict().keys() == expected.keys()
    for name, value in average.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-7)
    raw = {name: p.detach().clone() for name, p in model.named_parameters()}
    moments = [state["exp_avg"].clone() for state in optimizer.state.values()]
    with average.swapped_in():
        assert all(torch.equal(p, average.state_dict().get(name, raw[name])) for name, p in model.named_parameters())
    assert all(torch.equal(p, raw[name]) for name, p in model.named_parameters())
    assert all(torch.equal(state["exp_avg"], m) for state, m in zip(optimizer.state.values(), moments, strict=True))


def test_an_evaluation_scores_the_weights_that_ema_evaluate_names():
    model = torch.nn.Linear(2, 1)
    average = WeightsAverage(model, 0.5)  # the weights as they are now
    with torch.no_grad():
        model.weight.add_(1)
    raw = model.weight.sum().item()

    class WeightSum:
        name, keep_best = "sum", ""

        def due(self, step):
            return True

        def run(self, step):
            return {"sum": model.weight.sum().item()}

    assert OfTheAverage(WeightSum(), average, "ema").run(1) == {"ema/sum": pytest.approx(raw - 2)}
    assert OfTheAverage(WeightSum(), average, "both").run(1) == {"sum": raw, "ema/sum": pytest.approx(raw - 2)}
    assert model.weight.sum().item() == raw


def test_every_checkpoint_and_the_end_save_the_average(averaged_run):
    _, dump = averaged_run
    final = saved_average(dump / "checkpoints" / "0000000010")
    at_the_end, raw = weights(dump / "consolidated_ema.pt"), weights(dump / "consolidated.pt")
    assert final.keys() <= at_the_end.keys()
    assert all(torch.equal(value, at_the_end[name]) for name, value in final.items())
    assert any(not torch.equal(value, raw[name]) for name, value in final.items())
    state = json.loads((dump / "checkpoints" / "0000000010" / "train_state_00000.json").read_text())
    assert state["ema_from"] == 0 and Checkpoint.read(dump / "checkpoints" / "0000000010").averaged


def test_evaluations_score_both_weights_and_best_pt_holds_the_average(averaged_run):
    _, dump = averaged_run
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in scored] == [5, 10]
    assert all("ema/val/loss" in r and r["ema/val/loss"] != r["val/loss"] for r in scored)
    best = json.loads((dump / "best.json").read_text())
    average = saved_average(dump / "checkpoints" / f"{best['step']:010d}")
    best_weights = weights(dump / "best.pt")
    assert all(torch.equal(value, best_weights[name]) for name, value in average.items())


def test_a_resumed_run_continues_the_average_bit_for_bit(averaged_run, tmp_path):
    corpus, full = averaged_run
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "0000000010")
    for name in ("consolidated.pt", "consolidated_ema.pt", "best.pt", "best.json"):
        (resumed / name).unlink()
    run(averaged_argv(corpus, resumed))
    reference, continued = weights(full / "consolidated_ema.pt"), weights(resumed / "consolidated_ema.pt")
    assert all(torch.equal(value, continued[name]) for name, value in reference.items())
    assert [read_metrics(resumed)[s]["loss"] for s in range(6, 11)] == \
        [read_metrics(full)[s]["loss"] for s in range(6, 11)]


def test_the_average_exports_and_transformers_loads_it(averaged_run, tmp_path):
    pytest.importorskip("transformers")
    from test_export import assert_transformers_matches

    from lingua.export.hf_folder import ExportArgs, export

    _, dump = averaged_run
    folder = export(ExportArgs(ckpt=str(dump / "consolidated_ema.pt"), out=str(tmp_path / "hf")))
    embedder = load_embedder(str(dump / "consolidated_ema.pt"), "cpu")
    average = weights(dump / "consolidated_ema.pt")
    assert all(torch.equal(p, average[f"encoder.{name}"]) for name, p in embedder.model.backbone.named_parameters())
    assert_transformers_matches(folder, embedder)


def test_any_checkpoint_consolidates_its_average(averaged_run, tmp_path, capsys):
    _, dump = averaged_run
    consolidate(["consolidate", str(dump / "checkpoints" / "0000000010"), str(tmp_path / "ema.pt"), "weights=ema"])
    assert "wrote" in capsys.readouterr().out
    saved, at_the_end = weights(tmp_path / "ema.pt"), weights(dump / "consolidated_ema.pt")
    assert saved.keys() == at_the_end.keys() and all(torch.equal(saved[k], at_the_end[k]) for k in saved)


def test_a_run_turning_the_average_on_starts_it_at_the_resumed_weights(corpus, tmp_path, capsys):
    """A checkpoint saved without an average: the average starts at its weights, and one step later is the mean of
    the two steps' weights at decay 0.5."""
    dump = tmp_path / "run"
    argv = [*tiny_argv(corpus, dump, 2), "validation.every=0"]
    run(argv)
    before = weights(dump / "consolidated.pt")
    run([*argv, "steps=3", "ema.decay=0.5"])
    after, average = weights(dump / "consolidated.pt"), weights(dump / "consolidated_ema.pt")
    for name, value in average.items():
        torch.testing.assert_close(value, 0.5 * before[name] + 0.5 * after[name], rtol=0, atol=1e-7)
    assert json.loads((dump / "checkpoints" / "0000000003" / "train_state_00000.json").read_text())["ema_from"] == 2
    with pytest.raises(SystemExit) as exit_info:
        consolidate(["consolidate", str(dump / "checkpoints" / "0000000002"), str(tmp_path / "x.pt"), "weights=ema"])
    assert exit_info.value.code == 2
    assert "0000000002 holds no average of the weights (its run kept none: ema.decay)\n" in capsys.readouterr().err


def test_a_run_extended_without_the_average_removes_the_older_one(corpus, tmp_path):
    """consolidated_ema.pt would otherwise hold an earlier step's average beside the newer consolidated.pt."""
    dump = tmp_path / "run"
    argv = [*tiny_argv(corpus, dump, 2), "validation.every=0"]
    run([*argv, "ema.decay=0.5"])
    assert (dump / "consolidated_ema.pt").exists()
    run([*argv, "steps=3"])
    assert (dump / "consolidated.pt").exists() and not (dump / "consolidated_ema.pt").exists()


@pytest.mark.parametrize("keep_best, evaluate", [("ema/val/accuracy", "raw"), ("val/accuracy", "ema")])
def test_keep_best_naming_weights_not_scored_is_one_line_before_the_start(corpus, tmp_path, keep_best, evaluate):
    dump = tmp_path / "run"
    with pytest.raises(UserError, match=f"validation.keep_best {keep_best}: the validation logs it only with "
                                        "ema.evaluate=") as error:
        run([*tiny_argv(corpus, dump, 2), f"validation.keep_best={keep_best}", "ema.decay=0.5",
             f"ema.evaluate={evaluate}"])
    assert "\n" not in str(error.value) and not dump.exists()


def test_consolidate_takes_only_its_options(tmp_path):
    with pytest.raises(SystemExit) as exit_info:  # an option without its value: the usage, no traceback
        consolidate(["consolidate", str(tmp_path), str(tmp_path / "x.pt"), "weights"])
    assert "usage: python -m lingua.checkpoint consolidate" in str(exit_info.value.code)


def test_the_memory_estimate_counts_the_average():
    tiny = ["dump_dir=x", "model.encoder.dim=32", "model.encoder.n_layers=1", "model.encoder.n_heads=2",
            "data.tokenizer.name=bytes"]
    plain, averaged = (estimate(BERT, load_config(BERT.args_cls, argv), Launch(), torch.device("cpu"))
                       ["weights and optimizer"] for argv in (tiny, [*tiny, "ema.decay=0.999"]))
    assert averaged == plain * 20 // 16  # 4 bytes a parameter beside the 16 of weights, gradients and AdamW
