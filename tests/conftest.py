"""Shared fixtures: a tiny JSONL corpus in the training layout, tiny training configs, a small copy of the offline
evaluation data's layout, and helpers that run commands and clean up every process they start."""

import contextlib
import fcntl
import gzip
import importlib.util
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

# pytest-xdist runs a worker per core and one more (pytest_xdist_auto_num_workers), so each worker's torch, and the
# processes it starts, get their share of the cores (one thread each with -n auto): more threads would oversubscribe
# them, and a test that compares a run in this process with one in a child needs both on the same thread count. Set
# before anything imports torch.
# Transformers copies a folder's model code into a modules cache under the folder's name, so two workers loading
# exports of the same name would overwrite each other's code: each worker gets a cache of its own.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
MODULES_CACHE = None  # the one this process made, which it removes at its end
if WORKER is not None:
    share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, share))
    if f"hf-modules-{WORKER}-" not in os.environ.get("HF_MODULES_CACHE", ""):  # a test's process shares its worker's
        os.environ["HF_MODULES_CACHE"] = MODULES_CACHE = tempfile.mkdtemp(prefix=f"hf-modules-{WORKER}-")


def pytest_xdist_auto_num_workers(config):
    """-n auto: a worker per core and one more. Much of the suite waits (on SLURM, a rank's timeout, a lock) while
    its processes start or stop; a third worker on 2 cores kept them busy 1.78 of the time instead of 1.60 and ended
    15% sooner (docs/design.md). PYTEST_XDIST_AUTO_NUM_WORKERS still decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist reads it
    return len(os.sched_getaffinity(0)) + 1


def pytest_collection_modifyitems(items):
    """The files that hold a slow test run first: xdist hands out whole files in this order (pyproject.toml's
    --no-loadscope-reorder: by default it hands out the files with the most tests first), so the longest ones do not
    start last and leave one worker running alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within a file is kept


def pytest_unconfigure(config):
    if MODULES_CACHE is not None:
        shutil.rmtree(MODULES_CACHE, ignore_errors=True)


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


def write_shard(path: Path, rows: list, field: str = "text") -> None:
    """A shard as published, its format from its name (.jsonl, .jsonl.gz, .jsonl.zst, .parquet in row groups of 5);
    `rows`: texts, or None for a row without one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({field: rows, "id": list(range(len(rows)))}), path, row_group_size=5)
        return
    lines = b"".join(json.dumps({field: row} if row is not None else {"url": "x"}).encode() + b"\n" for row in rows)
    if path.name.endswith(".gz"):
        lines = gzip.compress(lines)
    elif path.name.endswith(".zst"):
        import zstandard

        lines = zstandard.ZstdCompressor().compress(lines)
    path.write_bytes(lines)


def write_published_corpus(corpus: Path, root: Path) -> Path:
    """The tiny corpus's training documents as a corpus is published: ROOT/dclm/global-shard_01/*.jsonl.zst and
    ROOT/fineweb/data/*.parquet, three shards each (the first of each is held out for validation)."""
    docs = [json.loads(line)["text"] for file in sorted((corpus / "tiny").glob("train.*.jsonl"))
            for line in file.read_text().splitlines()]
    for k in range(6):
        shard = docs[k::6]
        write_shard(root / "dclm" / "global-shard_01" / f"shard_{k:08d}.jsonl.zst" if k < 3 else
                    root / "fineweb" / "data" / f"{k - 3:03d}_00000.parquet", shard)
    return root


class Killed(BaseException):
    """The process dies here: no handler of the code under test runs (they catch Exception)."""


@contextlib.contextmanager
def killed_before(n: int, operations: list[tuple[object, str]]):
    """Counts the calls of `operations` ((module, function name) pairs) made inside; the n-th (from 1) is not made:
    Killed is raised instead, as if the process died there. Yields the count so far."""
    calls = [0]

    def counted(operation):
        def run(*args, **kwargs):
            calls[0] += 1
            if calls[0] == n:
                raise Killed
            return operation(*args, **kwargs)
        return run

    with pytest.MonkeyPatch.context() as patch:
        for module, name in operations:
            patch.setattr(module, name, counted(getattr(module, name)))
        yield calls


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


@pytest.fixture(scope="session")
def tiny_crossbert(tmp_path_factory) -> Path:
    """A tiny CrossBERT pre-trained for 6 steps on the tiny corpus (no validation): its checkpoints and consolidated.pt,
    trained once for the session. Tests start from it, evaluate and export it; a test that changes it copies it."""
    from apps.crossbert.train import APP as CROSSBERT
    from lingua.args import load_config
    from lingua.train import train

    root = tmp_path_factory.mktemp("tiny_crossbert")
    argv = tiny_argv(write_corpus(root / "data"), root / "crossbert", 6) + ["validation.every=0"]
    train(CROSSBERT, load_config(CROSSBERT.args_cls, argv))
    return root / "crossbert"


def read_metrics(dump_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's training records (those with a loss) by step."""
    records = [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


LONG_RUN_STEPS = 100  # long enough that a process killed after the first checkpoint (step 5) dies mid-training


def long_run_argv(data_root: Path, dump_dir: Path, steps: int = LONG_RUN_STEPS, *extra: str) -> list[str]:
    """tiny_argv with a checkpoint every 5 steps and validation every 20: the runs that are killed midway."""
    return [*tiny_argv(data_root, dump_dir, steps), "checkpoint.every=5", "validation.every=20", *extra]


@contextlib.contextmanager
def shared_by_workers(tmp_path_factory, name: str):
    """A folder of the session's temporary root that every pytest-xdist worker sees (with -n 0: the session's own),
    held under an exclusive lock while the block runs: the first worker to need it fills it, the others wait, then
    read it. What is computed there is computed once per session, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if WORKER is not None else base
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, by a killed worker too
        yield root / name


@pytest.fixture(scope="session")
def long_run_on_two_processes(tmp_path_factory) -> dict[int, dict]:
    """metrics.jsonl's training records of long_run_argv's BERT run on the tiny corpus, uninterrupted, on two
    processes of one machine (`torchrun --standalone`), run once for the session: what a run killed midway (a worker,
    a node) and resumed must log, step for step."""
    with shared_by_workers(tmp_path_factory, "long_run") as root:
        done = root / "done"
        if not done.exists():  # the first worker here, or the next after one whose run failed
            shutil.rmtree(root, ignore_errors=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                   "apps.bert.train", *long_run_argv(write_corpus(root / "data"), root / "run")]
            result = run_to_the_end(cmd)
            assert result.returncode == 0, result.stderr[-3000:]
            done.touch()
        return read_metrics(root / "run")


def load_setup_script(name: str):
    """Imports setup/NAME.py (a script folder, not a package)."""
    path = Path(__file__).resolve().parents[1] / "setup" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"setup_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
TAG = "LINGUA_TEST_PROCESS_TAG"


def start(cmd: list, env: dict | None = None, **kwargs) -> subprocess.Popen:
    """A command in its own session, its environment tagged so that `end` finds every process it started, also
    those that left its session (torchrun starts each worker in a session of its own)."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, cwd=REPO, env={**(env or ENV), TAG: tag}, text=True, start_new_session=True,
                            **kwargs)
    proc.tag = tag
    return proc


def tagged_processes(tag: str) -> list[int]:
    """The live processes that inherited `tag` from a command `start` ran."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if f"{TAG}={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def end(proc: subprocess.Popen) -> None:
    """Kills the command and every process it started, and waits until each has exited (a dying process stops
    showing its environment before it is gone)."""
    deadline, killed = time.time() + 30, set()
    while time.time() < deadline:
        tagged = tagged_processes(proc.tag)
        for pid in tagged:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(tagged)
        if not tagged and not any(running(pid) for pid in killed):
            break
        time.sleep(0.05)
    proc.wait()


def run_to_the_end(cmd: list, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs a command to its end (or kills it and all it started after `timeout` seconds); its output."""
    proc = start(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        end(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def kill_after_first_checkpoint_then_restart(module: str, argv: list[str], dump_dir: Path) -> None:
    """Runs `python -m module argv`, SIGKILLs it once a checkpoint past step 5 is complete, then runs it again to
    the end. The first run must still be training when it is killed: one that ended first proves nothing (and a
    checkpoint looked for by name could be pruned before it is seen)."""
    cmd, env = [sys.executable, "-m", module, *argv], {**os.environ, "PYTHONPATH": str(REPO)}
    proc = start(cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not _checkpoints_past(dump_dir, 5):
            time.sleep(0.05)
        killed_while_training = proc.poll() is None and _checkpoints_past(dump_dir, 5)
    finally:
        end(proc)
    assert killed_while_training, f"{module} had ended (status {proc.returncode}) or saved no checkpoint past step 5"
    done = run_to_the_end(cmd, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


def _checkpoints_past(dump_dir: Path, step: int) -> list[Path]:
    """The run's complete checkpoints (folders named by their step: partial ones have a suffix) after `step`."""
    return [p for p in (dump_dir / "checkpoints").glob("*") if p.name.isdigit() and int(p.name) > step]


def offline_data(root: Path) -> Path:
    """The layout of ../shared/data, small: the GLUE fixtures, a BEIR folder and an STS Benchmark test file."""
    shutil.copytree(REPO / "tests" / "fixtures" / "glue", root / "glue")
    beir = root / "retrieval" / "scifact"
    (beir / "qrels").mkdir(parents=True)
    topics = ["cats sleep on warm mats", "rivers flow into the sea", "chess openings and endgames",
              "birds migrate south in winter", "volcanoes erupt molten rock", "bees make honey from nectar"]
    docs = [{"_id": f"d{i}", "title": f"Doc {i}", "text": f"{topic}, as studies show"} for i, topic in
            enumerate(topics * 3)]
    (beir / "corpus.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    queries = [{"_id": f"q{i}", "text": f"do {topics[i % 6]}?"} for i in range(12)]
    (beir / "queries.jsonl").write_text("\n".join(json.dumps(q) for q in queries) + "\n")
    for split, ids in (("train", range(0, 8)), ("test", range(8, 12))):
        rows = [f"q{i}\td{i % 6}\t1" for i in ids]
        (beir / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(rows) + "\n")
    sts = root / "retrieval" / "sts"
    sts.mkdir(parents=True)
    pairs = [(t, t, 5.0) for t in topics] + [(a, b, 1.0) for a, b in zip(topics, topics[1:] + topics[:1])]
    (sts / "sts-test.csv").write_text("".join(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{s:.3f}\t{a}\t{b}\n"
                                              for i, (a, b, s) in enumerate(pairs)))
    return root


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real SLURM cluster for the session (tests/slurm_cluster.py: nodes n1 and n2, 2 GPUs each, accounting);
    os.environ's SLURM_CONF names it while it runs, so that in-process code (submitit) reaches it. Without root or
    the binaries the tests that use it are skipped, except under CI=true, where they fail: CI must run them."""
    from tests.slurm_cluster import TAG, start_cluster, unavailable

    reason = unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = start_cluster()
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("SLURM_")]:
            patch.delenv(key)  # pytest itself may run inside a SLURM job
        patch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        patch.setenv(TAG, cluster.env[TAG])
        try:
            yield cluster
        finally:
            cluster.stop()
