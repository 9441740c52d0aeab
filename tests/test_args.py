from dataclasses import dataclass, field

import pytest

from lingua.args import UserError, dump_config, load_config


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
