"""The examples in the docs run: every ```python block of the public docstrings listed here (each in a fresh
interpreter, in an empty folder, as a script), the doctests of `trl_exreplay.loss`, and the blocks of docs/*.md that
are marked runnable (an HTML comment `<!-- runnable -->` on the line before the block)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
RUNNABLE = re.compile(r"<!-- runnable -->\n```python\n(.*?)```", re.S)

# The public objects whose docstring examples are complete programs (issue 29: config, trainer, pool, loss, TextEnv,
# EnvProcessPool); an example that needs the reader's own model or data (with `...`) is not listed.
DOCSTRINGS = [
    "trl_exreplay.config:ExReplayGRPOConfig",
    "trl_exreplay.trainer:ExReplayGRPOTrainer",
    "trl_exreplay.pool.experience_pool:ExperiencePool",
    "trl_exreplay.pool.rules:",
    "trl_exreplay.schedule:",
    "trl_exreplay.spread:",
    "trl_exreplay.outcomes:",
    "trl_exreplay.pool.store:",
    "trl_exreplay.envs.base:TextEnv",
    "trl_exreplay.envs.process:EnvProcessPool",
    "trl_exreplay.alfworld.arguments:AlfWorldArguments",
    "trl_exreplay.guidance.provider:",
    "trl_exreplay.guidance.allocation:",
    "trl_exreplay.guidance.template:",
    "trl_exreplay.guidance.summarizer:",
    "trl_exreplay.guidance.store:",
    "trl_exreplay.guidance.offline:",
    "trl_exreplay.guidance.reme:",
    "trl_exreplay.untrusted_text:",
    "trl_exreplay.trl_seam:check_trl_version",
]


def docstring_blocks(target: str) -> list[str]:
    module, _, name = target.partition(":")
    obj = importlib.import_module(module)
    obj = getattr(obj, name) if name else obj
    return BLOCK.findall(inspect.getdoc(obj) or "")


def run_block(code: str, folder: Path) -> subprocess.CompletedProcess:
    script = folder / "example.py"  # a file, not -c: spawned worker processes re-import the main script
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPOSITORY), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(script)], cwd=folder, capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize("target", DOCSTRINGS)
def test_docstring_examples_run(target, tmp_path):
    blocks = docstring_blocks(target)
    assert blocks, f"{target} has no ```python example"
    for code in blocks:
        result = run_block(code, tmp_path)
        assert result.returncode == 0, f"{target}:\n{code}\n{result.stderr[-3000:]}"


def test_the_loss_doctests_pass():
    module = importlib.import_module("trl_exreplay.loss")
    failures, tried = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert tried > 0 and failures == 0


def test_runnable_blocks_of_the_docs_run(tmp_path):
    blocks = [
        (page.name, code)
        for page in sorted((REPOSITORY / "docs").rglob("*.md"))
        for code in RUNNABLE.findall(page.read_text())
    ]
    assert blocks, "no docs page marks a runnable block"
    for page, code in blocks:
        result = run_block(code, tmp_path)
        assert result.returncode == 0, f"{page}:\n{code}\n{result.stderr[-3000:]}"
