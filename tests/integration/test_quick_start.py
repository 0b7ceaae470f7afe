"""A newcomer's walk: the README's "Quick start: the swap" and its offline twin, examples/quick_start_offline.py.

The README's script needs the Hub (a Qwen model, a DeepMath dataset) and a GPU; the twin is that script with a tiny
local model and a small local dataset, on the CPU. One test holds the two scripts to exactly those differences, so
that the twin cannot drift from what the README shows; the other runs the twin (.ci/run also runs it on the installed
wheel, through tools/wheel_smoke.py).
"""

from __future__ import annotations

import ast
import difflib
import re

import pytest
from helpers import REPOSITORY, load_script


def readme_script() -> str:
    """The README's quick-start script with its diff applied: context and added lines, removed lines dropped."""
    readme = (REPOSITORY / "README.md").read_text()
    (diff,) = re.findall(r"^## Quick start: the swap\n.*?^```diff\n(.*?)^```", readme, re.S | re.M)
    return "\n".join(line[1:] for line in diff.splitlines() if not line.startswith("-"))


def statements(source: str) -> list[ast.stmt]:
    body = ast.parse(source).body
    has_docstring = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1:] if has_docstring else body


def keywords(statement: ast.stmt) -> dict[str, str]:
    return {k.arg: ast.unparse(k.value) for k in statement.value.keywords}


def names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


@pytest.mark.fast  # in the fast lane: no training
def test_the_offline_twin_differs_from_the_readme_only_in_model_and_dataset():
    readme = statements(readme_script())
    twin = statements((REPOSITORY / "examples" / "quick_start_offline.py").read_text())
    before, after = [ast.unparse(s) for s in readme], [ast.unparse(s) for s in twin]
    changed = {}  # what each changed statement binds ("dataset", "args", "trainer"; "import") -> (README's, twin's)
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag != "equal":
            assert tag == "replace" and i2 - i1 == j2 - j1, f"added or removed: {before[i1:i2]} -> {after[j1:j2]}"
            for old, new in zip(readme[i1:i2], twin[j1:j2]):
                key = "import" if isinstance(old, ast.ImportFrom) else ast.unparse(old.targets[0])
                assert key == ("import" if isinstance(new, ast.ImportFrom) else ast.unparse(new.targets[0]))
                changed[key] = (old, new)
    assert sorted(changed) == ["args", "dataset", "import", "trainer"], sorted(changed)

    # the trainer: the same call but for its model
    (old_trainer, new_trainer), (old_args, new_args) = changed["trainer"], changed["args"]
    old_kw, new_kw = keywords(old_trainer), keywords(new_trainer)
    assert old_kw.pop("model") != new_kw.pop("model") and old_kw == new_kw
    assert ast.unparse(old_trainer.value.func) == ast.unparse(new_trainer.value.func)
    # the config: the same, plus use_cpu (TRL's default bf16 refuses a machine without a GPU otherwise)
    assert keywords(new_args) == {**keywords(old_args), "use_cpu": "True"}
    assert ast.unparse(old_args.value.func) == ast.unparse(new_args.value.func)
    # the changed import brings what the dataset and model lines use, nothing else
    for side in (0, 1):
        imported = {alias.asname or alias.name for alias in changed["import"][side].names}
        model = next(k.value for k in changed["trainer"][side].value.keywords if k.arg == "model")
        assert imported <= names(changed["dataset"][side].value) | names(model)


def test_the_offline_quick_start_trains_and_replays(tmp_path):
    load_script("tools/wheel_smoke.py", "wheel_smoke").walk_quick_start(tmp_path)
