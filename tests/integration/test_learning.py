"""The trainer learns where learning is easy: on the key-and-door game, ExReplay GRPO with replay raises the success of
a randomly initialised tiny model, measured on sampled episodes played apart from training. The run is
`benchmarks/key_door_learning.py`'s, where `--fault` shows which faults this measure sees: advantages negated or paired
with the wrong episodes, yes; the replayed rows' advantages alone negated, no (fresh rows carry most of the gain)."""

from __future__ import annotations

import pytest
from helpers import load_script


def load_benchmark():
    return load_script("benchmarks/key_door_learning.py", "key_door_learning")


@pytest.mark.slow
def test_exreplay_grpo_raises_the_success_of_an_easy_game(tmp_path):
    result = load_benchmark().train_key_door(str(tmp_path / "out"))
    # Measured when this test was written (2 cores, trl 1.16.0): 0.115 before, 0.594 after (0.667 on another 2-core
    # machine), replayed rows in 42 of 60 steps (up to 25% of a step's rows). With every advantage negated the run
    # ends at 0.000, with each row given its neighbour's advantage at 0.104: both fail the last assertion.
    assert result["replay_steps"] >= 30  # the replay path trained too, not only plain GRPO
    assert result["before"] < 0.3
    assert result["after"] >= result["before"] + 0.3, result


def test_an_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="allowed values are 'none', 'negated', 'shifted', 'replayed-negated'"):
        with load_benchmark().fault_in_loss("flipped"):
            pass
