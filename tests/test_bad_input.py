"""Bad input gets one clear line, before any work, and nothing is lost: hostile JSON and YAML files (the one reader,
lingua/files/untrusted.py, and each command that met one), shapes and packages checked with the config, and a config
whose memory this machine cannot hold (issue 40, items 7 and 8)."""

import ast
import json
import os
import resource
import subprocess
import sys
from functools import partial

import pytest
import torch
import yaml
from conftest import ENV, REPO, tiny_argv
from test_faults import assert_one_line, run_main
from test_pipeline import one_stage
from test_triplets import CORPUS, QRELS, QUERIES, write_beir

from apps.finetune.train import FinetuneTrainArgs
from lingua import stool
from lingua.args import from_dict, to_dict
from lingua.errors import UserError
from lingua.eval import triplets
from lingua.files import untrusted
from lingua.jobs.pipeline_plan import load_pipeline
from lingua.training.memory import host_available
from tools import pipeline_results, scaling_runs
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


def _parses(attribute: str, module: str) -> bool:
    """Whether json's or yaml's `attribute` parses a text (yaml: anything named *load*, its loaders included)."""
    return attribute in ("load", "loads") if module == "json" else module == "yaml" and "load" in attribute.lower()


def _parsers(source: str) -> list[int]:
    """The lines of `source` that reach a parser of json or yaml: `json.loads`, `yaml.safe_load_all`, a loader class,
    the same through `import yaml as y`, or imported by name (`from json import loads`). A deep copy,
    `json.loads(json.dumps(...))`, reads nothing from disk."""
    tree = ast.parse(source)
    modules = {alias.asname or alias.name: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name in ("json", "yaml")}
    copies = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Call) and isinstance(node.args[0].func, ast.Attribute)
              and node.args[0].func.attr == "dumps"}
    found = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and any(_parses(alias.name, node.module) for alias in node.names)]
    found += [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and id(node) not in copies
              and isinstance(node.value, ast.Name) and _parses(node.attr, modules.get(node.value.id, ""))]
    return sorted(found)


@pytest.mark.parametrize("source", [
    "import json\njson.loads(text)", "import json\njson.load(f)", "from json import loads",
    "from json import load as read", "import yaml\nyaml.safe_load(text)", "import yaml\nyaml.load_all(text)",
    "import yaml\nyaml.unsafe_load(text)", "import yaml\nyaml.safe_load_all(text)", "import yaml\nyaml.full_load(t)",
    "from yaml import safe_load_all", "import yaml as y\ny.load(text, Loader=y.SafeLoader)",
    "import yaml\nparse = yaml.safe_load"])
def test_a_module_that_parses_json_or_yaml_itself_is_found(source):
    assert _parsers(source) != []


def test_every_reader_of_json_or_yaml_from_disk_is_the_one_reader():
    """The class, not the instances: no module parses JSON or YAML but lingua/files/untrusted.py."""
    assert _parsers("import json\ncopy = json.loads(json.dumps(config))\nfrom yaml import safe_dump") == []
    found = [f"{path.relative_to(REPO)}:{line}" for folder in ("lingua", "apps", "tools", "setup")
             for path in sorted((REPO / folder).rglob("*.py")) if path != REPO / "lingua" / "files" / "untrusted.py"
             for line in _parsers(path.read_text())]
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


# ------------------------------------------------------------------------------------------------- shapes and sizes

ALIAS_BOMB = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))  # 10^9 values in 511 bytes


def test_a_yaml_whose_aliases_expand_to_a_billion_values_is_one_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(ALIAS_BOMB)
    with pytest.raises(UserError) as refused:
        untrusted.read_yaml(path, "config file")
    assert str(refused.value) == f"config file {path}: not valid YAML: its aliases expand it to more than 1,000,000 " \
                                 "values"


@pytest.mark.parametrize("content, problem", [
    ("a: &a [1, *a]\n", "the node at line 1 holds an alias of itself"),
    ("a0: &a0 " + "[" * 90 + "]" * 90 + "\n" + "".join(f"a{i}: &a{i} {'[' * 50}*a{i - 1}{']' * 50}\n"
                                                       for i in range(1, 5)),
     "its aliases nest it deeper than 100 levels"),
], ids=["cycle", "deep"])
def test_a_yaml_whose_aliases_loop_or_nest_too_deep_is_one_line(tmp_path, content, problem):
    path = tmp_path / "config.yaml"
    path.write_text(content)
    with pytest.raises(UserError, match=f"^config file {path}: not valid YAML: {problem}$"):
        untrusted.read_yaml(path, "config file")


def test_anchors_and_merge_keys_still_read():
    table9 = untrusted.read_yaml(REPO / "docs" / "pipelines" / "table9.yaml")
    assert "&init_std" in (REPO / "docs" / "pipelines" / "table9.yaml").read_text() and table9


def test_a_json_or_yaml_file_over_the_size_limit_is_one_line_before_it_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(untrusted, "MAX_BYTES", 1000)
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"text": "x" * 2000}))
    for read in (untrusted.read_json, untrusted.read_yaml):
        with pytest.raises(UserError, match=f"^stage record {path} is larger than 0 MiB"):
            read(path, "stage record")


HOSTILE_GLUE = ['{}', '{"summary": 5}', '{"summary": {"last": {"linear": {"rte": "high"}}}}']
HOSTILE_MTEB = ['{"summary": {"STS": 1.0}}', '{"args": {"benchmark": "b", "tasks": 5}, "summary": {}}',
                '{"args": {"benchmark": "b"}, "summary": {"STS": [1]}}']


@pytest.mark.parametrize("content", HOSTILE_GLUE)
def test_pipeline_tables_of_a_hostile_glue_results_file_are_one_line(tmp_path, content):
    (tmp_path / "results.json").write_text(content)
    with pytest.raises(UserError, match=f"^GLUE results {tmp_path / 'results.json'} hold no summary of scores"):
        pipeline_results.layer_scores(tmp_path)


@pytest.mark.parametrize("content", HOSTILE_MTEB)
def test_pipeline_tables_of_a_hostile_mteb_results_file_are_one_line(tmp_path, content):
    (tmp_path / "mteb_frozen").mkdir()
    (tmp_path / "mteb_frozen" / "results.json").write_text(content)
    with pytest.raises(UserError, match="^MTEB results .*mteb_frozen/results.json hold no benchmark, tasks and summ"):
        pipeline_results.mteb_results(tmp_path)


def test_pipeline_tables_of_a_hostile_pipeline_record_are_one_line(tmp_path):
    (tmp_path / "pipeline.json").write_text('{"variants": ["bert"]}')
    with pytest.raises(UserError, match=f"^pipeline record {tmp_path / 'pipeline.json'} holds no variants"):
        pipeline_results.read_pipeline(tmp_path)


@pytest.mark.parametrize("kind, content", [*(("glue", c) for c in HOSTILE_GLUE), *(("mteb", c) for c in HOSTILE_MTEB)])
def test_scaling_of_a_run_with_a_hostile_results_file_is_one_line(tmp_path, kind, content):
    results = tmp_path / f"{kind}_eval" / "step_2" / "results.json"
    results.parent.mkdir(parents=True)
    results.write_text(content)
    read = scaling_runs._probe_results if kind == "glue" else partial(scaling_runs._mteb_results, protocol="frozen")
    with pytest.raises(UserError, match=f"^{kind.upper()} results {results} hold no "):
        read(tmp_path)


def test_the_finetune_table_of_a_checkpoint_whose_config_has_no_encoder_is_one_line(tmp_path):
    checkpoint = tmp_path / "consolidated.pt"
    torch.save({"app": "apps.crossbert.train", "config": {"model": 5}, "model": {}}, checkpoint)
    with pytest.raises(UserError, match=f"^checkpoint {checkpoint} has no model.encoder in its config$"):
        table.paper_app(str(checkpoint))


def test_a_cgroup_memory_limit_below_the_hosts_free_memory_is_the_one_that_counts(tmp_path):
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: {128 << 20} kB\nMemAvailable: {64 << 20} kB\n")
    (proc / "self" / "cgroup").write_text("0::/job/step\n")
    (cgroups / "job" / "step").mkdir(parents=True)
    (cgroups / "job" / "step" / "memory.max").write_text("max\n")  # no limit of its own: its parent's holds
    (cgroups / "job" / "memory.max").write_text(f"{4 << 30}\n")
    (cgroups / "job" / "memory.current").write_text(f"{1 << 30}\n")
    assert host_available(2, proc, cgroups) == (3 << 29, "the memory.max of cgroup /job")
    (proc / "self" / "cgroup").write_text("0::/\n")
    assert host_available(2, proc, cgroups) == (32 << 30, "the host's MemAvailable")


def test_an_address_space_limit_below_the_hosts_free_memory_is_the_one_that_counts():
    limited = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); " \
              "from lingua.training.memory import host_available; print(*host_available(), sep=';')"
    done = subprocess.run([sys.executable, "-c", limited], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=300)
    available, limit = done.stdout.strip().split(";")
    assert 0 < int(available) < 3 << 30 and limit == "the RLIMIT_AS soft limit (ulimit -v)", done.stderr
