"""The bounded `accelerate launch` of the multi-process tests: a hang fails with each rank's stack and leaves nothing
running, and a JIT-build lock left by the killed launch does not outlive it."""

from __future__ import annotations

import os

import pytest
from launching import accelerate_launch, extensions_dir

HANGING_RANK = """
import os, sys, time
from pathlib import Path

def wait_forever():
    Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)

wait_forever()
"""


def test_a_hanging_launch_fails_with_each_ranks_stack_and_leaves_nothing_running(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGING_RANK)
    lock = extensions_dir() / "an_op" / "lock"  # as a DeepSpeed build killed midway leaves it
    lock.parent.mkdir(exist_ok=True)
    lock.touch()

    with pytest.raises(pytest.fail.Exception) as failure:
        accelerate_launch("recipes/accelerate/ddp_cpu.yaml", script, tmp_path, timeout=20)

    message = str(failure.value)
    assert "no exit within 20s" in message
    assert message.count("in wait_forever") == 2, message  # both ranks printed where they were
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not lock.exists()
