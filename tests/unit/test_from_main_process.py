"""`distributed.from_main_process`: rank 0's result, or rank 0's error, on every rank. The broadcast itself is
exercised by the multi-process launches (tests/distributed); here it is replaced, to reach the error paths."""

from __future__ import annotations

from types import SimpleNamespace

import accelerate.utils
import pytest

from trl_exreplay.distributed import from_main_process


def rank(index: int):
    return SimpleNamespace(num_processes=2, is_main_process=index == 0)


def test_a_single_process_reads_in_place():
    assert from_main_process(SimpleNamespace(num_processes=1, is_main_process=True), lambda: 7) == 7


def test_rank_0_sends_its_result_or_its_error_and_no_rank_is_left_waiting(monkeypatch):
    sent = []

    def broadcast(objects, from_process=0):  # rank 0 sends; the others receive what it sent
        if not sent:
            sent.append(list(objects))
        return list(sent[0])

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    assert from_main_process(rank(0), lambda: {"rows": [1]}) == {"rows": [1]}
    assert from_main_process(rank(1), lambda: pytest.fail("only rank 0 reads")) == {"rows": [1]}

    sent.clear()

    def fail():
        raise FileNotFoundError("shard traj-000003 is gone")

    with pytest.raises(FileNotFoundError, match="traj-000003"):  # rank 0: its own error, after sending it
        from_main_process(rank(0), fail)
    with pytest.raises(RuntimeError, match="main process failed.*FileNotFoundError: shard traj-000003 is gone"):
        from_main_process(rank(1), lambda: None)
