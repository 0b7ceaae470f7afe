"""The recipes' helpers (`trl_exreplay.recipes`) that need no launch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import trl_exreplay
from trl_exreplay.recipes.launch import child_environment


def test_a_child_launch_imports_this_trl_exreplay_and_not_its_folders_as_packages():
    """The child's first path entry is the folder holding the package, never the package's own folder, where
    `trl_exreplay/alfworld` would shadow ALFWorld's `alfworld` (the recipe's warm start imports both)."""
    first = child_environment(None)["PYTHONPATH"].split(os.pathsep)[0]
    assert Path(first) == Path(trl_exreplay.__file__).resolve().parents[1]
    env = {**child_environment(None), "PYTHONPATH": first}
    probe = "import importlib.util, trl_exreplay; print(trl_exreplay.__file__, importlib.util.find_spec('alfworld'))"
    run = subprocess.run([sys.executable, "-c", probe], env=env, cwd="/", capture_output=True, text=True, check=True)
    package, spec = run.stdout.split(" ", 1)
    assert Path(package) == Path(trl_exreplay.__file__).resolve()
    assert "trl_exreplay" not in spec  # ALFWorld's package, or none where it is not installed
