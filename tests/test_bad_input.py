"""Bad input gets one clear line, before any work, and nothing is lost: hostile JSON and YAML files (the one reader,
lingua/untrusted.py, and each command that met one), shapes and packages checked with the config, and a config
whose memory this machine cannot hold (issue 40, items 7 and 8)."""

import ast
import json
import os
import resource
import subprocess
import sys

import pytest
import yaml
from conftest import ENV, REPO, tiny_argv
from test_faults import assert_one_line, run_main
from test_pipeline import one_stage
from test_triplets import CORPUS, QRELS, QUERIES, write_beir

from apps.finetune.train import FinetuneTrainArgs
from lingua import stool, untrusted
from lingua.args import UserError, from_dict, to_dict
from lingua.eval import triplets
from lingua.pipeline_plan import load_pipeline
from tools.finetune import table

DEEP_JSON = "[" * 5000 + "]" * 5000
DEEP_YAML = "".join("  " * depth + f"k{depth}:\n" for depth in range(5000)) + "  " * 5000 + "1\n"


# ------------------------------------------------------------------------------------------------------ the reader


@pytest.mark.parametrize("content, problem", [
    (DEEP_JSON.encode(), "nested deeper than 100 levels"),
    (b'{"n": ' + b"7" * 5000 + b"}", "holds a number of more than 4300 digits"),
    (b'{"text": "caf\xe9"}', "not UTF-8 text (invalid continuation byte at byte 13)"),
    (b'["a", "mapping", "is", "due"]', "expected a JSON object, got list"),
    (b'{"a": 1,', "not valid JSON (Expecting property name enclosed in double quotes at line 1, column 9)"),
], ids=["deep", "digits", "utf-8", "list", "broken"])
def test_the_json_reader_refuses_a_hostile_file_in_one_line_naming_it(tmp_path, content, problem):
    path = tmp_path / "record.json"
    path.write_bytes(content)
    with pytest.raises(UserError) as refused:
        untrusted.read_json(path, "stage record")
    assert str(refused.value) == f"stage record {path}: {problem}"


@pytest.mark.parametrize("content, problem", [
    (DEEP_YAML.encode(), "not valid YAML: nested deeper than 100 levels (line 100)"),
    (b"[" * 5000, "not valid YAML: nested deeper than 100 levels (line 1)"),
    (b"steps: " + b"7" * 5000, "holds a number of more than 4300 digits"),
    (b"steps: 2\noptim:\n  lr: 1e-3\nsteps: 3\n", "not valid YAML: key 'steps' is written twice (lines 1 and 4)"),
    (b"name: \xff", "not UTF-8 text (invalid start byte at byte 6)"),
    (b"- a list\n", "expected a mapping, got list"),
    (b"when: 2024-13-45", "not valid YAML: month must be in 1..12"),
    (b"run: !!python/object/apply:os.system [echo hi]", "not valid YAML: could not determine a constructor"),
], ids=["deep-block", "deep-flow", "digits", "twice", "utf-8", "list", "date", "code"])
def test_the_yaml_reader_refuses_a_hostile_file_in_one_line_naming_it(tmp_path, content, problem):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(UserError) as refused:
        untrusted.read_yaml(path, "config file")
    assert str(refused.value).startswith(f"config file {path}: {problem}") and "\n" not in str(refused.value)


def test_the_reader_opens_regular_files_only(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # opening one to read would wait for a writer forever
    for path, problem in [(tmp_path / "fifo", "is not a regular file"), (tmp_path, "is a folder, not a file")]:
        with pytest.raises(UserError, match=f"^file {path} {problem}$"):
            untrusted.read_json(path)
    with pytest.raises(UserError, match="^file not found: "):
        untrusted.read_yaml(tmp_path / "missing.yaml")


def test_every_reader_of_json_or_yaml_from_disk_is_the_one_reader():
    """The class, not the instances: no module parses JSON or YAML but lingua/untrusted.py (a deep copy through
    json.dumps reads nothing from disk)."""
    parsers = {("json", "loads"), ("json", "load"), ("yaml", "safe_load"), ("yaml", "load"), ("yaml", "full_load")}
    found = []
    for folder in ("lingua", "apps", "tools", "setup"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == REPO / "lingua" / "untrusted.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name)
                        and (node.func.value.id, node.func.attr) in parsers):
                    continue
                copied = node.args and isinstance(node.args[0], ast.Call) and \
                    isinstance(node.args[0].func, ast.Attribute) and node.args[0].func.attr == "dumps"
                if not copied:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


def test_a_yaml_merge_key_is_not_a_key_written_twice(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("base: &base {lr: 1}\nrun:\n  <<: *base\n  lr: 2\n")
    assert untrusted.read_yaml(path) == {"base": {"lr": 1}, "run": {"lr": 2}}


# ------------------------------------------------------------------------------------------------------ commands


def test_a_command_line_value_that_is_not_yaml_is_one_line(corpus, tmp_path, capsys):
    status, err = run_main(tiny_argv(corpus, tmp_path / "run", 2) + ["eval.tasks=[rte"], capsys)
    assert status == 2
    assert_one_line(err, "the value of config key 'eval.tasks': not valid YAML: expected ',' or ']'")


@pytest.mark.parametrize("content, problem", [
    (DEEP_YAML, "nested deeper than 100 levels"),
    ("steps: 2\ndata:\n  batch_size: 8\nsteps: 4\n", "key 'steps' is written twice (lines 1 and 4)"),
], ids=["deep", "twice"])
def test_a_hostile_config_file_is_one_line_and_nothing_is_written(corpus, tmp_path, capsys, content, problem):
    config = tmp_path / "config.yaml"
    config.write_text(content)
    status, err = run_main([f"config={config}"] + tiny_argv(corpus, tmp_path / "run", 2), capsys)
    assert status == 2
    assert_one_line(err, problem)
    assert not (tmp_path / "run").exists()


def test_heads_of_an_odd_size_are_refused_with_the_config(corpus, tmp_path, capsys):
    """dim 100 over 4 heads: heads of 25 dimensions, which RoPE cannot turn (was a tensor size error at init)."""
    argv = tiny_argv(corpus, tmp_path / "run", 2) + ["model.encoder.dim=100", "model.encoder.n_heads=4"]
    status, err = run_main(argv, capsys)
    assert status == 2
    assert_one_line(err, "config key 'model.encoder.dim' gives heads of 25 dimensions, an odd number")
    assert not (tmp_path / "run").exists()


def test_a_predictor_that_cannot_be_is_named_by_its_key(corpus, tmp_path, capsys):
    from apps.crossbert.train import APP as CROSSBERT

    status, err = run_main(tiny_argv(corpus, tmp_path / "run", 2) + ["model.predictor.n_heads=3"], capsys, CROSSBERT)
    assert status == 2
    assert_one_line(err, "config key 'model.predictor' makes a predictor whose dim 32 is not divisible by n_heads 3")


def test_wandb_asked_for_but_not_installed_is_one_line_before_the_start(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed (find_spec says so), whether it is here or not
    status, err = run_main(tiny_argv(corpus, tmp_path / "run", 2) + ["logging.wandb_project=X"], capsys)
    assert status == 2
    assert_one_line(err, "logging.wandb_project is set but wandb is not installed")
    assert not (tmp_path / "run").exists()


def _at_most_4_gib():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a regression fails here, the machine stays up


def test_a_batch_this_machine_cannot_hold_is_refused_before_anything_is_allocated(corpus, tmp_path):
    """data.batch_size=1000000000 allocated 23 GB and took the machine down."""
    dump = tmp_path / "run"
    argv = [a for a in tiny_argv(corpus, dump, 2) if not a.startswith("data.batch_size")]
    done = subprocess.run([sys.executable, "-m", "apps.bert.train", *argv, "data.batch_size=1000000000"], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=300, preexec_fn=_at_most_4_gib)
    assert done.returncode == 2, done.stderr
    assert_one_line(done.stderr, "the run needs at least")
    assert "of host memory per process" in done.stderr and "lower data.batch_size" in done.stderr
    assert not dump.exists()


# ------------------------------------------------------------------------------------------------------ readers


@pytest.mark.parametrize("row", ['{"_id": "d9", "text": "x", "n": ' + "7" * 5000 + "}",
                                 '{"_id": "d9", "text": "x", "deep": ' + DEEP_JSON + "}"], ids=["digits", "deep"])
def test_a_hostile_beir_corpus_row_is_one_line(tmp_path, capsys, row):
    folder = write_beir(tmp_path / "beir", CORPUS, QUERIES, QRELS)
    with open(folder / "corpus.jsonl", "a") as f:
        f.write(row + "\n")
    with pytest.raises(SystemExit) as exit_status:
        triplets.main([f"beir={folder}", f"out={tmp_path / 'triplets.jsonl'}"])
    assert exit_status.value.code == 2
    assert_one_line(capsys.readouterr().err, f"{folder / 'corpus.jsonl'}:{len(CORPUS) + 1}: ")


def test_status_reads_a_run_whose_config_is_nested_5000_deep(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(DEEP_YAML)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 2.5}) + "\n" + DEEP_JSON + "\n")
    stool.main(["status", str(run)])
    assert capsys.readouterr().out.splitlines()[1].split()[:3] == ["run", "pending", "3"]


@pytest.mark.parametrize("record", [b'{"seconds": 1, "line": "caf\xe9"}', DEEP_JSON.encode()], ids=["utf-8", "deep"])
def test_status_reads_a_pipeline_whose_stage_record_is_hostile(tmp_path, capsys, record):
    pipeline = load_pipeline(str(one_stage(tmp_path, "timeit -n 1 pass")))
    (pipeline.dump_dir / "stages" / "only").mkdir(parents=True)
    (pipeline.dump_dir / "pipeline.json").write_text(json.dumps(pipeline.record()))
    (pipeline.dump_dir / "stages" / "only" / "done.json").write_bytes(record)
    stool.main(["status", str(pipeline.dump_dir)])
    assert "only   pending" in capsys.readouterr().out  # not a record: the stage runs again


def test_the_finetune_table_of_a_run_whose_config_is_not_one_is_one_line(tmp_path, capsys):
    run = tmp_path / "sweep" / "rte_lr1e-05_seed0"
    run.mkdir(parents=True)
    config = to_dict(from_dict(FinetuneTrainArgs, {"dump_dir": str(run)}))
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "data": 5}))
    with pytest.raises(SystemExit) as exit_status:
        table.main([str(tmp_path / "sweep")])
    assert exit_status.value.code == 2
    assert_one_line(capsys.readouterr().err, f"run config {run / 'config.yaml'} is not a fine-tuning run's: "
                                             "config key 'data' expects a mapping, got 5")
