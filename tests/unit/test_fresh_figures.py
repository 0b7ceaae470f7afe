"""TRL's completion figures taken again over the fresh rows (`metrics.log_fresh_completions`, issue 70): lengths counted
as TRL counts them (model tokens where there is a tool mask), clipped when the last token is neither eos nor padding, and
TRL's tool calls per row over the fresh rows (replayed rows make none)."""

from __future__ import annotations

from collections import defaultdict

import pytest
from accelerate import Accelerator

from trl_exreplay.metrics import COMPLETION_FIGURES, log_fresh_completions

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def _logged_by_trl(**values) -> dict[str, list]:
    """A metrics dict as TRL leaves it after `_generate`: a window's earlier batch, then this batch's value last."""
    metrics = defaultdict(list)
    for name in COMPLETION_FIGURES:
        metrics[name] = [-1.0, values.get(name, -1.0)]
    return metrics


def test_the_completion_figures_are_the_fresh_rows(accelerator):
    completions = [[5, 6, EOS], [5, 6, 7, 8], [5, EOS], [5, 6, 7, 8, 9, 9]]  # the second and last are clipped
    metrics = _logged_by_trl()
    log_fresh_completions(metrics, accelerator, completions, None, [True, True, True, False], [EOS, PAD])
    got = {name: metrics[name] for name in COMPLETION_FIGURES}
    assert got == {
        "completions/mean_length": [-1.0, 3.0],  # (3 + 4 + 2) / 3: the replayed row (6 tokens) left out
        "completions/min_length": [-1.0, 2.0],
        "completions/max_length": [-1.0, 4.0],
        "completions/clipped_ratio": [-1.0, pytest.approx(1 / 3)],
        "completions/mean_terminated_length": [-1.0, 2.5],
        "completions/min_terminated_length": [-1.0, 2.0],
        "completions/max_terminated_length": [-1.0, 3.0],
    }


def test_model_tokens_are_counted_and_tool_calls_are_per_fresh_row(accelerator):
    """With a tool mask, a length is the model's tokens (tool results left out), as TRL counts it. TRL logged 3 tool
    calls over 4 rows (0.75); the replayed row made none: 3 calls over the 2 fresh rows."""
    completions = [[5, 6, 7, EOS], [5, 6, 7, 8, 9, EOS], [5, EOS], [5, EOS]]
    tool_mask = [[1, 0, 0, 1], [1, 1, 0, 0, 1, 1], [1, 1], [1, 1]]
    metrics = _logged_by_trl()
    metrics["tools/call_frequency"] = [0.5, 3 / 4]
    log_fresh_completions(metrics, accelerator, completions, tool_mask, [True, True, False, False], [EOS, PAD])
    assert metrics["completions/mean_length"] == [-1.0, 3.0]  # (2 + 4) / 2
    assert metrics["completions/clipped_ratio"] == [-1.0, 0.0]
    assert metrics["completions/min_terminated_length"] == [-1.0, 2.0]
    assert metrics["tools/call_frequency"] == [0.5, 1.5]


def test_no_terminated_fresh_row_gives_trls_zero(accelerator):
    metrics = _logged_by_trl()
    log_fresh_completions(metrics, accelerator, [[5, 6], [5, EOS]], None, [True, False], [EOS, PAD])
    assert metrics["completions/clipped_ratio"] == [-1.0, 1.0]
    assert metrics["completions/mean_terminated_length"] == [-1.0, 0.0]  # TRL's figure when no completion ended
