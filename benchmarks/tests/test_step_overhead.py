"""`benchmarks/step_overhead.py --against`: each round runs each checkout's own script on its own library, and the
figures it reads back are the ones that script printed."""

from pathlib import Path

from helpers import load_script

REPO = Path(__file__).resolve().parents[2]


def test_against_reads_back_each_checkouts_printed_step_times(capsys):
    overhead = load_script("benchmarks/step_overhead.py", "step_overhead")
    results = overhead.main(["--against", str(REPO), "--rounds", "1", "--max-steps", "2"])
    printed = capsys.readouterr().out
    runs = results["single-turn"]
    assert list(runs) == ["this", "against"] and all(len(r) == 1 for r in runs.values())
    for run in (run for name in runs for run in runs[name]):
        assert run["grpo_ms"] > 0 and run["exreplay_ms"] > 0
        assert run["ratio"] == run["exreplay_ms"] / run["grpo_ms"]
    first = runs["this"][0]
    assert f"round 1: this {first['grpo_ms']:.1f} {first['exreplay_ms']:.1f} {first['ratio']:.3f}" in printed
    assert {run["library"] for name in runs for run in runs[name]} == {str(REPO / "trl_exreplay" / "__init__.py")}
    assert "ratio        this" in printed


def test_the_step_line_is_read_from_the_table_and_not_from_the_ratio_line():
    overhead = load_script("benchmarks/step_overhead.py", "step_overhead")
    table = "  loss and backward   31.5   34.1\n  step                63.8   74.6\n  step time ratio 1.169; generation saved"
    found = overhead.STEP_LINE.search(table)
    assert (found[1], found[2]) == ("63.8", "74.6")
