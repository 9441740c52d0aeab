import runpy
import sys
import warnings
from dataclasses import dataclass, field

import pytest

from lingua.args import HelpRequested, config_help, dump_config, load_config
from lingua.errors import UserError


@dataclass
class Inner:
    dim: int = 8
    lr: float = 1e-3
    use_bias: bool = False
    name: str | None = None


@dataclass
class Outer:
    steps: int
    inner: Inner = field(default_factory=Inner)
    sources: dict[str, float] = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("steps: 10\ninner:\n  dim: 4\n  lr: 1e-2\nsources:\n  wiki: 1\n")
    cfg = load_config(Outer, [f"config={path}", "inner.dim=16", "sources.news=0.5", "tasks=sst2,cola"])
    assert cfg.steps == 10 and cfg.inner.dim == 16 and cfg.inner.lr == 1e-2
    assert cfg.sources == {"wiki": 1.0, "news": 0.5}
    assert cfg.tasks == ["sst2", "cola"]
    assert isinstance(cfg.sources["wiki"], float)


def test_overrides_leave_the_callers_base_as_it_was():
    """A base (a command's preset) is read, never written: an override of a nested key once changed the preset for
    every later command in the process (tools.benchmark's debug preset kept another test's max_seqlen)."""
    base = {"steps": 1, "inner": {"dim": 4}}
    assert load_config(Outer, ["inner.dim=16"], base=base).inner.dim == 16
    assert base == {"steps": 1, "inner": {"dim": 4}} and load_config(Outer, [], base=base).inner.dim == 4


def test_single_value_for_a_list():
    assert load_config(Outer, ["steps=1", "ks=5", "tasks=sst2"]).ks == [5]
    assert load_config(Outer, ["steps=1", "ks=5,10"]).ks == [5, 10]


def test_values_take_the_field_type():
    cfg = load_config(Outer, ["steps=1e3", "inner.lr=3", "inner.use_bias=true", "inner.name=7"])
    assert cfg.steps == 1000 and isinstance(cfg.steps, int)
    assert cfg.inner.lr == 3.0 and isinstance(cfg.inner.lr, float)
    assert cfg.inner.use_bias is True and cfg.inner.name == "7"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["steps=1", "inner.dimm=3"], "unknown config key 'inner.dimm'"),
        (["steps=abc"], "config key 'steps' expects an integer"),
        (["steps=1", "inner.use_bias=3"], "config key 'inner.use_bias' expects true or false"),
        ([], "missing required config value 'steps'"),
        (["steps"], "expected key=value"),
        (["config=/nonexistent/cfg.yaml"], "config file not found"),
    ],
)
def test_errors_name_the_key(argv, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[")):
        load_config(Outer, argv)


def test_dump_round_trip(tmp_path):
    cfg = load_config(Outer, ["steps=3", "sources.a=2"])
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(Outer, [f"config={tmp_path / 'config.yaml'}"]) == cfg


def test_a_nested_config_starts_from_its_fields_default():
    @dataclass
    class Inner:
        a: int = 1
        b: int = 2

    @dataclass
    class Outer:
        inner: Inner = field(default_factory=lambda: Inner(a=10))

    assert load_config(Outer, []).inner == Inner(a=10, b=2)
    assert load_config(Outer, ["inner.b=5"]).inner == Inner(a=10, b=5)
    assert load_config(Outer, ["inner.a=3"]).inner == Inner(a=3, b=2)


COMMANDS = {  # each command, and what its help must say beside `python -m`
    "apps.bert.train": "", "apps.crossbert.train": "", "apps.electra.train": "", "tools.benchmark": "",
    "tools.diagnose": "", "tools.eval.glue": "", "tools.scaling": "", "lingua.stool": "",
    "apps.contrastive.train": "", "tools.eval.embeddings": "", "lingua.eval.triplets": "",
    "apps.crossbert.inspect": "", "tools.eval.mteb": "benchmark: str = 'MTEB(eng, v2)'", "lingua.export": "pooling",
    "apps.finetune.train": "epochs: int = 3", "tools.finetune.sweep": "mnli_from: str",
    "tools.finetune.table": "median", "tools.data_benchmark": "shards: str = '30,30000'",
    "tools.sample_efficiency": "task: str = 'avg'",
    "tools.compare": "metrics: str",
}


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_answers_help(module, monkeypatch, capsys):
    """Run as `python -m module --help` is, in this process (a process of its own would only add torch's import)."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    code = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before, by another test
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code
    out, err = capsys.readouterr()
    assert code in (0, None), err
    assert "python -m" in out and COMMANDS[module] in out and err == ""


def test_help_lists_every_key_with_its_type_default_and_comment():
    from apps.crossbert.train import CrossBertTrainArgs

    text = config_help(CrossBertTrainArgs, {"optim": {"lr": 0.01}})
    assert "  optim.lr: float = 0.01  # peak learning rate (AdamW)" in text  # the base's value is the default
    assert "  dump_dir: str = (required)  #" in text
    assert "  model.predictor.n_layers: int | None = None  # default: a quarter" in text
    with pytest.raises(HelpRequested):
        load_config(CrossBertTrainArgs, ["optim.lr=1", "--help"])


@dataclass
class Commented:
    sep: str = "#"  # a separator, # included
    # and the line below goes on
    plain: str = "a # b"

    unrelated: int = 0  # one line

    # a heading, after a blank line: no field's


def test_help_prints_whole_comments_and_no_hash_inside_a_string():
    from lingua.training.validation import ValidationArgs
    from tools.scaling import PlanArgs
    from tools.tables import TablesArgs

    assert "2 (CrossBERT's masking ratio), 4 (predictor), 5 (CMS)" in config_help(TablesArgs)  # across a line break
    assert "highest so far are saved to DUMP_DIR/best.pt, their validation record to best.json" in \
        config_help(ValidationArgs)
    assert "scaling_*.yaml, or those of the app its laws name)\n" in config_help(PlanArgs)
    lines = config_help(Commented).splitlines()[1:]
    assert lines == ["  sep: str = '#'  # a separator, # included and the line below goes on", "  plain: str = 'a # b'",
                     "  unrelated: int = 0  # one line"]


@pytest.mark.parametrize("version, supported", [("2.10.1+cu128", False), ("2.11.0+cu130", True), ("2.13.0", True),
                                                ("3.0.0a0", True)])
def test_a_torch_too_old_stops_every_command_in_one_line(monkeypatch, capsys, version, supported):
    import torch

    from apps.bert.train import APP
    from lingua.train import main

    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(SystemExit) as exit_info:
        main(APP, ["--help"])
    err = capsys.readouterr().err
    if supported:
        assert exit_info.value.code == 0 and err == ""
    else:
        assert exit_info.value.code == 2 and err.strip() == (f"error: torch {version} is older than 2.11, the oldest "
                                                             "this library runs on: install torch 2.11 or newer "
                                                             "(requirements.txt pins 2.13.0)")
