"""No import circle between profstream's modules.

Every ``import`` and ``from ... import`` in profstream/**/*.py counts, wherever it is:
at module level, inside a function, under ``if TYPE_CHECKING:``. A circle means two
modules that are really one, or a piece that belongs in a third module both import
(docs/architecture.md). Importing a submodule is not counted as importing its package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "profstream"


def module_names() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` refers to: itself, else its longest prefix that is a module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The profstream modules that ``module`` imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, or a name in base
        else:
            continue
        for name in names:
            target = _target(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a list of modules, the first repeated at the end) per strongly connected
    group of modules (Tarjan), in name order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(_circle(graph, g) for g in groups)


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the first module (by name) of a strongly connected group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles between modules:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walk_sees_every_kind_of_import() -> None:
    """The check itself: a module-level, a function-level and a TYPE_CHECKING import each
    make an edge, and a circle made of them is named."""
    graph = import_graph()
    assert "profstream.producers.monitor" in graph["profstream"]  # from profstream.producers.monitor import ...
    assert "profstream.kafka.clients" in graph["profstream.processors.runtime"]  # inside a function
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("package", ["producers", "integrations", "processors", "sinks", "offline", "stack", "kafka"])
def test_each_role_has_its_package(package: str) -> None:
    assert (PACKAGE / package / "__init__.py").is_file()


if __name__ == "__main__":  # print the circles (for a before/after report)
    for c in cycles(import_graph()):
        print(" -> ".join(c))
