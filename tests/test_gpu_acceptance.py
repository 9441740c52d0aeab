"""The GPU acceptance script (scripts/gpu_acceptance.sh) as CI can run it: its dry run (tiny shapes, the same code
paths, on the CPU) passes every part and writes both reports; the reports hold each part as soon as it ends; a part
that runs over its budget is cut and reported with what it had measured, with the processes it started; the profile
names the regions of a step; --prepare gathers what travels to a machine without network."""

import importlib.util
import json
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_to_the_end, tagged_processes

from lingua.data.tokenizer import default_tokenizer_dir

PARTS = ["environment", "tests", "benchmark", "profile", "training", "glue", "document_mask"]


def acceptance_module():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", REPO / "scripts" / "gpu_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.skipif(not (default_tokenizer_dir() / "r50k_base.tiktoken").exists(),
                    reason="run setup/install.sh first (the tokenizer file)")
def test_the_dry_run_passes_every_part_and_writes_both_reports(tmp_path):
    out = tmp_path / "report"
    done = run_to_the_end(["bash", "scripts/gpu_acceptance.sh", str(out), "--dry-run"], timeout=900)
    report = json.loads((out / "acceptance.json").read_text())
    assert done.returncode == 0 and report["passed"], done.stdout[-3000:] + json.dumps(report["parts"], indent=1)
    assert list(report["parts"]) == PARTS and all(part["status"] == "passed" for part in report["parts"].values())
    training = report["parts"]["training"]
    assert training["loss_falls"] and training["resume_identical"]  # on the CPU the resumed steps are bit-identical
    assert training["recompilations_after_step_1"] == 0
    assert set(report["parts"]["benchmark"]["apps"]) == {"bert", "crossbert", "electra"}
    assert set(training["apps"]) == {"crossbert", "bert"} and training["apps"]["bert"]["data_tokens_per_s"] > 0
    for app, profiled in report["parts"]["profile"]["apps"].items():  # compiled steps, their blocks split by shapes
        assert all(profiled["shares"][region] > 0 for region in ("head+loss", "attention", "mlp", "optimizer")), app
    markdown = (out / "acceptance.md").read_text()
    assert all(f"| {part} | passed |" in markdown for part in PARTS) and "| crossbert |" in markdown


def test_a_part_over_its_budget_is_cut_with_what_it_started(tmp_path):
    acceptance = acceptance_module()
    env = {**acceptance.os.environ, "LINGUA_TEST_PROCESS_TAG": "acceptance-cut"}
    part = acceptance.run_part("tests", tmp_path, dry_run=True, budget_s=3, env=env)  # pytest alone takes longer
    assert part["status"] == "cut" and "budget of 3 s" in part["reason"]
    deadline = time.time() + 10  # a process killed a moment ago may still be dying
    while tagged_processes("acceptance-cut") and time.time() < deadline:
        time.sleep(0.1)
    assert tagged_processes("acceptance-cut") == []
    report = {"dry_run": True, "started": "now", "parts": {"tests": part}}
    acceptance.write_reports(report, tmp_path)
    assert "| tests | cut |" in (tmp_path / "acceptance.md").read_text()


def test_the_reports_hold_each_part_as_soon_as_it_ends(tmp_path, monkeypatch):
    acceptance = acceptance_module()
    out, on_disk = tmp_path / "out", {}

    def part(name, work, dry_run, budget_s, env):
        on_disk[name] = list(json.loads((out / "acceptance.json").read_text())["parts"]) if on_disk else []
        if name == "training":  # cut, with what it had left: the later parts still run
            return {"status": "cut", "budget_s": budget_s, "reason": "ran over", "partial": {"apps": {}}}
        return {"status": "failed", "budget_s": budget_s, "reason": f"{name} stand-in"}

    monkeypatch.setattr(acceptance, "run_part", part)
    report = acceptance.run_all(out, dry_run=True, bundle=None)
    assert on_disk["training"] == ["environment", "tests", "benchmark", "profile"]
    assert list(report["parts"]) == PARTS and report["parts"]["glue"]["status"] == "skipped"
    assert report["inductor_cache"] and not report["passed"]
    assert "| training | cut |" in (out / "acceptance.md").read_text()


def test_a_cut_part_keeps_what_it_had_left(tmp_path, monkeypatch):
    """The part's process, a stand-in that leaves the benchmark's first app and then runs past its budget."""
    acceptance = acceptance_module()
    stand_in = tmp_path / "part.py"
    stand_in.write_text("import json, sys, time\n"
                        "work = sys.argv[3]\n"
                        "open(f'{work}/part_benchmark.json', 'w').write(json.dumps({'apps': {'bert': {}}}))\n"
                        "time.sleep(60)\n")
    monkeypatch.setattr(acceptance, "__file__", str(stand_in))
    part = acceptance.run_part("benchmark", tmp_path, dry_run=True, budget_s=2, env=dict(acceptance.os.environ))
    assert part["status"] == "cut" and part["partial"] == {"apps": {"bert": {}}}


def test_the_profile_names_the_regions_of_a_step():
    """Eager here (the dry run profiles compiled steps): ranges, matmul shapes and autograd's links decide."""
    import torch
    from torch.profiler import profile

    from tools.benchmark import build, parse_args, step

    acceptance = acceptance_module()
    args = parse_args(["apps=crossbert", "preset=debug", "encoder.n_layers=1", "seq_len=32", "encoder.max_seqlen=32",
                       "batch_size=3", "vocab_size=100", "warmup=0"])
    contender = build("crossbert", args, torch.device("cpu"))
    with profile(record_shapes=True) as prof:
        step(contender, args, torch.device("cpu"))
    times = acceptance.region_times(prof.events(), False, args.vocab_size, 256)  # the debug width's SwiGLU width
    assert list(times) == list(acceptance.REGIONS)
    assert all(times[region] > 0 for region in ("head+loss", "attention", "mlp", "optimizer"))


def test_the_budgets_fit_8_minutes_of_a_gpu():
    acceptance = acceptance_module()
    assert sum(acceptance.BUDGETS_S.values()) <= 480 and list(acceptance.BUDGETS_S) == PARTS


def test_prepare_gathers_the_tokenizer_and_the_wheels(tmp_path, monkeypatch):
    acceptance = acceptance_module()
    if not (default_tokenizer_dir() / "r50k_base.tiktoken").exists():
        pytest.skip("run setup/install.sh first (the tokenizer file)")
    downloads = []
    monkeypatch.setattr(acceptance.subprocess, "run", lambda cmd, **kwargs: downloads.append(cmd))
    size = acceptance.prepare(tmp_path / "bundle")
    assert downloads and downloads[0][:4] == [sys.executable, "-m", "pip", "download"]
    assert "submitit==1.5.4" in downloads[0] and "3.12" in downloads[0]  # the GPU image's Python
    assert (tmp_path / "bundle" / "tokenizer" / "r50k_base.tiktoken").exists() and size < 64 * 2**20


def test_help(capsys):
    done = subprocess.run(["bash", "scripts/gpu_acceptance.sh", "--help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and "--dry-run" in done.stdout and "--prepare" in done.stdout
