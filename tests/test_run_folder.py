"""The run folder's layout has one owner (lingua/run_folder.py): its rules, and no other module spelling its names;
one function loads an app (lingua.app.load_app)."""

import ast
import sys
from pathlib import Path

import pytest

from lingua import run_folder
from lingua.app import load_app
from lingua.errors import UserError
from lingua.run_folder import EVALUATIONS, RunFolder

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("lingua", "apps", "tools", "scripts", "docs")
OWNER = REPO / "lingua" / "run_folder.py"


def layout_names() -> set[str]:
    """Every file and folder name the owner gives a run folder."""
    constants = {value for name, value in vars(run_folder).items() if name.isupper() and isinstance(value, str)}
    return constants | {RunFolder(Path()).evaluations(kind).name for kind in EVALUATIONS}


def spelled(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each string in the source, docstrings aside, that spells one of `names` as a path: a part of
    a path with a `/`, the right side of a `/`, a compared name, or, for a name with a `.` or `_`, anywhere."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    as_path = {id(node.right) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and type(node.op) is ast.Div}
    as_path |= {id(c) for node in ast.walk(tree) if isinstance(node, ast.Compare) for c in node.comparators}
    distinct = {name for name in names if "." in name or "_" in name}  # never a word of another meaning
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            path_like = "/" in node.value or id(node) in as_path
            if set(node.value.split("/")) & (names if path_like else distinct):
                found.append((node.lineno, node.value))
    return sorted(found)


def test_the_scan_finds_a_spelled_name():
    names = layout_names()
    source = '''"""A docstring naming consolidated.pt and code/."""
a = run / "consolidated.pt"
b = path.parent.name == "checkpoints"
c = sorted(folder.glob("glue_eval/*/results.json"))
d = {"code": 1, "checkpoints": 2}
e = f"checkpoints/{step:010d}"
'''
    assert [line for line, _ in spelled(source, names)] == [2, 3, 4, 6]


def test_only_the_owner_spells_the_run_folder_names():
    names = layout_names()
    assert {"consolidated.pt", "checkpoints", "metrics.jsonl", ".lock", "job.json", "glue_eval"} <= names
    found = [f"{path.relative_to(REPO)}:{line}: {text!r}" for package in SOURCES
             for path in sorted((REPO / package).rglob("*.py")) if path != OWNER
             for line, text in spelled(path.read_text(), names)]
    assert found == []


def test_the_run_that_holds_a_path(tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "0000000010"
    step.mkdir(parents=True)
    for name in ("consolidated.pt", "best.pt"):
        (run / name).write_bytes(b"")
    folder = RunFolder(run)
    assert [RunFolder.of(p) for p in (run, step, run / "consolidated.pt", run / "best.pt", str(step))] == [folder] * 5
    assert folder.checkpoints == step.parent and folder.consolidated == run / "consolidated.pt"
    assert folder.evaluation("glue", run / "consolidated.pt") == run / "glue_eval" / "consolidated"
    assert folder.evaluation("mteb", step) == run / "mteb_eval" / step.name
    with pytest.raises(ValueError):
        folder.evaluations("probes")


def test_a_run_is_finished_once_it_has_its_consolidated_weights(tmp_path):
    folder = RunFolder(tmp_path)
    folder.checkpoints.mkdir()
    assert not folder.finished
    folder.consolidated.write_bytes(b"")
    assert folder.finished


def test_one_loader_takes_an_app_s_name_or_its_module(tmp_path, monkeypatch):
    assert load_app("bert") is load_app("apps.bert.train")
    assert load_app("crossbert").name == "apps.crossbert.train"
    for name in ("apps.nothing.train", "apps.bert.model", "", "../bert"):  # no APP there, or not a module name
        with pytest.raises(UserError, match="unknown app"):
            load_app(name)
    (tmp_path / "brokenapp").mkdir()
    (tmp_path / "brokenapp" / "__init__.py").write_text("")
    (tmp_path / "brokenapp" / "train.py").write_text("import a_module_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(ModuleNotFoundError, match="a_module_nobody_installed"):  # the app's own import fails
            load_app("brokenapp")
    finally:
        sys.modules.pop("brokenapp", None)
