"""The results line, the paragraph README.md's first screen, docs/trainer.md and docs/results.md share, says what the
pre-registered results files say: the same text in all three, and each figure recomputed from
docs/results/preregistered/ by the harness's own summary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import load_script

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- results-line:.*?-->\n(.*?)<!-- /results-line -->", re.DOTALL)


@pytest.fixture(scope="module")
def harness():
    return load_script("benchmarks/replay_vs_grpo.py", "replay_vs_grpo")


def results_line(path: Path) -> str:
    blocks = BLOCK.findall(path.read_text())
    assert len(blocks) == 1, f"{path}: one results line"
    return " ".join(blocks[0].split())


def summary(harness, testbed: str, baseline: str, method: str) -> dict:
    results = harness.load_results(REPO / "docs" / "results" / "preregistered" / testbed)
    (entry,) = results["testbeds"].values()
    return next(row for row in harness.summarize(entry, baseline) if row["method"] == method)


def interval(row: dict) -> str:
    d = row["paired_difference"]
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def test_readme_the_trainer_page_and_the_results_page_share_one_results_line():
    readme = results_line(REPO / "README.md")
    assert readme == results_line(REPO / "docs" / "results.md") == results_line(REPO / "docs" / "trainer.md")


def test_the_results_line_figures_are_the_results_files(harness):
    line = results_line(REPO / "README.md")
    testbeds = ("single-turn", "multi-turn", "alfworld-few-games")
    defaults = [summary(harness, t, "grpo", "exreplay") for t in testbeds]
    exgrpo = [summary(harness, t, "exreplay", "exgrpo") for t in testbeds]
    for row in defaults + exgrpo:
        assert interval(row) in line
    assert [len(row["seeds"]) for row in defaults] == [20, 20, 5] and "20 per testbed, 5 on ALFWorld" in line
    doors = defaults[1]["sign_test"]
    assert f"{doors['wins']} seeds above and {doors['losses']} below (sign test p = {doors['p']:.2f})" in line
    grpo_collapses = round(summary(harness, "multi-turn", "exreplay", "grpo")["collapse_rate"] * 20)
    default_collapses = round(defaults[1]["collapse_rate"] * 20)
    assert f"GRPO collapsed on more seeds ({grpo_collapses} of 20, the defaults on {default_collapses})" in line
    assert all(row["paired_difference"]["mean"] < 0 for row in exgrpo) and "below the defaults on all three" in line
