"""The code's layout: the modules of lingua/, apps/ and tools/ import each other in one direction only (no circle)."""

import ast
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
