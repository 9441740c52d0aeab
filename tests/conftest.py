"""Shared fixtures: a tiny JSONL corpus in the training layout and tiny training configs."""

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
import random
from pathlib import Path

import pytest

WORDS = (
    "the a cat dog sat on mat ran to park red blue green big small house tree river stone bird sang "
    "under over quickly slowly happy tall old young and then after before"
).split()


def write_corpus(root: Path, n_docs: int = 300, seed: int = 0) -> Path:
    """ROOT/tiny/train.0000{0,1}.jsonl + valid.jsonl of short sentences with a learnable structure."""
    rng = random.Random(seed)
    source = root / "tiny"
    source.mkdir(parents=True)

    def doc() -> str:
        return " ".join(
            f"the {rng.choice(WORDS[2:10])} {rng.choice(WORDS[10:18])} the {rng.choice(WORDS[18:30])}."
            for _ in range(rng.randint(2, 6))
        )

    for chunk in range(2):
        lines = [json.dumps({"text": doc()}) for _ in range(n_docs // 2)]
        (source / f"train.{chunk:05d}.jsonl").write_text("\n".join(lines) + "\n")
    (source / "valid.jsonl").write_text("\n".join(json.dumps({"text": doc()}) for _ in range(60)) + "\n")
    return root


@pytest.fixture(autouse=True)
def restore_logging_handlers():
    """Commands under test attach handlers to the root logger (stdout, a run's train.log): remove them afterwards,
    so no later test writes to a closed capture stream or another test's file."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
        handler.close()


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "data")


def tiny_argv(data_root: Path, dump_dir: Path, steps: int) -> list[str]:
    """A model small enough that a few dozen steps take seconds on one CPU core."""
    return [
        f"dump_dir={dump_dir}",
        f"steps={steps}",
        f"data.root_dir={data_root}",
        "data.sources.tiny=1.0",
        "data.seq_len=32",
        "data.batch_size=8",
        "data.prefetch=2",
        "data.tokenizer.name=bytes",
        "model.encoder.dim=32",
        "model.encoder.n_layers=2",
        "model.encoder.n_heads=2",
        "model.encoder.max_seqlen=32",
        "optim.lr=3e-3",
        "optim.warmup=5",
        "logging.freq=1",
        "validation.every=10",
        "validation.n_sequences=8",
        "checkpoint.every=10",
    ]


def read_metrics(dump_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's training records (those with a loss) by step."""
    records = [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def load_setup_script(name: str):
    """Imports setup/NAME.py (a script folder, not a package)."""
    path = Path(__file__).resolve().parents[1] / "setup" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"setup_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kill_after_first_checkpoint_then_restart(module: str, argv: list[str], dump_dir: Path) -> None:
    """Runs `python -m module argv`, SIGKILLs it once a checkpoint past step 5 is complete, then runs it again to
    the end."""
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", module, *argv]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list((dump_dir / "checkpoints").glob("00000000[1-9][05]")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
