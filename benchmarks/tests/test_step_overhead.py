"""`benchmarks/step_overhead.py --against`: each round runs the script on each checkout's library, and the figures it
reads back are the ones the run printed."""

import re
from pathlib import Path

from helpers import load_script

REPO = Path(__file__).resolve().parents[2]


def test_against_reads_back_the_step_times_each_run_printed(capsys):
    overhead = load_script("benchmarks/step_overhead.py", "step_overhead")
    results = overhead.main(["--against", str(REPO), "--rounds", "1", "--max-steps", "2"])
    printed = capsys.readouterr().out
    runs = results["single-turn"]
    assert list(runs) == ["this", "against"] and all(len(r) == 1 for r in runs.values())
    for run in (run for name in runs for run in runs[name]):
        assert run["grpo_ms"] > 0 and run["exreplay_ms"] > 0
        assert run["ratio"] == run["exreplay_ms"] / run["grpo_ms"]
        assert run["median_ratio"] == run["exreplay_median_ms"] / run["grpo_median_ms"]
    first = runs["this"][0]
    line = f"round 1: this {first['grpo_median_ms']:.1f} {first['exreplay_median_ms']:.1f} {first['median_ratio']:.3f}"
    assert line in printed
    assert {run["library"] for name in runs for run in runs[name]} == {str(REPO / "trl_exreplay" / "__init__.py")}
    assert re.search(r"^  median_ratio +this [0-9.]+ ± [0-9.]+ +against ", printed, re.MULTILINE)


def test_the_step_lines_are_read_from_the_table_and_not_from_the_ratio_line():
    overhead = load_script("benchmarks/step_overhead.py", "step_overhead")
    table = (
        "  other   8.3   11.1\n  step   63.8   74.6\n  step, median   60.1   70.2\n  step time ratio 1.169; generation"
    )
    mean, median = overhead.STEP_LINE.search(table), overhead.MEDIAN_LINE.search(table)
    assert (mean[1], mean[2], median[1], median[2]) == ("63.8", "74.6", "60.1", "70.2")
