"""The package's import graph: no module imports itself back through others, the pool package stands on its own, and
every module imports alone in a fresh interpreter (`python -c "import trl_exreplay.x"`).

Imports under ``if TYPE_CHECKING:`` count: they never run, but a module that needs another's types for its annotations
depends on it all the same, and a circle hidden that way is still a circle for the reader."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trl_exreplay"


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports: at the top, inside functions (lazy imports run) and under
    ``if TYPE_CHECKING:``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module or ""
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in child.names)  # `from pkg import submodule`
            visit(child)

    visit(ast.parse(path.read_text()))
    # A module's own parent packages are not edges: Python runs them before it, whatever it imports (`from . import x`
    # names the package only to reach x).
    return {module for module in found if module in known and module != name and not name.startswith(module + ".")}


def import_graph() -> dict[str, set[str]]:
    known = module_names()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_checker_finds_a_planted_circle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    hidden = tmp_path / "m.py"  # an import only type checkers run is an edge all the same
    hidden.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    assert imports_of("pkg.m", hidden, {"pkg.m": hidden, "pkg.b": hidden}) == {"pkg.b"}


def test_no_module_imports_itself_back():
    graph = import_graph()
    assert "trl_exreplay.pool.experience_pool" in graph and "trl_exreplay.trainer" in graph
    assert graph["trl_exreplay.pool.hub"] >= {"trl_exreplay.pool.experience_pool"}  # the checker sees real edges
    assert cycles(graph) == []


def test_the_pool_package_depends_on_nothing_of_the_trainer():
    """The pool is a library of its own: it imports nothing of the rest of trl_exreplay (the planner draws from the
    pool's `TaskBuckets`, not the other way round)."""
    graph = import_graph()
    for name, imported in graph.items():
        if name.startswith("trl_exreplay.pool"):
            outside = {m for m in imported if not m.startswith("trl_exreplay.pool")}
            assert outside <= {"trl_exreplay"}, (name, outside)
    rules = PACKAGE / "pool" / "rules.py"
    assert imports_of("trl_exreplay.pool.rules", rules, module_names()) == set()  # pure: numpy only


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PACKAGE.parent)}

    def import_alone(name):
        run = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env)
        return name, run.returncode, run.stderr[-2000:]

    with ThreadPoolExecutor(max_workers=4) as workers:
        failed = [(n, err) for n, code, err in workers.map(import_alone, sorted(module_names())) if code != 0]
    assert failed == []
