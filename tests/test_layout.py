"""The code's layout: the modules of lingua/, apps/ and tools/ import each other in one direction only (no circle)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("lingua", "apps", "tools")


def module_files() -> dict[str, Path]:
    """Every module of the packages by its dotted name (a package by its own name, from its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The modules of the packages that a module imports, at its top or inside a function: `from a import b` names
    the module a.b when there is one, else a."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                      for alias in node.names}
    return found & modules.keys()


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(ast.parse(path.read_text()), modules) - {name} for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each set of modules that reach each other (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_circles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_lingua_apps_and_tools():
    graph = import_graph()
    assert {"lingua.stool", "lingua.jobs.pipeline", "lingua.jobs.launcher"} <= graph.keys()  # the files are found
    assert "lingua.jobs.launcher" in graph["lingua.jobs.pipeline"]  # and their imports, inside functions too
    assert circles(graph) == []


def test_layers_import_downwards_only():
    """lingua/ is the core, apps/ build on it, tools/ run over apps: no module imports a layer above its own."""
    layer = {package: rank for rank, package in enumerate(PACKAGES)}
    upward = sorted((module, target) for module, targets in import_graph().items() for target in targets
                    if layer[target.split(".")[0]] > layer[module.split(".")[0]])
    assert upward == []


def core_unit(module: str) -> str:
    """The part of lingua/ a module belongs to: its sub-package (`lingua.checkpoint`), else the top module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (REPO / Path(*parts)).is_dir() else module


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for a module that imports none of the others, else one above the highest it imports."""
    found: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in found:
            found[module] = 1 + max((floor(target) for target in graph[module]), default=0)
        return found[module]

    return {module: floor(module) for module in graph}


def core_graph() -> dict[str, set[str]]:
    return {module: {t for t in targets if t.startswith("lingua")} for module, targets in import_graph().items()
            if module.startswith("lingua")}


def test_the_core_is_grouped_by_concept_and_shallow():
    """At most 15 modules side by side at the top of lingua/ (the rest in a sub-package per concept), and at most 10
    floors in its import graph."""
    top = sorted(path.name for path in (REPO / "lingua").glob("*.py"))
    assert len(top) <= 15, top
    assert floors({"a": {"b"}, "b": {"c"}, "c": set()}) == {"a": 3, "b": 2, "c": 1}
    deepest = max(floors(core_graph()).values())
    assert 5 <= deepest <= 10


def declared_map() -> list[tuple[str, set[str]]]:
    """docs/design.md's map of lingua/, bottom up: each package (or top module) and the ones its row says it imports."""
    rows = []
    section = (REPO / "docs" / "design.md").read_text().split("## The map of lingua/")[1].split("\n## ")[0]
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0] != "`where`":
            name = "lingua." + cells[0].strip("`").removesuffix("/").removesuffix(".py")
            rows.append((name, {"lingua." + word for word in re.findall(r"`([a-z_]+)`", cells[2])}))
    return rows


def test_the_core_packages_import_downwards_only():
    """The packages of lingua/ (and its top modules) import what the map in docs/design.md says, each only packages
    listed above it: no two import each other, through any path. A package's `__main__` is a command, above all."""
    graph: dict[str, set[str]] = {}
    for module, targets in core_graph().items():
        if module.endswith(".__main__"):
            continue
        unit = core_unit(module)
        graph.setdefault(unit, set()).update(core_unit(t) for t in targets if core_unit(t) != unit)
    graph.pop("lingua")  # the empty package itself
    declared = declared_map()
    assert [name for name, _ in declared] and {name for name, _ in declared} == graph.keys()
    below: set[str] = set()
    for name, imports in declared:
        assert graph[name] <= imports, f"{name} imports {sorted(graph[name] - imports)}, which its row in the map omits"
        assert imports <= below, f"{name}'s row names {sorted(imports - below)}, not below it in the map"
        below.add(name)
    assert circles(graph) == []


def test_the_job_commands_start_without_torch():
    """stool and a pipeline's stage jobs import no torch (2 s of CPU in each of the many processes a sweep or a
    pipeline starts); what checks a config or trains imports the app, and torch, when it does."""
    script = "import sys, lingua.stool, lingua.jobs.pipeline_stage; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
