"""The shipped debug configs on the real pieces: GPT-2 tokenizer file, offline sample corpus, real GLUE files.

setup/install.sh provides the first two (CI runs it first); each test skips with a reason when a piece is absent.
"""

import importlib
import json
from pathlib import Path

import pytest

from apps import registered_apps
from lingua.app import TEXT
from lingua.args import load_config
from lingua.data.tokenizer import default_tokenizer_dir
from lingua.train import train

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
REAL_GLUE = REPO.parent / "shared" / "data" / "glue"

needs_real_pieces = pytest.mark.skipif(
    not SAMPLE.is_dir() or not (default_tokenizer_dir() / "r50k_base.tiktoken").exists(),
    reason="run setup/install.sh first (sample corpus and tokenizer file)",
)


# Every registered app that pre-trains on text and ships a debug config.
PRETRAINING = {app.short_name: app for app in registered_apps() if app.data is TEXT and app.config("debug")}


@needs_real_pieces
@pytest.mark.parametrize("name", PRETRAINING)
def test_debug_config_trains_on_the_sample(name, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the configs name data/ relative to the repository root
    app, dump = PRETRAINING[name], tmp_path / "run"
    argv = [f"config={app.config('debug')}",
            f"dump_dir={dump}", "steps=12", "logging.freq=4", "validation.every=12", "validation.n_sequences=8",
            "optim.warmup=4"]
    if REAL_GLUE.is_dir():
        argv += [f"eval.data={REAL_GLUE}", "eval.every=12", "eval.tasks=rte", "eval.max_train=200"]
    summary = train(app, load_config(app.args_cls, argv))
    assert summary["final_loss"] < summary["first_loss"]
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 12 and any("val/loss" in r for r in records)
    assert all(r.get("malformed_lines", 0) == 0 for r in records)
    if REAL_GLUE.is_dir():
        assert any("glue/rte/linear" in r for r in records)


def readme_training_commands() -> list[list[str]]:
    """The README's one-line training commands of a shipped config: [module, key=value, ...] each."""
    commands = []
    for line in (REPO / "README.md").read_text().splitlines():
        for command in line.split("#")[0].split("&&"):
            words = command.split()
            if words[:2] == ["python", "-m"] and words[2].endswith(".train") and not line.rstrip().endswith("\\") \
                    and any(w.startswith("config=") and (REPO / w[7:]).is_file() for w in words):
                commands.append(words[2:])
    return commands


def test_the_readmes_training_commands_work_after_the_quick_start():
    """The quick start's run holds its dump_dir: another README command that trains in that folder resumes it, so
    it must train the same model. The Training section's `model.encoder.dim=64` did not and was refused."""
    quick_start = load_config(PRETRAINING["crossbert"].args_cls, ["config=apps/crossbert/configs/debug.yaml"])
    commands = readme_training_commands()
    assert len(commands) >= 4, commands
    for module, *argv in commands:
        app = importlib.import_module(module).APP
        config = load_config(app.args_cls, argv)
        if config.dump_dir == quick_start.dump_dir:
            assert app.name == PRETRAINING["crossbert"].name and config.model == quick_start.model, (module, argv)
