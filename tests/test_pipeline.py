"""Pipelines (lingua/jobs/pipeline.py, pipeline_plan.py, pipeline_stage.py): stages expanded per variant and ordered by
their needs, run on `local` (skipping the finished ones, naming a failed one with its log and leaving its dependents,
resuming after a kill), planned as SLURM jobs in a dry run (tests/test_slurm.py submits them to a real SLURM), and the
Table 3 pipeline end to end on the debug models with offline data made here."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, end, offline_data, run_to_the_end, start, tagged_processes

from lingua.errors import UserError
from lingua.jobs.pipeline import format_status, launch
from lingua.jobs.pipeline_plan import load_pipeline
from lingua.jobs.pipeline_stage import slurm_job_active, state_of, this_process


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def pipeline_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "lingua.stool", "pipeline", *args]


def commands_run(stage_folder: Path) -> int:
    """How many times the stage's command was started (each start writes its command line to the log)."""
    return sum(line.startswith("$ ") for line in (stage_folder / "log.txt").read_text().splitlines())


@pytest.fixture
def toy(tmp_path) -> Path:
    """Two variants; `second` needs the same variant's `first`; `check` reads a JSON file given as a path; `table`
    needs every variant's `second` and `check`; `free` needs nothing."""
    return write(tmp_path / "toy.yaml", f"""\
        dump_dir: {tmp_path / "out"}
        paths: {{input: {tmp_path / "missing.json"}}}
        variants:
          a: {{word: alpha, gpus: 2}}
          b: {{word: beta, gpus: 4}}
        launcher: {{time: 30}}
        stages:
          first:
            run: zipfile -c {{dir}}/{{variant}}.zip {REPO / "README.md"}
            launcher: {{gpus_per_node: "{{gpus}}"}}
          second:
            after: [first]
            run: timeit -n 1 "print('{{word}}')"
          check:
            after: [first.a]
            run: json.tool {{input}}
          table:
            after: [second, check]
            run: zipfile -l {{dir}}/a.zip
          free:
            run: timeit -n 1 pass
        """)


def test_stages_expand_per_variant_in_the_order_of_their_needs(toy, tmp_path):
    pipeline = load_pipeline(str(toy))
    names = [stage.name for stage in pipeline.stages]
    assert names == ["first.a", "first.b", "second.a", "second.b", "check", "table", "free"]
    stages = {stage.name: stage for stage in pipeline.stages}
    assert stages["second.b"].after == ["first.b"] and stages["check"].after == ["first.a"]
    assert stages["table"].after == ["second.a", "second.b", "check"]
    assert stages["second.a"].args == ["-n", "1", "print('alpha')"]
    assert stages["first.b"].launcher == {"time": 30, "gpus_per_node": "4"}
    assert stages["check"].args == [str(tmp_path / "missing.json")]
    assert load_pipeline(str(toy), {"input": "x.json"}).stages[4].args == [str(Path("x.json").resolve())]


@pytest.mark.parametrize("change, message", [
    ({"colour": "red"}, "unknown key 'colour'"),
    ({"stages": {"one": {"run": "json.tool x", "after": ["nothing"]}}}, "comes after 'nothing', which is not a stage"),
    ({"stages": {"one": {"run": "json.tool x", "after": ["two"]}, "two": {"run": "json.tool y", "after": ["one"]}}},
     "depends on itself"),
    ({"stages": {"one": {"run": "json.tool {nowhere}"}}}, "uses {nowhere}, which the pipeline's paths does not define"),
    ({"stages": {"one": {"after": []}}}, "stage one has no run"),
    ({"stages": {"one": {"run": "json.tool {"}}}, "stage one's run cannot be read"),
    ({"stages": {"one": {"run": "json.tool 'x"}}}, "stage one's run cannot be read (No closing quotation)"),
    ({"stages": ["one"]}, "needs a dump_dir and stages (a mapping"),
    ({"variants": {"a": "bert"}}, "variants must map each variant's name to its keys"),
])
def test_bad_pipelines_are_refused_in_one_line(tmp_path, change, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"dump_dir": str(tmp_path / "out"), "stages": {"one": {"run": "json.tool x"}},
                                    **change}))
    with pytest.raises(UserError, match=re.escape(message)):
        load_pipeline(str(path))


def test_a_path_the_pipeline_does_not_have_is_refused(toy):
    with pytest.raises(UserError, match=r"has no path 'colour' \(its paths: dump_dir, input\)"):
        load_pipeline(str(toy), {"colour": "red"})


def test_a_failed_stage_is_named_with_its_log_its_dependents_wait_and_a_rerun_finishes(toy, tmp_path):
    out = tmp_path / "out"
    failed = run_to_the_end(pipeline_command(f"pipeline={toy}", "cluster=local"))
    assert failed.returncode == 2
    assert f"1 stage(s) failed: check (log {out / 'stages' / 'check' / 'log.txt'}); not started: table" in failed.stderr
    assert "check: failed (exit 2: " in failed.stdout
    assert "table: not started: a stage it needs did not finish" in failed.stdout
    assert "free: done" in failed.stdout and not (out / "stages" / "table").exists()
    status = run_to_the_end([sys.executable, "-m", "lingua.stool", "status", str(out)])
    assert "check     failed" in status.stdout and "table     not started" in status.stdout
    assert "5 of 7 stage(s) done" in status.stdout

    (tmp_path / "present.json").write_text('{"ok": true}')
    rerun = run_to_the_end(pipeline_command(f"pipeline={toy}", "cluster=local", f"input={tmp_path / 'present.json'}"))
    assert rerun.returncode == 0, rerun.stderr
    assert "first.a: done" in rerun.stdout and "first.a: started" not in rerun.stdout
    for stage, starts in {"first.a": 1, "second.b": 1, "free": 1, "check": 2, "table": 1}.items():
        assert commands_run(out / "stages" / stage) == starts, stage
    assert "README.md" in (out / "stages" / "table" / "log.txt").read_text()


def slow_pipeline(tmp_path: Path) -> Path:
    """`slow` sleeps until a flag file exists; `last` needs it."""
    return write(tmp_path / "slow.yaml", f"""\
        dump_dir: {tmp_path / "out"}
        paths: {{flag: {tmp_path / "flag"}}}
        stages:
          first:
            run: timeit -n 1 pass
          slow:
            after: [first]
            run: timeit -n 1 "import os, time; [time.sleep(0.1) for _ in range(600) if not os.path.exists('{{flag}}')]"
          last:
            after: [slow]
            run: timeit -n 1 pass
        """)


def start_until_slow_runs(tmp_path: Path) -> tuple[Path, Path, subprocess.Popen]:
    """(the pipeline file, its stages folder, the pipeline's process) once `slow` has started."""
    spec, stages = slow_pipeline(tmp_path), tmp_path / "out" / "stages"
    proc = start(pipeline_command(f"pipeline={spec}", "cluster=local"), stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (stages / "slow" / "started.json").exists() and time.time() < deadline:
        time.sleep(0.1)
    return spec, stages, proc


def finish_without_redoing_the_first_stage(tmp_path: Path, spec: Path, stages: Path) -> None:
    (tmp_path / "flag").touch()
    rerun = run_to_the_end(pipeline_command(f"pipeline={spec}", "cluster=local"))
    assert rerun.returncode == 0, rerun.stderr
    assert [commands_run(stages / name) for name in ("first", "slow", "last")] == [1, 2, 1]


def test_a_stopped_pipeline_stops_its_stage_and_the_same_command_goes_on(tmp_path):
    spec, stages, proc = start_until_slow_runs(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        left = tagged_processes(proc.tag)
    finally:
        end(proc)
    assert proc.returncode == 2 and "stopped during slow: the same command goes on from there" in err, err
    assert left == [] and not (stages / "slow" / "done.json").exists()
    finish_without_redoing_the_first_stage(tmp_path, spec, stages)


STOPPED_AS_IT_STARTS = """
import os, signal, sys
from lingua.jobs import pipeline_stage
from lingua.jobs.pipeline_plan import Stage
write = pipeline_stage.atomic_write
def write_then_stop(path, text):  # the pipeline is stopped the moment started.json exists, as a test or user sees it
    write(path, text)
    os.kill(os.getpid(), signal.SIGTERM)
pipeline_stage.atomic_write = write_then_stop
stage = Stage("slow", "timeit", ["-n", "1", "import time; time.sleep(60)"], after=[])
print(pipeline_stage.run_stage(sys.argv[1], stage, "."))
"""


def test_a_stop_the_moment_a_stage_has_started_stops_its_command(tmp_path):
    """The stop handler is in place before the stage's command starts and started.json says so."""
    done = run_to_the_end([sys.executable, "-c", STOPPED_AS_IT_STARTS, str(tmp_path / "slow")], timeout=60)
    assert done.returncode == 0 and done.stdout.split() == ["stopped"], (done.returncode, done.stderr[-2000:])
    assert not (tmp_path / "slow" / "started.json").exists() and not (tmp_path / "slow" / "done.json").exists()


def test_a_killed_pipeline_is_resumed_once_its_orphaned_stage_is_gone(tmp_path):
    """SIGKILL leaves the stage's command running in its own process group: a rerun refuses to start it twice."""
    spec, stages, proc = start_until_slow_runs(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        group = json.loads((stages / "slow" / "started.json").read_text())["group"]
        refused = run_to_the_end(pipeline_command(f"pipeline={spec}", "cluster=local"))
        assert refused.returncode == 2
        assert f"stage slow is running elsewhere (process group {group}: kill -- -{group})" in refused.stderr, \
            refused.stderr
    finally:
        end(proc)  # the orphaned stage too: it carries the test's tag
    finish_without_redoing_the_first_stage(tmp_path, spec, stages)


def test_a_dry_run_shows_each_stages_launcher_and_needs_and_writes_nothing(toy, tmp_path):
    """What each SLURM job would ask for (the variant's GPUs, the command line's keys over the file's); the jobs
    themselves are tested against a real SLURM in tests/test_slurm.py."""
    dry = run_to_the_end(pipeline_command(f"pipeline={toy}", "cluster=slurm", "time=45", "--dry-run"))
    assert "second.a [pending] (slurm: 1 node(s) x 8 GPU(s), 45 min, after first.a)" in dry.stdout, dry.stdout
    assert "first.b [pending] (slurm: 1 node(s) x 4 GPU(s), 45 min)" in dry.stdout
    assert "table [pending] (slurm: 1 node(s) x 8 GPU(s), 45 min, after second.a, second.b, check)" in dry.stdout
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_table3_debug_pipeline_end_to_end_on_offline_data(tmp_path, corpus):
    """docs/pipelines/table3_debug.yaml, its stages shortened (fewer steps, examples and tasks), for CrossBERT on the
    tiny corpus: every stage runs and the Table 3 file has every section filled. One variant: what a variant changes
    in a stage is its app, and every app's training, probes, fine-tuning, contrastive training and MTEB run in their
    own tests; the pipeline's variants are tested on the toy pipeline (`toy`)."""
    pytest.importorskip("mteb")
    spec = yaml.safe_load((REPO / "docs" / "pipelines" / "table3_debug.yaml").read_text())
    spec["dump_dir"] = str(tmp_path / "table3")
    spec["variants"] = {"crossbert": spec["variants"]["crossbert"]}
    short = {
        "pretrain": "steps=12 'data.sources={{tiny: 1.0}}' data.tokenizer.name=bytes data.seq_len=32 "
                    "model.encoder.dim=32 model.encoder.n_layers=2 model.encoder.n_heads=2 model.encoder.max_seqlen=32 "
                    "validation.every=12 validation.n_sequences=4 checkpoint.every=12 logging.freq=4",
        "probes": "tasks=rte,stsb max_train=40",
        "finetune": "tasks=rte run_overrides=data.max_train=32,data.seq_len=32,data.batch_size=8 epochs=1",
        "contrastive_frozen": "steps=3 data.seq_len=32 data.batch_size=4 checkpoint.every=3",
        "contrastive_full": "steps=3 data.seq_len=32 data.batch_size=4 checkpoint.every=3",
        "mteb_frozen": "tasks=STSBOffline,SciFactOffline batch_size=16",
        "mteb_full": "tasks=STSBOffline,SciFactOffline batch_size=16",
    }
    for stage, extra in short.items():
        spec["stages"][stage]["run"] += " " + extra
    path = tmp_path / "table3_debug.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    data = offline_data(tmp_path / "shared")
    result = run_to_the_end(pipeline_command(f"pipeline={path}", "cluster=local", f"data={data}", f"corpus={corpus}"),
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "table3" / "table3.md").read_text()
    for title in ("GLUE, full fine-tuning", "GLUE, linear probe", "GLUE, kNN probe",
                  "offline stand-ins, contrastive fine-tuning, whole model",
                  "offline stand-ins, contrastive fine-tuning, over frozen features"):
        assert f"**{title}" in table, title
    rows = [line for line in table.splitlines() if line.startswith("| CrossBERT ")]
    assert len(rows) == 5 and all("–" not in row for row in rows), table  # every cell of ours filled
    assert "| *CrossBERT, paper* | 279M | 4.1e19 | – | 207k | 85.1 |" in table  # RTE beside ours, fine-tuning
    assert "tps, as the paper's: training token-views per second per GPU" in table
    assert "Metrics (dev, in %): RTE accuracy; STSB Spearman correlation." in table
    assert "## The literature in the paper's Table 3" in table

    # a stage that did not record its end (killed) runs again: its sweep submits its finished run again, which goes on
    (tmp_path / "table3" / "stages" / "finetune.crossbert" / "done.json").unlink()
    again = run_to_the_end(pipeline_command(f"pipeline={path}", "cluster=local", f"data={data}", f"corpus={corpus}"))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "finetune.crossbert: started" in again.stdout and "pretrain.crossbert: started" not in again.stdout


def one_stage(tmp_path: Path, run: str) -> Path:
    return write(tmp_path / "one.yaml", f"""\
        dump_dir: {tmp_path / "out"}
        stages:
          only:
            run: {run}
        """)


def test_a_stage_whose_command_changed_is_refused_in_one_line(tmp_path, capsys):
    launch(load_pipeline(str(one_stage(tmp_path, "timeit -n 1 pass"))), ["cluster=local"])
    changed = load_pipeline(str(one_stage(tmp_path, "timeit -n 2 pass")))
    with pytest.raises(UserError, match=r"stage only was run with another command \(timeit -n 1 pass\); to run "
                                        r"`timeit -n 2 pass` instead, stop its job if it has one and remove"):
        launch(changed, ["cluster=local"])
    assert commands_run(tmp_path / "out" / "stages" / "only") == 1
    assert "only   done" in format_status(tmp_path / "out")  # the pipeline's record is the one that ran


def test_a_local_stage_is_told_apart_by_host_boot_and_start_time(tmp_path):
    """A record from another host is that host's business (refused, with what to do if it is gone); one from before
    this host's last boot, or whose pid and group now belong to processes started at another time, is not running."""
    pipeline = load_pipeline(str(one_stage(tmp_path, "timeit -n 1 pass")))
    folder = tmp_path / "out" / "stages" / "only"
    folder.mkdir(parents=True)
    group = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:  # a live runner (this process) and a live command's group (its leader: `group`)
        here = {**this_process(group.pid), "line": "timeit -n 1 pass"}
        (folder / "started.json").write_text(json.dumps({**here, "host": "elsewhere"}))
        with pytest.raises(UserError, match=r"stage only is running elsewhere \(on host elsewhere, process group "
                                            rf"{group.pid}; if that host is gone, remove {folder / 'started.json'}\)"):
            launch(pipeline, ["cluster=local"])
        for stale in ({"boot": "another boot"}, {"pid_start": "1", "group_start": "1"}):
            (folder / "started.json").write_text(json.dumps({**here, **stale}))
            assert state_of(pipeline.dump_dir, pipeline.stages[0], {}) == "pending"
        (folder / "started.json").write_text(json.dumps(here))
        assert state_of(pipeline.dump_dir, pipeline.stages[0], {}) == "running"
    finally:
        group.kill()
        group.wait()


@pytest.mark.parametrize("state,active", [("PENDING", True), ("UNKNOWN", True), ("PREEMPTED", True),
                                          ("REQUEUE_HOLD", True), ("REQUEUED", True), ("SUSPENDED", True),
                                          ("COMPLETED", False), ("CANCELLED by 0", False), ("NODE_FAIL", False)])
def test_every_state_but_a_final_one_is_in_the_schedulers_hands(monkeypatch, state, active):
    """What submitit reports while sacct lags (UNKNOWN) or during a requeue: a re-run must not submit the stage again.
    (A real SLURM cannot be made to show each of these on demand.)"""
    import submitit

    monkeypatch.setattr(submitit.SlurmJob, "state", property(lambda job: state))
    assert slurm_job_active(Path("/nowhere"), "1") is active


def test_a_value_stays_inside_its_argument(tmp_path):
    """The run is split into arguments before the values are filled in: a path with a space is one argument, and a
    value holding `key=value` adds no argument of its own."""
    spaced = tmp_path / "a folder" / "in.json"
    spec = write(tmp_path / "p.yaml", f"""\
        dump_dir: {tmp_path / "out"}
        paths: {{input: {spaced}}}
        variants: {{v: {{word: x out=/y}}}}
        stages:
          only:
            run: json.tool {{input}} name={{word}} 'quoted {{word}}'
        """)
    stage, = load_pipeline(str(spec)).stages
    assert stage.module == "json.tool" and stage.args == [str(spaced), "name=x out=/y", "quoted x out=/y"]


@pytest.mark.parametrize("stages, variants, named", [
    ({"../x": {"run": "json.tool x"}}, {}, "stage '../x'"),
    ({"a\nb": {"run": "json.tool x"}}, {}, "stage 'a\\nb'"),
    ({"a.b": {"run": "json.tool x"}}, {}, "stage 'a.b'"),
    ({"one": {"run": "json.tool {variant}"}}, {"../v": {"k": 1}}, "variant '../v'"),
])
def test_stage_and_variant_names_that_could_leave_the_folder_are_refused_in_one_line(tmp_path, stages, variants,
                                                                                      named):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"dump_dir": str(tmp_path / "out"), "stages": stages, "variants": variants}))
    with pytest.raises(UserError) as refused:
        load_pipeline(str(path))
    assert f"{named} is not a name (letters, digits, _ and -)" in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()


def test_status_reads_a_pipeline_folder_from_anyone_without_leaving_it(tmp_path, capsys, monkeypatch):
    """Stage records that are damaged or point elsewhere: status shows the stages (a job is asked of SLURM by its id
    alone), and a pipeline.json whose stage would lead outside the folder is refused in one line."""
    import submitit

    from lingua import stool

    pipeline = load_pipeline(str(one_stage(tmp_path, "timeit -n 1 pass")))
    out = pipeline.dump_dir
    (out / "stages" / "only").mkdir(parents=True)
    (out / "pipeline.json").write_text(json.dumps(pipeline.record()))
    (out / "stages" / "only" / "job.json").write_text(json.dumps({"job_id": "3", "folder": str(tmp_path / "x"),
                                                                  "line": "timeit -n 1 pass"}))
    asked = []
    monkeypatch.setattr(submitit, "SlurmJob", lambda folder, job_id: asked.append((folder, job_id)) or
                        type("Job", (), {"state": "RUNNING"})())
    stool.main(["status", str(out)])
    assert "only   submitted" in capsys.readouterr().out and asked == [(out / "submitit", "3")]
    (out / "stages" / "only" / "failed.json").write_text("{")
    stool.main(["status", str(out)])
    assert "only   failed (exit ?: unreadable failed.json)" in capsys.readouterr().out

    record = pipeline.record()
    record["stages"][0]["name"] = "../../elsewhere"
    (out / "pipeline.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit) as exit_status:
        stool.main(["status", str(out)])
    assert exit_status.value.code == 2 and capsys.readouterr().err == (
        f"error: {out / 'pipeline.json'} is not a pipeline record (stages with names, modules, arguments and needs)\n")


def test_a_link_at_a_stage_log_is_refused_not_followed(tmp_path):
    """A received pipeline folder whose stage log links elsewhere: the stage's output was appended there."""
    pipeline = write(tmp_path / "one.yaml", f"""\
        dump_dir: {tmp_path / "out"}
        stages:
          free:
            run: timeit -n 1 pass
        """)
    log = tmp_path / "out" / "stages" / "free" / "log.txt"
    log.parent.mkdir(parents=True)
    outside = tmp_path / "outside.txt"
    outside.write_text("someone's file\n")
    log.symlink_to(outside)
    result = run_to_the_end(pipeline_command(f"pipeline={pipeline}", "cluster=local"))
    assert result.returncode == 2
    assert f"error: cannot write {log}: a symbolic link, which the library never writes through" in result.stderr
    assert "Traceback" not in result.stderr and outside.read_text() == "someone's file\n"
