"""The package's import graph: no module imports itself back through others, the pool package stands on its own, the
core imports no optional part (and trains without them), the optional parts import only what their place in the tree
allows, and every module imports alone in a fresh interpreter (`python -c "import trl_exreplay.x"`).

Imports under ``if TYPE_CHECKING:`` count: they never run, but a module that needs another's types for its annotations
depends on it all the same, and a circle hidden that way is still a circle for the reader."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
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
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found |= imported_modules(name, path, node, known)
    return found


def imported_modules(name: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> set[str]:
    """The package's modules one import statement of module `name` (at `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if isinstance(node, ast.Import):
        found = {alias.name for alias in node.names}
    else:
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        found = {module} | {f"{module}.{alias.name}" for alias in node.names}  # `from pkg import submodule`
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


# The optional parts (docs/architecture.md), and which other optional parts each may import: the multi-turn engine,
# guidance, the demo helpers and the recipes' helpers stand on the core alone; ALFWorld is an environment of the engine,
# trained from a demo-sized model by the recipes' helpers.
OPTIONAL_PARTS = {
    "trl_exreplay.envs": set(),
    "trl_exreplay.guidance": set(),
    "trl_exreplay.demo": set(),
    "trl_exreplay.recipes": set(),
    "trl_exreplay.alfworld": {"trl_exreplay.envs", "trl_exreplay.demo", "trl_exreplay.recipes"},
}
# Where the core may import an optional part: the trainer's composition point, when an argument asks for the part.
COMPOSITION_POINT = {"trl_exreplay.trainer": {"_attach_parts", "__init__"}}


def part_of_module(name: str) -> str | None:
    return next((part for part in OPTIONAL_PARTS if name == part or name.startswith(part + ".")), None)


def imports_by_place(path: Path) -> list[tuple[str | None, bool, ast.ImportFrom | ast.Import]]:
    """Every import of a module with the function it sits in (None: the module's top) and whether it runs only for
    type checkers (``if TYPE_CHECKING:``)."""
    found = []

    def visit(node, function, typing_only):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((function, typing_only, child))
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            checking = isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING"
            visit(child, inner, typing_only or checking)

    visit(ast.parse(path.read_text()), None, False)
    return found


def test_the_core_imports_no_optional_part():
    """The replay core (the package's top level and `pool/`) imports no optional part when it is imported: the trainer
    makes a part only in its composition point (`_attach_parts`), when an argument asks for it, and names the parts'
    settings for type checkers only."""
    known = module_names()
    offending = []
    for name, path in known.items():
        if name == "trl_exreplay" or part_of_module(name):  # the package's lazy facade names the parts' settings
            continue
        for function, typing_only, node in imports_by_place(path):
            modules = imported_modules(name, path, node, known)
            if not any(part_of_module(m) for m in modules) or typing_only:
                continue
            if function not in COMPOSITION_POINT.get(name, set()):
                offending.append((name, function, ast.unparse(node)))
    assert offending == []
    attached = [ast.unparse(n) for f, _, n in imports_by_place(known["trl_exreplay.trainer"]) if f == "_attach_parts"]
    assert attached and all("envs" in line or "guidance" in line for line in attached)  # the checker sees them


def test_every_folder_of_the_package_is_a_package_git_tracks():
    """A folder without `__init__.py` still imports (a namespace package) but is left out of the wheel; a file the
    repository ignores is left out of every clean checkout (the recipes' helpers once sat in an ignored `runs/`)."""
    folders = {path.parent for path in PACKAGE.rglob("*.py")}
    assert [f for f in folders if not (f / "__init__.py").exists()] == []
    if not (PACKAGE.parent / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    files = [str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*") if path.is_file()]
    run = subprocess.run(["git", "check-ignore", "--no-index", *files], cwd=PACKAGE.parent, capture_output=True,
                         text=True)  # fmt: skip
    ignored = [f for f in run.stdout.split() if "__pycache__" not in f and not f.endswith(".pyc")]
    assert ignored == []


def test_each_optional_part_imports_only_the_parts_below_it():
    graph = import_graph()
    for name, imported in graph.items():
        part = part_of_module(name)
        if part is None:
            continue
        others = {part_of_module(m) for m in imported} - {None, part}
        assert others <= OPTIONAL_PARTS[part], (name, others)


CORE_ALONE = """
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):  # the optional parts, as if their folders were deleted
    def find_spec(self, name, path=None, target=None):
        if name.startswith({parts!r}):
            raise ImportError(f"optional part {{name}} refused")
        return None

sys.meta_path.insert(0, Refuse())
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer

tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
dataset = Dataset.from_dict({{"prompt": [[{{"role": "user", "content": "say yes"}}]] * 8, "task_id": list("ab") * 4}})
trainer = ExReplayGRPOTrainer(
    model=AutoModelForCausalLM.from_pretrained(sys.argv[1]),
    reward_funcs=lambda completions, **kwargs: [float("yes" in c[0]["content"]) for c in completions],
    args=ExReplayGRPOConfig(output_dir=sys.argv[2], num_generations=4, per_device_train_batch_size=8, max_steps=3,
                            max_completion_length=4, replay_start_ratio=0.0, use_cpu=True, report_to="none",
                            learning_rate=0.5, logging_steps=1, save_strategy="no"),
    train_dataset=dataset,
    processing_class=tokenizer,
)
trainer.train()
assert not any(m.startswith({parts!r}) for m in sys.modules), sorted(m for m in sys.modules if "trl_exreplay." in m)
print("trajectories", trainer.pool.num_trajectories)
"""


@pytest.mark.slow
def test_the_core_trains_with_every_optional_part_deleted(tmp_path):
    """Single-turn replay on a tiny model in a process where importing any optional part fails, as if its folder were
    deleted: the core trains and fills its pool alone."""
    from trl_exreplay.demo.tiny import save_tiny_model

    model_dir = tmp_path / "model"
    save_tiny_model(str(model_dir), ["say", "yes", "no", "maybe"])
    script = CORE_ALONE.format(parts=tuple(OPTIONAL_PARTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PACKAGE.parent)}
    run = subprocess.run([sys.executable, "-c", script, str(model_dir), str(tmp_path / "out")], capture_output=True,
                         text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.splitlines()[-1].startswith("trajectories ")


# Imported once by the process that forks each module's import (below): third-party packages only, never ours, so that
# every module of ours still imports alone; they are what makes a fresh interpreter's import of one module take seconds.
THIRD_PARTY = (
    "numpy",
    "pyarrow",
    "torch",
    "transformers",
    "datasets",
    "accelerate",
    "trl",
    "trl.trainer.grpo_trainer",
)
IMPORT_EACH = """
import importlib, os, sys
for name in {third_party!r}:
    importlib.import_module(name)
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:  # the child: the module alone, on top of the third-party packages; its exit code says how it went
        try:
            importlib.import_module(name)
        except BaseException as error:
            print(f"{{name}}: {{type(error).__name__}}: {{error}}", file=sys.stderr, flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if status:
        failed.append(name)
print(" ".join(failed))
"""


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    """One process imports the third-party packages, then forks one child per module of ours, which imports that
    module alone: a module that imports only after another of ours has been imported fails here (a fresh interpreter
    per module found the same in 40 s on 2 cores; this takes a few)."""
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PACKAGE.parent)}
    script = IMPORT_EACH.format(third_party=THIRD_PARTY)
    run = subprocess.run([sys.executable, "-c", script, *sorted(module_names())], capture_output=True, text=True,
                         env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.split() == [], run.stderr[-4000:]


def test_the_import_check_fails_a_module_that_needs_another_imported_first(tmp_path):
    """The forked check sees an order dependency: `b` works only once `a` has put a name into the package."""
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import planted\nplanted.value = 1\n")
    (package / "b.py").write_text("import planted\nprint(planted.value)\n")
    script = IMPORT_EACH.format(third_party=())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script, "planted.a", "planted.b"], capture_output=True, text=True,
                         env=env)  # fmt: skip
    assert run.stdout.split() == ["planted.b"] and "AttributeError" in run.stderr
