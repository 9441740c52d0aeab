"""End-to-end runs of the shared training loop with the BERT app on a tiny corpus."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import kill_after_first_checkpoint_then_restart, read_metrics, tiny_argv, write_corpus

from apps.bert.train import APP
from lingua.app import load_model
from lingua.args import load_config
from lingua.data.loader import ValidationRows
from lingua.distributed import Launch
from lingua.errors import UserError
from lingua.parallel import parallelize
from lingua.train import TrainArgs, main, train
from lingua.training.validation import GLUE_PROBES, EvaluationKind, ValidationArgs, validate

REPO = Path(__file__).resolve().parents[1]


def run(argv):
    return train(APP, load_config(APP.args_cls, argv))


@pytest.fixture(scope="module")
def forty_steps(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the tiny corpus, a finished 40-step run on it, its summary), trained once for the module; tests that resume
    or change it work on a copy."""
    root = tmp_path_factory.mktemp("forty_steps")
    corpus, dump = write_corpus(root / "data"), root / "run"
    return corpus, dump, run(tiny_argv(corpus, dump, steps=40))


def test_loss_falls_and_run_artifacts(forty_steps):
    _, dump, summary = forty_steps
    losses = [m["loss"] for m in read_metrics(dump).values()]
    assert summary["steps"] == 40 and len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert (dump / "config.yaml").exists() and (dump / "consolidated.pt").exists()
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["0000000020", "0000000030", "0000000040"]
    record = read_metrics(dump)[40]
    for key in ("accuracy", "lr", "grad_norm", "data_tokens_per_s", "token_views_per_s", "mfu", "mfu_hw", "memory_gib"):
        assert key in record
    val = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if "val/loss" in line]
    assert [v["step"] for v in val] == [10, 20, 30, 40]


def test_an_apps_parallelism_plan_is_the_one_trained(corpus, tmp_path, monkeypatch):
    """App.parallelize replaces the default plan in training: the app's plan runs, once, on the app's model."""
    planned = []

    def plan(model, distributed, launch, device):
        planned.append((type(model).__name__, distributed.fsdp_type, launch.world_size))
        parallelize(model, model.sharding_units(), distributed, launch, device)

    def default_plan(*args, **kwargs):
        raise AssertionError("the default plan ran in place of the app's")

    monkeypatch.setattr("lingua.app.parallelize", default_plan)
    app = replace(APP, parallelize=plan)
    summary = train(app, load_config(app.args_cls, tiny_argv(corpus, tmp_path / "run", steps=2)))
    assert summary["steps"] == 2 and planned == [("Bert", "full_shard", 1)]


def test_exact_resume(forty_steps, tmp_path):
    """A run resumed from its step-20 checkpoint reproduces the uninterrupted run's losses exactly."""
    (corpus, full, _), resumed = forty_steps, tmp_path / "resumed"
    shutil.copytree(full, resumed)
    for later in ("0000000030", "0000000040"):
        shutil.rmtree(resumed / "checkpoints" / later)
    (resumed / "consolidated.pt").unlink()
    run(tiny_argv(corpus, resumed, steps=40))
    reference, continued = read_metrics(full), read_metrics(resumed)
    assert sorted(continued) == list(range(1, 41))
    for step in range(21, 41):
        assert continued[step]["loss"] == reference[step]["loss"], step


def test_sigkill_then_restart_continues_exactly(corpus, tmp_path):
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    kill_after_first_checkpoint_then_restart("apps.bert.train", tiny_argv(corpus, killed, 30) + ["checkpoint.every=5"],
                                             killed)
    run(tiny_argv(corpus, reference, steps=30) + ["checkpoint.every=5"])
    expected, got = read_metrics(reference), read_metrics(killed)
    assert sorted(got) == list(range(1, 31))
    assert all(got[s]["loss"] == expected[s]["loss"] for s in got)


def test_sigterm_saves_and_stops(corpus, tmp_path, monkeypatch):
    dump = tmp_path / "run"
    from lingua.training import step as training_step

    original = training_step.clip_gradients
    calls = []

    def clip_then_signal(model, max_norm):  # deliver SIGTERM during step 3
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(model, max_norm)

    monkeypatch.setattr(training_step, "clip_gradients", clip_then_signal)
    summary = run(tiny_argv(corpus, dump, steps=40))
    assert summary["steps"] == 3
    assert [p.name for p in (dump / "checkpoints").iterdir()] == ["0000000003"]


def test_exported_model_encodes(corpus, tmp_path):
    dump = tmp_path / "run"
    run(tiny_argv(corpus, dump, steps=2))
    model, config, tokenizer = load_model(dump)
    from_checkpoint, _, _ = load_model(dump / "checkpoints" / "0000000002")
    tokens = torch.tensor([tokenizer.encode("the cat sat.")])
    out = model.encode(tokens, torch.ones_like(tokens, dtype=torch.bool))
    assert out.shape == (1, tokens.shape[1], config.model.encoder.dim)
    assert torch.equal(out, from_checkpoint.encode(tokens))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["model.encoder.dimm=3"], "unknown config key 'model.encoder.dimm'"),
        (["data.root_dir=/nonexistent/data"], "/nonexistent/data"),
        (["data.seq_len=64"], "exceeds model.encoder.max_seqlen"),
    ],
)
def test_user_errors_are_one_line(corpus, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(APP, tiny_argv(corpus, tmp_path / "run", steps=2) + extra)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_the_command_line_says_a_user_error_in_one_line(corpus, tmp_path):
    """The same as above through `python -m` (the messages themselves are checked in-process above)."""
    argv = tiny_argv(corpus, tmp_path / "run", steps=2) + ["model.encoder.dimm=3"]
    proc = subprocess.run([sys.executable, "-m", "apps.bert.train", *argv], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown config key 'model.encoder.dimm'" in proc.stderr and "Traceback" not in proc.stderr


def test_gradient_accumulation_matches_a_full_batch(corpus, tmp_path):
    """Two micro-batches of 4 rows give the same step as one batch of 8 rows (same rows, same masks)."""
    full = run(tiny_argv(corpus, tmp_path / "full", steps=3))
    accumulated = run(tiny_argv(corpus, tmp_path / "acc", steps=3) + ["data.batch_size=4", "grad_acc_steps=2"])
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "acc")
    assert full["data_tokens"] == accumulated["data_tokens"]
    for step in (1, 2, 3):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5)


def test_glue_probes_during_training(corpus, tmp_path):
    glue = Path(__file__).parent / "fixtures" / "glue"
    dump = tmp_path / "run"
    run(tiny_argv(corpus, dump, steps=4) + [f"eval.data={glue}", "eval.tasks=sst2,stsb", "eval.every=2",
                                            "eval.probes=linear"])
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    probes = [r for r in records if "glue/sst2/linear" in r]
    assert [r["step"] for r in probes] == [2, 4]
    assert all(0 <= r["glue/sst2/linear"] <= 100 and "glue/stsb/linear" in r for r in probes)


def test_the_glue_probes_are_an_evaluation_the_app_registers(corpus, tmp_path):
    """The loop names no evaluation: the GLUE probes are a kind the app registers (App.evaluations) beside their
    `eval` section in the app's config, not in TrainArgs. A bad setting of probes that will run stops the run before
    its folder exists; an app that registers none has no `eval` key."""
    assert "eval" not in {field.name for field in dataclasses.fields(TrainArgs)} and GLUE_PROBES in APP.evaluations
    assert "glue" not in (REPO / "lingua" / "train.py").read_text().lower()
    dump = tmp_path / "run"
    with pytest.raises(UserError, match="GLUE data folder not found"):
        run(tiny_argv(corpus, dump, steps=2) + [f"eval.data={tmp_path / 'nowhere'}", "eval.every=1"])
    assert not dump.exists()
    run(tiny_argv(corpus, dump, steps=2) + [f"eval.data={tmp_path / 'nowhere'}"])  # eval.every=0: no probe runs

    @dataclasses.dataclass
    class UnprobedArgs(TrainArgs):
        model: dict = dataclasses.field(default_factory=dict)

    with pytest.raises(UserError, match="unknown config key 'eval'"):
        load_config(UnprobedArgs, ["dump_dir=x", "eval.every=2"])
    with pytest.raises(UserError, match="UnprobedArgs has no `eval: GlueEvalArgs` section"):
        GLUE_PROBES.check(UnprobedArgs(dump_dir="x"), 1)  # an app that registers the probes without their section


class SentenceSimilarity:
    """An app's own evaluation (an STS-like score): the cosine of two fixed rows' mean-pooled states, every 3 steps."""

    name, keep_best = "similarity", "sim/cosine"

    def __init__(self, context):
        self.model, self.device, self.steps = context.model, context.device, []
        self.rows = torch.tensor([[1, 40, 41, 42, 2], [1, 40, 41, 43, 2]])

    def due(self, step):
        return step % 3 == 0

    def run(self, step):
        self.steps.append(step)
        with torch.no_grad():
            states = self.model.encode(self.rows.to(self.device)).float().mean(1)
        return {"sim/cosine": torch.nn.functional.cosine_similarity(states[0], states[1], dim=0).item()}


def test_an_apps_own_evaluation_runs_at_its_interval_and_keeps_its_best(corpus, tmp_path):
    """App.evaluations adds an evaluation without any change to the loop; its keep_best exports best.pt."""
    built = []
    app = replace(APP, evaluations=(EvaluationKind(lambda context: built.append(SentenceSimilarity(context))
                                                   or built[-1]),))
    dump = tmp_path / "run"
    train(app, load_config(app.args_cls, tiny_argv(corpus, dump, steps=7) + ["validation.every=0"]))
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    scores = [r for r in records if "sim/cosine" in r]
    assert [r["step"] for r in scores] == built[0].steps == [3, 6] and all(-1 <= r["sim/cosine"] <= 1 for r in scores)
    assert json.loads((dump / "best.json").read_text()) == max(scores, key=lambda r: r["sim/cosine"])
    assert (dump / "best.pt").exists() and not any("val/loss" in r for r in records)


def test_logged_lr_is_the_rate_the_step_used(corpus, tmp_path):
    from lingua.training.optim import lr_at

    args = load_config(APP.args_cls, tiny_argv(corpus, tmp_path / "run", steps=8))
    run(tiny_argv(corpus, tmp_path / "run", steps=8))
    logged = read_metrics(tmp_path / "run")
    assert [logged[s]["lr"] for s in range(1, 9)] == pytest.approx([lr_at(s, args.optim, 8) for s in range(8)])


def test_resume_survives_a_torn_metrics_line(corpus, tmp_path):
    dump = tmp_path / "run"
    run(tiny_argv(corpus, dump, steps=20))
    shutil.rmtree(dump / "checkpoints" / "0000000020")
    with (dump / "metrics.jsonl").open("a") as f:
        f.write('{"step": 21, "loss": 1.')  # a kill in the middle of a write
    run(tiny_argv(corpus, dump, steps=20))
    assert sorted(read_metrics(dump)) == list(range(1, 21))


def test_two_sources_each_log_their_validation_loss(corpus, tmp_path):
    """val/loss stays the mix of the sources' rows (4 and 4 here, by weight); val/loss/SOURCE is each one's own."""
    shutil.copytree(write_corpus(tmp_path / "other", seed=1) / "tiny", corpus / "wiki")
    dump = tmp_path / "run"
    run(tiny_argv(corpus, dump, steps=10) + ["data.sources.wiki=1.0", "validation.batch_size=3"])  # a chunk spans both
    (val,) = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if "val/loss" in line]
    assert {"val/loss", "val/accuracy", "val/loss/tiny", "val/loss/wiki"} <= set(val)
    assert val["val/loss"] == pytest.approx((val["val/loss/tiny"] + val["val/loss/wiki"]) / 2, rel=1e-5)
    assert val["val/loss/tiny"] != val["val/loss/wiki"]


class RowMean(torch.nn.Module):
    """A model whose loss is the mean of its rows' values (each row holds one value)."""

    def make_batch(self, rows, generator):
        return {"rows": rows.float()}

    def forward(self, rows):
        return rows.mean(), {"accuracy": rows.mean()}


def test_each_sources_validation_loss_is_the_same_over_any_number_of_ranks():
    tokens = ValidationRows(torch.arange(8).repeat_interleave(4).view(8, 4), {"a": 5, "b": 3})  # row i holds i
    args = ValidationArgs(batch_size=4)
    whole = validate(RowMean(), tokens, args, torch.device("cpu"), Launch())
    assert whole == pytest.approx({"val/loss": 3.5, "val/accuracy": 3.5, "val/loss/a": 2.0, "val/loss/b": 6.0})
    ranks = [validate(RowMean(), tokens, args, torch.device("cpu"), Launch(rank=r, world_size=2)) for r in (0, 1)]
    assert {key: ranks[0][key] + ranks[1][key] for key in whole} == pytest.approx(whole)  # what all_reduce sums
    tokens = ValidationRows(tokens.tokens)  # one source: the mix alone, as before
    assert validate(RowMean(), tokens, args, torch.device("cpu"), Launch()) == {"val/loss": 3.5, "val/accuracy": 3.5}
