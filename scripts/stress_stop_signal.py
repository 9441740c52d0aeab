"""Stress test of the stop agreement (not run in CI): in each trial a two-rank CPU run of a tiny BERT under torchrun
gets the preemption signal on one rank chosen at random, at a random moment of its training; the trial passes
when every rank stopped after the same step, saved that step's checkpoint together and exited 0.

    python scripts/stress_stop_signal.py [trials=200] [procs=2] [out=FILE.json]

Prints one line per trial and a summary; about 10 s per trial on 2 cores.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a script: the library beside it
from lingua.run_folder import RunFolder  # noqa: E402

WORDS = "the a cat dog sat on mat ran to park red blue green big small house tree river stone bird".split()


def write_corpus(root: Path) -> None:
    rng = random.Random(0)
    source = root / "tiny"
    source.mkdir(parents=True)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))}) for _ in range(400)]
    (source / "train.00000.jsonl").write_text("\n".join(lines[:200]) + "\n")
    (source / "train.00001.jsonl").write_text("\n".join(lines[200:]) + "\n")
    (source / "valid.jsonl").write_text("\n".join(lines[:20]) + "\n")


def training_argv(data: Path, dump: Path) -> list[str]:
    return [f"dump_dir={dump}", "steps=1000000", f"data.root_dir={data}", "data.sources.tiny=1.0", "data.seq_len=32",
            "data.batch_size=8", "data.tokenizer.name=bytes", "model.encoder.dim=32", "model.encoder.n_layers=2",
            "model.encoder.n_heads=2", "model.encoder.max_seqlen=32", "logging.freq=20", "validation.every=0",
            "checkpoint.every=1000000", "distributed.timeout_minutes=1"]


def workers(launcher: int) -> dict[int, int]:
    """Rank -> pid of the training processes torchrun started."""
    found = {}
    for pid in subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(OSError):
            env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                       if b"=" in item)
            if b"RANK" in env:
                found[int(env[b"RANK"])] = int(pid)
    return found


def kill_all(launcher: subprocess.Popen, pids: list[int]) -> None:
    for pid in [launcher.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()


def trial(data: Path, dump: Path, procs: int, rng: random.Random) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", "-m",
           "apps.bert.train", *training_argv(data, dump)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (RunFolder(dump).metrics.exists()
                                              and len(workers(launcher.pid)) == procs):
            time.sleep(0.05)
        ranks = workers(launcher.pid)
        pids = list(ranks.values())
        rank, delay = rng.randrange(procs), rng.uniform(0, 2)
        time.sleep(delay)
        os.kill(ranks[rank], signal.SIGUSR2)
        try:
            status = launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            return {"rank": rank, "delay_s": round(delay, 3), "outcome": "hung"}
    finally:
        kill_all(launcher, pids)
    folder = RunFolder(dump).checkpoints
    saved = sorted(p for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    steps = [json.loads(p.read_text())["step"] for p in sorted(saved[-1].glob("train_state_*.json"))] if saved else []
    together = status == 0 and len(saved) == 1 and len(steps) == procs and set(steps) == {int(saved[0].name)}
    return {"rank": rank, "delay_s": round(delay, 3), "exit": status, "steps": steps,
            "outcome": "together" if together else "apart"}


def main(argv: list[str]) -> None:
    options = dict(arg.split("=", 1) for arg in argv)
    trials, procs = int(options.get("trials", 200)), int(options.get("procs", 2))
    rng = random.Random(int(options.get("seed", 0)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        write_corpus(Path(tmp) / "data")
        for i in range(trials):
            result = trial(Path(tmp) / "data", Path(tmp) / f"run{i}", procs, rng)
            results.append(result)
            print(f"trial {i + 1}/{trials}: {result}", flush=True)
    together = sum(r["outcome"] == "together" for r in results)
    print(f"{together} of {trials} trials stopped every rank together "
          f"({sum(r['outcome'] == 'hung' for r in results)} hung)")
    if "out" in options:
        Path(options["out"]).write_text(json.dumps({"trials": trials, "together": together, "results": results}))


if __name__ == "__main__":
    main(sys.argv[1:])
