"""The acceptance run for a GPU machine: one command, budgeted at 8 minutes of a cold H100 or H200 (the sum of the
parts' budgets, BUDGETS_S; no GPU has run it yet), one JSON and one Markdown report.

    bash scripts/gpu_acceptance.sh OUT_DIR [--bundle FOLDER]     # on the GPU machine
    bash scripts/gpu_acceptance.sh OUT_DIR --dry-run             # anywhere: tiny shapes, the same code paths, CPU
    bash scripts/gpu_acceptance.sh --prepare FOLDER              # here: what must travel to a machine without network

Parts, each in its own process with its own time budget, sharing one Inductor cache (a later part reuses an earlier
one's compiles); the reports are rewritten after every part, and a part leaves its results as it goes, so a part cut
at its budget (with every process it started) keeps what it had measured and the parts after it still run:
1. environment: GPU, memory, torch and CUDA versions, the measured bf16 matmul rate and copy bandwidth (ceilings);
2. tests: tests/test_gpu_paths.py and tests/test_compile.py (on a GPU: the attention backends in bf16, the step
   without host synchronisation, compiled steps; on a CPU their CPU halves);
3. benchmark: `tools.benchmark preset=paper` for BERT, CrossBERT and ELECTRA one after the other, each at its
   single-scale batch (96, 48, 96 sequences) and as it trains (bf16, FSDP2-wrapped, compiled per block): token-views/s,
   MFU (heads counted and not), peak memory, CrossBERT's speed-up against the paper's 1.68x;
4. profile: where one compiled step of each goes, at the benchmark's shapes: head+loss, attention, mlp, optimizer,
   data/copy, communication, the compiled blocks' other kernels and the rest, with the step time;
5. training: single-scale CrossBERT (with a resume check) and BERT under `torchrun --nproc-per-node 1` (FSDP2,
   compile) on a generated corpus: the loss falls, recompilations are counted, the checkpoint of the middle step is
   resumed and the steps after it are compared with the uninterrupted run; tokens/s, MFU, data wait and peak memory
   from each run's metrics.jsonl;
6. glue: the frozen GLUE probes of the CrossBERT run on RTE, timed;
7. document_mask: a few steps of that CrossBERT with data.document_mask=true on the flex backend (the block mask built
   from the documents, compiled); flex has no backward on a CPU, where the dry run takes sdpa's dense mask.
`--prepare` gathers the wheels of the packages the GPU image lacks (submitit, pytest-xdist), the GPT-2 BPE file and
RTE from ../shared/data/glue into FOLDER (git-ignored; name it in the device call's `carry`) and prints its size.
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a script, run from anywhere: the library beside it
from lingua.run_folder import RunFolder  # noqa: E402  (the standard library only: --prepare needs nothing else)

PAPER_SPEEDUP = 1.68  # Table 3: 207k vs 123k tokens/s on H100
TARGETS = {"mfu_with_head": 0.40, "crossbert_speedup": 1.49}  # issue targets: benchmarks, not pass/fail of the run
# Seconds per part on a cold H100/H200, 480 in all; compiles dominate: Inductor builds each app's blocks once in the
# benchmark, which the profile and the training reuse through the shared cache.
BUDGETS_S = {"environment": 20, "tests": 60, "benchmark": 110, "profile": 50, "training": 150, "glue": 30,
             "document_mask": 60}
DRY_BUDGETS_S = {"environment": 30, "tests": 120, "benchmark": 120, "profile": 60, "training": 240, "glue": 90,
                 "document_mask": 90}
APPS = ("bert", "crossbert", "electra")
# pure Python, missing on the GPU image (KINDS.md); pytest-xdist because pyproject.toml's pytest options name it
WHEELS = ["submitit==1.5.4", "pytest-xdist==3.8.0", "execnet==2.1.2"]
WORDS = ("the a cat dog sat on mat ran to park red blue green big small house tree river stone bird sang under over "
         "quickly slowly happy tall old young and then after before").split()


# ------------------------------------------------------------------------------------------------------ parts


def environment(work: Path, dry_run: bool) -> dict:
    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    n = 512 if dry_run or device == "cpu" else 8192
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    info["matmul_tflops"] = 2 * n**3 / _timed(lambda: a @ b, device) / 1e12
    info["matmul_shape_dtype"] = f"{n}x{n}x{n} {str(dtype).removeprefix('torch.')}"
    size = 2**24 if dry_run or device == "cpu" else 2**30
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    info["copy_gb_per_s"] = 2 * size / _timed(lambda: dst.copy_(src), device) / 1e9  # bytes read and written
    return info


def _timed(fn, device: str, warmup: int = 3, repeats: int = 10) -> float:
    import torch

    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def tests(work: Path, dry_run: bool) -> dict:
    report = work / "tests.xml"
    selection = ["tests/test_gpu_paths.py", "tests/test_compile.py"]
    if dry_run:
        selection = ["tests/test_gpu_paths.py", "-k", "bert and not crossbert or electra or chunked"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           f"--junitxml={report}", *selection], cwd=REPO, capture_output=True, text=True)
    counts = _junit_counts(report)
    (work / "tests.log").write_text(done.stdout[-20000:] + done.stderr[-5000:])
    if done.returncode and not counts.get("failures") and not counts.get("errors"):
        raise RuntimeError(f"pytest exited with {done.returncode}: {done.stdout.strip().splitlines()[-1:]}")
    return {"selection": " ".join(selection), **counts, "passed_all": done.returncode == 0}


def _junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def benchmark(work: Path, dry_run: bool) -> dict:
    """Each app in turn, its numbers left in the part's results as soon as they are measured."""
    import torch

    from tools.benchmark import measure, parse_args

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"apps": {}}
    with _one_rank_group(device):
        for app in APPS:
            torch._dynamo.reset()  # each app compiled as its own training process would: static shapes, no recompile
            timing = ["warmup=1", "steps=1", "rounds=1"] if dry_run else ["warmup=3", "steps=5", "rounds=2"]
            report = measure(parse_args([f"apps={app}", *_benchmark_shape(app, dry_run), *timing]))
            r, peak = report["results"][app], report["peak_tflops"]
            result.update(device=report["device"], torch=report["torch"])
            result["apps"][app] = {
                "batch_size": report["args"]["batch_size"], "token_views_per_s": r["token_views_per_s"],
                "data_tokens_per_s": r["data_tokens_per_s"], "mfu_with_head": r["mfu"],
                "mfu_paper": r["flops_per_step_paper"] / (r["step_ms"] / 1e3) / (peak * 1e12) if peak else None,
                "peak_memory_gib": r["peak_memory_gib"],
                "flops_per_token_view_with_head": r["flops_per_token_view_with_head"]}
            _leave(work, "benchmark", result)
    apps = result["apps"]
    for r in apps.values():
        r["speedup_vs_bert"] = r["token_views_per_s"] / apps["bert"]["token_views_per_s"]
        r["predicted_with_head"] = apps["bert"]["flops_per_token_view_with_head"] / r["flops_per_token_view_with_head"]
    crossbert = apps["crossbert"]["speedup_vs_bert"]
    return {**result, "crossbert_speedup": crossbert, "of_paper_speedup": crossbert / PAPER_SPEEDUP,
            "targets": {"mfu_with_head >= 40% (bert, crossbert)": all(
                (apps[a]["mfu_with_head"] or 0) >= TARGETS["mfu_with_head"] for a in ("bert", "crossbert")),
                "crossbert speed-up >= 1.49x": crossbert >= TARGETS["crossbert_speedup"]}}


def _benchmark_shape(app: str, dry_run: bool) -> list[str]:
    """tools.benchmark's keys for the app as it trains: its single-scale batch, compiled per block (FSDP2 and bf16
    come with the process group and the GPU). The dry run keeps the debug shapes, uncompiled."""
    if dry_run:
        return ["preset=debug"]
    from lingua.files import untrusted

    config = untrusted.read_yaml(REPO / "apps" / app / "configs" / "single_scale.yaml", "config file")
    return ["preset=paper", "compile=true", f"batch_size={config['data']['batch_size']}"]


@contextlib.contextmanager
def _one_rank_group(device):
    """A process group of this process alone: models are then FSDP2-wrapped as in training (with bf16 parameters on
    a GPU), which shards only where a group exists."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


LABELS = ("head+loss", "attention", "mlp", "optimizer", "data/copy")  # record_function ranges in the library
REGIONS = (*LABELS, "communication", "compiled blocks, other", "other")
# FSDP's ranges hold its collectives and the copies into and out of their buffers
COMMUNICATION = ("nccl", "all_gather", "allgather", "reduce_scatter", "reducescatter", "all_reduce", "allreduce",
                 "fsdp::")
HEAD_OPS = ("linearcrossentropy", "cross_entropy", "log_softmax", "logsumexp")  # the loss, also where unlabelled
ATTENTION_KERNELS = ("attention", "flash", "fmha", "sdpa")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
OPTIMIZER_OPS = ("optimizer.step", "adam", "_foreach")
COMPILED = ("CompiledFunction", "CompiledFunctionBackward")  # AOT autograd's forward and backward of a graph


def profile(work: Path, dry_run: bool) -> dict:
    """Where one compiled training step's time goes, per app, at the benchmark's shapes: each GPU kernel's time,
    counted once under the op that launched it (on a CPU each op's self time), in its region."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiled

    from lingua.model.transformer import ffn_hidden_dim
    from tools.benchmark import build, parse_args, step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # The dry run compiles with aot_eager (Inductor's CPU code already runs in the training part) and 3 sequences,
    # a row count that differs from the debug width's SwiGLU width (256), which tells the MLP's matmuls apart.
    dry = ["compile=true", "compile_backend=aot_eager", "batch_size=3", "warmup=1"] if dry_run else ["warmup=2"]
    result = {"measured": "GPU kernel time" if device.type == "cuda" else "CPU operator self time", "apps": {}}
    with _one_rank_group(device):
        for app in APPS:
            torch._dynamo.reset()  # as in the benchmark
            args = parse_args([f"apps={app}", *_benchmark_shape(app, dry_run), *dry])
            contender = build(app, args, device)
            step_ms = 1e3 * statistics.median(step(contender, args, device) for _ in range(1 if dry_run else 3))
            with profiled(activities=activities, record_shapes=True) as prof:
                step(contender, args, device)
            hidden = ffn_hidden_dim(args.encoder.dim, args.encoder.ffn_multiple_of)
            times = region_times(prof.events(), device.type == "cuda", args.vocab_size, hidden)
            total = sum(times.values()) or 1.0
            result["apps"][app] = {"step_ms": step_ms, "profiled_ms": total / 1e3,
                                   "shares": {region: spent / total for region, spent in times.items()}}
            _leave(work, "profile", result)
            del contender, prof
    return result


def region_times(events, on_device: bool, vocab_size: int, ffn_hidden: int) -> dict[str, float]:
    """Microseconds per region: each event's own time (on a GPU the kernels it launched: a kernel is also listed on
    its own and within every op above it, so counting those would count it twice) in the region of the innermost
    event that names one (`_named_region`); backward work takes the region of the forward op it differentiates
    (autograd's sequence number). Inductor drops ranges inside a compiled graph: there the shapes and kernel names
    decide, and what they leave is the compiled blocks' other work (norms, RoPE, element-wise)."""
    forward: dict[int, str] = {}

    def region(event) -> str:
        compiled, node = False, event
        while node is not None:
            found = _named_region(node, forward, vocab_size, ffn_hidden)
            if found:
                return found
            compiled = compiled or node.name in COMPILED
            node = node.cpu_parent
        return "compiled blocks, other" if compiled else "other"

    events = [event for event in events if event.device_type.name == "CPU" and not event.is_async]
    for event in events:
        if event.sequence_nr >= 0 and event.sequence_nr not in forward \
                and not event.name.startswith("autograd::engine::evaluate_function"):
            forward[event.sequence_nr] = region(event)
    times = dict.fromkeys(REGIONS, 0.0)
    for event in events:
        if on_device:
            for kernel in event.kernels:
                lowered = kernel.name.lower()
                by_name = "communication" if any(key in lowered for key in COMMUNICATION) else \
                    "attention" if any(key in lowered for key in ATTENTION_KERNELS) else None
                times[by_name or region(event)] += kernel.duration
        elif event.self_cpu_time_total:
            times[region(event)] += event.self_cpu_time_total
    return times


def _named_region(event, forward: dict[int, str], vocab_size: int, ffn_hidden: int) -> str | None:
    """The region an event names by itself: communication, a profiler range of the library, the loss, a backward
    node (its forward op's region), attention kernels, a matmul by its shapes (the vocabulary: the head; the SwiGLU
    width: the MLP; else the attention's projections), the optimizer's step."""
    name = event.name
    lowered = name.lower()
    if any(key in lowered for key in COMMUNICATION):
        return "communication"
    if name in LABELS:
        return name
    if any(key in lowered for key in HEAD_OPS):
        return "head+loss"
    if name.startswith("autograd::engine::evaluate_function"):
        return forward.get(event.sequence_nr)
    if any(key in lowered for key in ATTENTION_KERNELS):
        return "attention"
    if name in MATMULS:
        dims = {d for shape in event.input_shapes if isinstance(shape, list) for d in shape if isinstance(d, int)}
        return "head+loss" if vocab_size in dims else "mlp" if ffn_hidden in dims else "attention"
    if any(key in lowered for key in OPTIMIZER_OPS):
        return "optimizer"
    return None


def training(work: Path, dry_run: bool) -> dict:
    """CrossBERT, then BERT (no resume for it; in the dry run a few steps, uncompiled), as their single-scale configs
    train them; the results are left after each run."""
    corpus, full, resumed, bert = work / "corpus", work / "run", work / "resumed", work / "bert"
    for folder in (corpus, full, resumed, bert):
        shutil.rmtree(folder, ignore_errors=True)
    write_corpus(corpus, 4000 if dry_run else 40000)
    steps, every = (16, 8) if dry_run else (60, 30)
    command = _training_command("crossbert", corpus, dry_run, steps, every)
    env = {**os.environ, "TORCH_LOGS": "recompiles"}
    start = time.perf_counter()
    log = _run([*command, f"dump_dir={full}"], work / "training.log", env)
    seconds = time.perf_counter() - start
    losses = _losses(full)
    after_first_step = log[log.index(f"step 1/{steps} |"):]  # the blocks' first compilations are done by then
    result = {"steps": steps, "seconds": seconds, "first_loss": losses[1], "last_loss": losses[steps],
              "loss_falls": losses[steps] < 0.95 * losses[1],
              "recompilations_after_step_1": after_first_step.count("Recompiling function"), "dump_dir": str(full),
              "apps": {"crossbert": _throughput(full)}}
    _leave(work, "training", result)
    source, target = RunFolder(full), RunFolder(resumed)
    middle = f"{every:010d}"  # the run as it was at the middle step: resumed from there
    shutil.copytree(source.checkpoints / middle, target.checkpoints / middle)
    shutil.copy(source.config, target.config)
    shutil.copy(source.metrics, target.metrics)
    _run([*command, f"dump_dir={resumed}"], work / "resumed.log", env)
    again = _losses(resumed)
    differences = [abs(again[s] - losses[s]) / abs(losses[s]) for s in range(every + 1, steps + 1)]
    result.update(resumed_at=every, resume_max_relative_difference=max(differences),
                  resume_identical=max(differences) == 0.0)
    _leave(work, "training", result)
    bert_steps = 2 if dry_run else 30
    _run([*_training_command("bert", corpus, dry_run, bert_steps, bert_steps, compile=not dry_run),
          f"dump_dir={bert}"], work / "bert_training.log")
    result["apps"]["bert"] = _throughput(bert)
    return result


def _throughput(dump: Path) -> dict:
    """The run's rates from metrics.jsonl, medians over its second half (past the compiles), and its peak memory."""
    records = [r for r in _records(dump) if "loss" in r]
    later = records[len(records) // 2:]
    rates = {key: statistics.median(r[key] for r in later) if all(r.get(key) is not None for r in later) else None
             for key in ("data_tokens_per_s", "token_views_per_s", "mfu", "mfu_hw", "data_wait")}
    return {**rates, "peak_memory_gib": max(r.get("memory_gib") or 0.0 for r in records)}


def _training_command(app: str, corpus: Path, dry_run: bool, steps: int, every: int, compile: bool = True) -> list[str]:
    """The command that trains the app's single-scale config (tiny in a dry run) on `corpus` under `torchrun
    --nproc-per-node 1` (FSDP2, compile); `dump_dir=` and other keys follow."""
    predictor = ["model.predictor.dim=64", "model.predictor.n_layers=1", "model.predictor.n_heads=4"]
    shape = (["model.encoder.dim=64", "model.encoder.n_layers=2", "model.encoder.n_heads=4", "data.seq_len=64",
              "model.encoder.max_seqlen=64", "data.batch_size=4", "optim.lr=1e-3", "optim.warmup=5",
              *(predictor if app == "crossbert" else [])] if dry_run
             else ["optim.warmup=20"])  # the paper's shapes, batch sizes and learning rate (6e-4)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m",
            f"apps.{app}.train", f"config={REPO / 'apps' / app / 'configs' / 'single_scale.yaml'}",
            f"data.root_dir={corpus}", "data.sources={tiny: 1.0}", f"steps={steps}", f"checkpoint.every={every}",
            "logging.freq=1", "validation.every=0", f"distributed.compile={str(compile).lower()}", *shape]


def document_mask(work: Path, dry_run: bool) -> dict:
    """A few steps of the training part's CrossBERT, each token attending only to its own document: on a GPU on the
    compiled flex backend, whose block mask skips the blocks of other documents and views. Flex has no backward on a
    CPU, where the dry run takes sdpa's dense mask, uncompiled (Inductor would take 30 s of the tests' CPU for a path
    no GPU runs). The loop stops on a non-finite loss, which fails the part."""
    import torch

    corpus, run = work / "documents_corpus", work / "documents"
    for folder in (corpus, run):
        shutil.rmtree(folder, ignore_errors=True)
    write_corpus(corpus, 1000)
    gpu, steps = torch.cuda.is_available(), 5
    backend = "flex" if gpu else "sdpa"
    start = time.perf_counter()
    _run([*_training_command("crossbert", corpus, dry_run, steps, steps, compile=gpu), f"dump_dir={run}",
          "data.document_mask=true", f"model.encoder.attn_backend={backend}",
          "distributed.activation_checkpointing=selective"] + ([] if dry_run else ["data.batch_size=16"]),
         work / "document_mask.log")
    losses = _losses(run)
    return {"backend": backend, "steps": steps, "seconds": time.perf_counter() - start, "first_loss": losses[1],
            "last_loss": losses[steps]}


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in RunFolder(dump).metrics.read_text().splitlines()]


def _losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(dump) if "loss" in r}


def write_corpus(root: Path, n_docs: int) -> None:
    """ROOT/tiny/: documents of short sentences with a learnable structure (the tests' corpus, larger)."""
    rng, source = random.Random(0), root / "tiny"
    source.mkdir(parents=True)

    def doc() -> str:
        return " ".join(f"the {rng.choice(WORDS[2:10])} {rng.choice(WORDS[10:18])} the {rng.choice(WORDS[18:])}."
                        for _ in range(rng.randint(4, 40)))

    (source / "train.00000.jsonl").write_text("".join(json.dumps({"text": doc()}) + "\n" for _ in range(n_docs)))
    (source / "valid.jsonl").write_text("".join(json.dumps({"text": doc()}) + "\n" for _ in range(200)))


def glue(work: Path, dry_run: bool) -> dict:
    data = _bundle_glue() or REPO / "tests" / "fixtures" / "glue"
    start = time.perf_counter()
    _run([sys.executable, "-m", "tools.eval.glue", f"ckpt={work / 'run'}", f"data={data}", "tasks=rte",
          "probes=linear,knn", f"out={work / 'glue.json'}"], work / "glue.log")
    results = json.loads((work / "glue.json").read_text())
    return {"data": str(data), "seconds": time.perf_counter() - start,
            "rte": results["summary"]["last"]["linear"].get("rte"),
            "rte_knn": results["summary"]["last"]["knn"].get("rte")}


def _bundle_glue() -> Path | None:
    folder = os.environ.get("LINGUA_ACCEPTANCE_GLUE")
    return Path(folder) if folder and (Path(folder) / "RTE").is_dir() else None


def _leave(work: Path, part: str, result: dict) -> None:
    """What the part has measured so far, where the run finds it if the part is cut or fails."""
    (work / f"part_{part}.json").write_text(json.dumps(result))


def _run(cmd: list[str], log: Path, env: dict | None = None) -> str:
    """Its output and errors in the order they came (the workers write unbuffered)."""
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    text = done.stdout
    log.write_text(text[-200000:])
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with {done.returncode}: "
                           f"{(text.strip().splitlines() or [''])[-1][:300]}")
    return text


PARTS = {"environment": environment, "tests": tests, "benchmark": benchmark, "profile": profile, "training": training,
         "glue": glue, "document_mask": document_mask}
LOGS = ("tests.log", "training.log", "bert_training.log", "glue.json", "document_mask.log")  # copied beside the reports


# ------------------------------------------------------------------------------------------------ the run


def run_all(out: Path, dry_run: bool, bundle: Path | None) -> dict:
    """The parts work in a scratch folder (runs, checkpoints, corpus); `out` receives the reports and a few logs,
    few and small enough to come back from a device machine."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="acceptance_"))
    # One Inductor cache for every part's processes (torchrun's workers included): the environment's, else torch's
    # default folder, which a later run on the same machine reuses too.
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(Path(tempfile.gettempdir()) / f"torchinductor_{_user()}")
    env = {**os.environ, **_bundle_env(bundle), "TORCHINDUCTOR_CACHE_DIR": cache}
    report = {"dry_run": dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "inductor_cache": cache,
              "parts": {}}
    budgets = DRY_BUDGETS_S if dry_run else BUDGETS_S
    for name in PARTS:
        if name == "glue" and report["parts"]["training"]["status"] != "passed":
            report["parts"][name] = {"status": "skipped", "reason": "the training part gave no checkpoint"}
            continue
        report["parts"][name] = run_part(name, work, dry_run, budgets[name], env)
        print(f"{name}: {report['parts'][name]['status']} ({report['parts'][name].get('seconds', 0):.0f} s)",
              flush=True)
        write_reports(report, out)
    report["passed"] = all(part["status"] == "passed" for part in report["parts"].values())
    write_reports(report, out)
    for name in LOGS:
        if (work / name).exists():
            shutil.copy(work / name, out / name)
    shutil.rmtree(work, ignore_errors=True)
    return report


def run_part(name: str, work: Path, dry_run: bool, budget_s: int, env: dict) -> dict:
    """The part in a process of its own, working in `work`, cut at its budget (with every process it started)."""
    result_file = work / f"part_{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--part", name, str(work)] + (["--dry-run"] if dry_run else [])
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        return {"status": "cut", "budget_s": budget_s, "seconds": time.perf_counter() - start,
                "reason": f"ran over its budget of {budget_s} s", **_left(result_file)}
    seconds = time.perf_counter() - start
    if proc.returncode:
        last = (output.strip().splitlines() or [""])[-1]
        return {"status": "failed", "budget_s": budget_s, "seconds": seconds, "reason": last[:500],
                **_left(result_file)}
    return {"status": "passed", "budget_s": budget_s, "seconds": seconds, **json.loads(result_file.read_text())}


def _left(result_file: Path) -> dict:
    """The results a cut or failed part had left, under their own key (the reports read a passed part's only)."""
    return {"partial": json.loads(result_file.read_text())} if result_file.exists() else {}


def _user() -> str:
    """As torch names its default cache folder."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid_{os.getuid()}"


def _kill_session(proc: subprocess.Popen) -> None:
    """The part and what it started: torchrun's workers run in sessions of their own, found by their parent."""
    import signal

    pids = [proc.pid]
    for pid in pids:  # grows while walking: children of children
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        pids += [int(child) for child in children]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _bundle_env(bundle: Path | None) -> dict:
    """The bundle's wheels installed into a temporary folder put on PYTHONPATH, its tokenizer file and GLUE data."""
    if bundle is None:
        return {}
    env = {}
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    if wheels:
        site = Path(tempfile.mkdtemp(prefix="acceptance_site_"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", str(site), *map(str, wheels)], check=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    if (bundle / "tokenizer").is_dir():
        env["LINGUA_TOKENIZER_DIR"] = str(bundle / "tokenizer")
    if (bundle / "glue").is_dir():
        env["LINGUA_ACCEPTANCE_GLUE"] = str(bundle / "glue")
    return env


def write_reports(report: dict, out: Path) -> None:
    (out / "acceptance.json").write_text(json.dumps(report, indent=1))
    (out / "acceptance.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    parts = report["parts"]
    lines = [f"# GPU acceptance{' (dry run)' if report['dry_run'] else ''}, {report['started']}", "",
             "| part | status | seconds | budget | notes |", "|---|---|---|---|---|"]
    for name, part in parts.items():
        notes = part.get("reason", "") or _notes(name, part)
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', 0):.0f} | {part.get('budget_s', '-')} | "
                     f"{notes} |")
    bench = _measured(parts.get("benchmark", {}))
    if bench.get("apps"):
        lines += ["", f"Benchmark on {bench['device']} (torch {bench['torch']}), each app at its batch:", "",
                  "| app | batch | token-views/s | data tokens/s | MFU (+heads) | MFU (paper's FLOPs) | peak GiB | "
                  "vs BERT |", "|---|---|---|---|---|---|---|---|"]
        for app, r in bench["apps"].items():
            speedup = f"{r['speedup_vs_bert']:.2f}x" if "speedup_vs_bert" in r else "n/a"
            lines.append(f"| {app} | {r['batch_size']} | {r['token_views_per_s']:,.0f} | {r['data_tokens_per_s']:,.0f} "
                         f"| {_percent(r['mfu_with_head'])} | {_percent(r['mfu_paper'])} | "
                         f"{_number(r['peak_memory_gib'])} | {speedup} |")
    if "crossbert_speedup" in bench:
        lines.append(f"\nCrossBERT's speed-up: {bench['crossbert_speedup']:.2f}x, {bench['of_paper_speedup']:.0%} of "
                     f"the paper's {PAPER_SPEEDUP}x; targets: " + ", ".join(
                         f"{name} {'met' if met else 'missed'}" for name, met in bench["targets"].items()))
    prof = _measured(parts.get("profile", {}))
    if prof.get("apps"):
        lines += ["", f"Where a compiled step's time goes ({prof['measured']}, one step per app):", "",
                  "| app | step ms | " + " | ".join(REGIONS) + " |", "|---" * (len(REGIONS) + 2) + "|"]
        lines += [f"| {app} | {r['step_ms']:,.1f} | " + " | ".join(f"{r['shares'][c]:.0%}" for c in REGIONS) + " |"
                  for app, r in prof["apps"].items()]
    training = _measured(parts.get("training", {}))
    if training.get("apps"):
        lines += ["", "Training (metrics.jsonl, medians over the second half of each run):", "",
                  "| app | data tokens/s | token-views/s | mfu | mfu_hw | data wait | peak GiB |", "|---" * 7 + "|"]
        lines += [f"| {app} | {_count(r['data_tokens_per_s'])} | {_count(r['token_views_per_s'])} | "
                  f"{_percent(r['mfu'])} | {_percent(r['mfu_hw'])} | {_percent(r['data_wait'])} | "
                  f"{_number(r['peak_memory_gib'])} |" for app, r in training["apps"].items()]
    return "\n".join(lines) + "\n"


def _measured(part: dict) -> dict:
    """A part's results: all of them if it passed, what it had left if it was cut or failed."""
    return part if part.get("status") == "passed" else part.get("partial", {})


def _notes(name: str, part: dict) -> str:
    if part["status"] != "passed":
        return ""
    if name == "environment":
        return (f"{part['gpu'] or 'no GPU'}, torch {part['torch']}, CUDA {part['cuda']}; matmul "
                f"{part['matmul_tflops']:.1f} TFLOP/s ({part['matmul_shape_dtype']}), copy "
                f"{part['copy_gb_per_s']:.0f} GB/s")
    if name == "tests":
        return f"{part['tests']} tests, {part['failures']} failed, {part['errors']} errors, {part['skipped']} skipped"
    if name == "training":
        return (f"CrossBERT loss {part['first_loss']:.2f} -> {part['last_loss']:.2f} in {part['steps']} steps "
                f"({part['seconds']:.0f} s); {part['recompilations_after_step_1']} recompilation(s) after step 1; "
                f"resumed at step "
                f"{part['resumed_at']}: max relative loss difference {part['resume_max_relative_difference']:.1e}")
    if name == "glue":
        return f"RTE linear {_number(part['rte'])}, kNN {_number(part['rte_knn'])} in {part['seconds']:.0f} s"
    if name == "document_mask":
        return (f"{part['backend']}: loss {part['first_loss']:.2f} -> {part['last_loss']:.2f} in {part['steps']} steps "
                f"({part['seconds']:.0f} s)")
    return ""


def _percent(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _number(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _count(value) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


# ------------------------------------------------------------------------------------------------ prepare


def prepare(folder: Path) -> int:
    """What must travel to a GPU machine without network; returns its size in bytes."""
    from lingua.data.tokenizer import default_tokenizer_dir

    (folder / "wheels").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux2014_x86_64", "-d", str(folder / "wheels"), *WHEELS], check=True)
    bpe = default_tokenizer_dir() / "r50k_base.tiktoken"
    if not bpe.exists():
        raise SystemExit(f"error: {bpe} is missing: run python setup/fetch_tokenizer.py first")
    (folder / "tokenizer").mkdir(exist_ok=True)
    shutil.copy(bpe, folder / "tokenizer" / bpe.name)
    rte = REPO.parent / "shared" / "data" / "glue" / "RTE"
    if rte.is_dir():
        shutil.copytree(rte, folder / "glue" / "RTE", dirs_exist_ok=True)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="the folder of the reports")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, the same code paths; runs on a CPU")
    parser.add_argument("--bundle", help="a folder --prepare wrote (wheels, tokenizer file, GLUE data)")
    parser.add_argument("--prepare", metavar="FOLDER", help="gather what must travel, print its size, and stop")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one part, in its own process
    args = parser.parse_args(argv)
    if args.prepare:
        size = prepare(Path(args.prepare))
        print(f"{args.prepare}: {size / 2**20:.1f} MiB (the working tree and carried paths may hold 64 MiB)")
        return
    if not args.out:
        parser.error("the reports' folder is required")
    if args.part:
        result = PARTS[args.part](Path(args.out), args.dry_run)
        (Path(args.out) / f"part_{args.part}.json").write_text(json.dumps(result))
        return
    report = run_all(Path(args.out), args.dry_run, Path(args.bundle) if args.bundle else None)
    print(f"reports: {Path(args.out) / 'acceptance.md'}, {Path(args.out) / 'acceptance.json'}")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
