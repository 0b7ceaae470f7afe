"""The report's figures are read seed by seed: each one recomputed here by hand, on a small fixture whose mean curves
give other answers (so code that fell back to curves averaged over seeds would fail) and on one seed of the committed
pre-registered results files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import benchmark_module

pytestmark = pytest.mark.fast  # in the fast lane: no training

REPO = Path(__file__).resolve().parents[2]
PREREGISTERED = REPO / "docs" / "results" / "preregistered"


@pytest.fixture(scope="module")
def stats():
    return benchmark_module("replay_harness.statistics")


@pytest.fixture(scope="module")
def report():
    return benchmark_module("replay_harness.report")


@pytest.fixture(scope="module")
def results_file():
    return benchmark_module("replay_harness.results_file")


def run(curve, replay=True, **series):
    """A run from (fresh rollouts, held-out success, training seconds) points, 100 rollouts per evaluation."""
    points = [{"step": i, "fresh_rollouts": x, "heldout_success": y, "train_success": None, "wall_s": w}
              for i, (x, y, w) in enumerate(curve)]  # fmt: skip
    settings = {"per_device_train_batch_size": 100, "num_generations": 4, "enable_experience_replay": replay}
    return {"points": points, "losses": [], "replay": {}, "wall_s": curve[-1][2], "step_s": 1.0,
            "settings": settings, **series}  # fmt: skip


FIXTURE = {
    "methods": {
        "grpo": {"runs": {
            "1": run([(0, 0.1, 0), (100, 0.3, 10), (200, 0.5, 20)], replay=False, zero_std_groups=[0.5, 1.0]),
            "2": run([(0, 0.1, 0), (100, 0.1, 10), (200, 0.1, 20)], replay=False, zero_std_groups=[1.0, 0.5]),
        }},
        "replay": {"runs": {
            "1": run([(0, 0.1, 0), (90, 0.5, 12), (180, 0.4, 24)], zero_std_groups=[0.2, 0.4],
                     zero_std_fresh=[0.6, None]),
            "2": run([(0, 0.1, 0), (90, 0.3, 12), (180, 0.3, 24)], zero_std_groups=[0.2, 0.2],
                     zero_std_fresh=[0.8, None]),
        }},
    }
}  # fmt: skip


def test_every_figure_is_read_per_seed_on_a_small_fixture(stats, report):
    grpo, replay = stats.summarize(FIXTURE, "grpo", levels=(0.45,))

    # AUC over fresh rollouts, per seed, up to R = the fewest rollouts any method consumed on the seed (180 on both):
    # seed 1, grpo: (0.1 + 0.3) / 2 * 100 + (0.3 + 0.46) / 2 * 80 (0.46: its curve at 180) = 50.4, over 180.
    assert grpo["auc"]["rollouts"]["per_seed"]["1"] == pytest.approx(50.4 / 180)
    assert replay["auc"]["rollouts"]["per_seed"]["1"] == pytest.approx(
        ((0.1 + 0.5) / 2 * 90 + (0.5 + 0.4) / 2 * 90) / 180
    )
    assert grpo["auc"]["rollouts"]["per_seed"]["2"] == pytest.approx(0.1)
    assert replay["auc"]["rollouts"]["per_seed"]["2"] == pytest.approx(((0.1 + 0.3) / 2 * 90 + 0.3 * 90) / 180)
    differences = [67.5 / 180 - 50.4 / 180, 45 / 180 - 0.1]
    assert replay["auc"]["rollouts"]["paired"]["interval"]["mean"] == pytest.approx(sum(differences) / 2)
    assert replay["auc"]["rollouts"]["paired"]["sign"]["wins"] == 2

    # The same on training seconds: R = 20 (grpo's last wall_s); replay's curve at 20 is 0.5 - 0.1 * 8 / 12.
    assert grpo["auc"]["time"]["per_seed"]["1"] == pytest.approx(((0.1 + 0.3) / 2 * 10 + (0.3 + 0.5) / 2 * 10) / 20)
    at_20 = 0.5 - 0.1 * 8 / 12
    assert replay["auc"]["time"]["per_seed"]["1"] == pytest.approx(((0.1 + 0.5) / 2 * 12 + (0.5 + at_20) / 2 * 8) / 20)

    # Rollouts to the same seed's grpo final: seed 1's target 0.5, reached by grpo at 200 and by replay at 90 (0.45x);
    # seed 2's grpo ended at its start (0.1): not scoreable. The mean curves would say 60 / 200 = 0.30x.
    one = replay["to_final"]["per_seed"]["1"]
    assert (one["status"], one["need"], one["baseline_need"]) == ("reached", 90, 200)
    assert one["ratio"] == pytest.approx(0.45)
    assert replay["to_final"]["per_seed"]["2"]["status"] == "not scoreable"
    assert replay["to_final"]["ratio"] == {"median": pytest.approx(0.45), "geometric_mean": pytest.approx(0.45),
                                           "seeds": 1}  # fmt: skip
    assert (replay["to_final"]["never"], replay["to_final"]["not_scoreable"]) == (0, 1)
    assert stats.mean_curve_ratio(FIXTURE, "grpo", 0.3)["replay"] == pytest.approx(0.30)

    # A fixed level (0.45): seed 1, grpo at 100 + 100 * 0.15 / 0.2 = 175, replay at 90 * 0.35 / 0.4 = 78.75; seed 2:
    # neither reaches it, so half the seeds never do and the median is "never" (infinite).
    level = replay["levels"][0]
    assert level["need"] == {"1": pytest.approx(78.75), "2": None}
    assert grpo["levels"][0]["need"] == {"1": pytest.approx(175), "2": None}
    assert math.isinf(level["median"]) and level["never"] == 1 and level["not_scoreable"] == 0
    assert level["ratio"]["median"] == pytest.approx(78.75 / 175) and level["ratio"]["seeds"] == 1

    # Zero-spread groups: after insertion (TRL's) and fresh rollouts only; without replay every group is fresh.
    assert (grpo["zero_std_groups"], grpo["zero_std_fresh"], grpo["zero_std_fresh_source"]) == (
        0.75, 0.75, "every group fresh")  # fmt: skip
    assert replay["zero_std_groups"] == pytest.approx(0.25)
    assert (replay["zero_std_fresh"], replay["zero_std_fresh_source"]) == (pytest.approx(0.7), "recorded")

    table = report.markdown_table("t", {**FIXTURE, "summary": "fixture"}, "grpo")
    assert "| `replay` | 0.45x (0.45x) | 1 / 0 / 1 | 0.45x |" in table
    # seconds per step over the baseline's on the same seed (the fixture's runs: 1 s a step each)
    assert "- `replay`: median 1.00 (range 1.00-1.00, 2 seeds)" in table
    assert "| 1 | 0.100 | 0.500 / 0.280 / 200 | 0.400 / 0.375 / 0.45x |" in table
    assert "| 2 | 0.100 | 0.100 / 0.100 / n/s | 0.300 / 0.250 / n/s |" in table
    assert "| `replay` | 25.0% | 70.0% | not recorded |" in table
    assert "| `grpo` | 75.0% | 75.0% (every group fresh) | not recorded |" in table


def curve(run, axis):
    return [(p[axis], p["heldout_success"]) for p in run["points"]]


def first_reach(points, level):
    """By hand: the x at which the piecewise-linear curve first reaches `level`."""
    for (x0, y0), (x1, y1) in zip([points[0], *points], points):
        if y1 >= level:
            return x1 if y1 == y0 or x1 == x0 else x0 + (x1 - x0) * (level - y0) / (y1 - y0)
    return None


def area(points, end):
    """By hand: the trapezoids from 0 to `end`, the last one cut at `end`, over `end`."""
    total = 0.0
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 >= end:
            break
        if x1 > end:
            y1, x1 = y0 + (y1 - y0) * (end - x0) / (x1 - x0), end
        total += (x1 - x0) * (y0 + y1) / 2
    return total / end


def test_one_seed_of_the_committed_doors_game_results_by_hand(stats, results_file):
    """Seed 206 of the pre-registered doors game: `exreplay` against `grpo`, each figure of the report by hand."""
    (entry,) = results_file.load_results(PREREGISTERED / "multi-turn")["testbeds"].values()
    rows = {r["method"]: r for r in stats.summarize(entry, "grpo", levels=(0.10, 0.20))}
    runs = {name: method["runs"]["206"] for name, method in entry["methods"].items()}
    grpo, replay = runs["grpo"], runs["exreplay"]

    end = min(r["points"][-1]["fresh_rollouts"] for r in runs.values())  # every method of the comparison
    assert rows["exreplay"]["auc"]["rollouts"]["per_seed"]["206"] == pytest.approx(
        area(curve(replay, "fresh_rollouts"), end))  # fmt: skip
    assert rows["grpo"]["auc"]["rollouts"]["per_seed"]["206"] == pytest.approx(
        area(curve(grpo, "fresh_rollouts"), end)
    )
    seconds = min(r["points"][-1]["wall_s"] for r in runs.values())
    assert rows["exreplay"]["auc"]["time"]["per_seed"]["206"] == pytest.approx(area(curve(replay, "wall_s"), seconds))

    target = grpo["points"][-1]["heldout_success"]
    ratio = first_reach(curve(replay, "fresh_rollouts"), target) / first_reach(curve(grpo, "fresh_rollouts"), target)
    assert rows["exreplay"]["to_final"]["per_seed"]["206"]["ratio"] == pytest.approx(ratio)
    level = rows["exreplay"]["levels"][0]
    assert level["need"]["206"] == pytest.approx(first_reach(curve(replay, "fresh_rollouts"), 0.10))

    # Over all seeds: the per-seed reading (median 1.00x on the 10 scoreable seeds replay reached; 3 never; 7 where
    # grpo ended at 0) is not the mean curves' 0.38x.
    final = rows["exreplay"]["to_final"]
    assert (final["ratio"]["seeds"], final["never"], final["not_scoreable"]) == (10, 3, 7)
    assert final["ratio"]["median"] == pytest.approx(1.0, abs=0.005)
    mean_curve = stats.mean_curve_ratio(entry, "grpo", stats.method_curve(entry["methods"]["grpo"]["runs"])[1][-1])
    assert mean_curve["exreplay"] == pytest.approx(0.38, abs=0.005)
    # The committed runs recorded no fresh-only zero-spread share: the report says so rather than invent one.
    assert rows["exreplay"]["zero_std_fresh_source"] == "not recorded"
    assert rows["grpo"]["zero_std_fresh"] == rows["grpo"]["zero_std_groups"]


def test_labels_say_what_ran(stats, report, results_file):
    """ALFWorld's replay arm runs the recipe's YAML, not the library's defaults; the `exgrpo-noretire` runs made
    before the bucket clip (docs/results/runs_before_fixes.json, read for any folder under it) are marked with the
    steps whose buckets held counts above G."""
    (entry,) = results_file.load_results(PREREGISTERED / "alfworld-few-games")["testbeds"].values()
    fields = report.replay_fields(entry)
    assert (fields["replay_shaping"], fields["replay_start_ratio"], fields["replay_max_trajectories_per_task"]) == (
        "exgrpo", 0.25, 4)  # fmt: skip
    assert report.method_label("exreplay", "alfworld-few-games", entry) == "exreplay (the recipe's settings)"
    assert report.method_label("grpo", "alfworld-few-games", entry) == "grpo"
    table = report.markdown_table("alfworld-few-games", entry)
    assert "| `exreplay` (the recipe's settings) | 0.559 ± 0.037 |" in table

    (single,) = results_file.load_results(PREREGISTERED / "single-turn")["testbeds"].values()
    before_fixes = results_file.runs_before_fixes(PREREGISTERED / "single-turn")
    assert before_fixes == results_file.runs_before_fixes(REPO / "docs" / "results")
    rows = {r["method"]: r for r in stats.summarize(single, before_fixes=before_fixes)}
    early = rows["exgrpo-noretire"]["before_bucket_clip"]
    assert sorted(early, key=int) == [str(s) for s in range(200, 210)]
    assert (min(early.values()), max(early.values())) == (34, 296)
    assert rows["exgrpo"]["before_bucket_clip"] == {} and rows["exreplay"]["before_bucket_clip"] == {}
    table = report.markdown_table("single-turn", single, "grpo", before_fixes)
    assert "| `exgrpo-noretire` † |" in table
    assert f"runs were made before {before_fixes['bucket_clip']['fix']}, which counts a bucket above G" in table
    # the marks come from that file alone: without it no run is marked
    assert all(not r["before_bucket_clip"] for r in stats.summarize(single))
    assert "†" not in report.markdown_table("single-turn", single)


def test_the_median_counts_never_as_never_and_one_seed_dropped_can_flip_an_interval(stats):
    """The median ratio to the baseline's final over the seeds that reached it hides the ones that did not: counted as
    never (infinite), 3 never among 5 seeds make it "never", 1 among 4 moves it up. And the leave-one-out count: an
    interval above 0 that one seed carries."""

    def final(*statuses):
        return {str(i): ({"status": "reached", "ratio": v} if isinstance(v, float) else {"status": v})
                for i, v in enumerate(statuses)}  # fmt: skip

    assert stats.median_counting_never(final(0.5, 0.6, "never", "never", "never")) == math.inf
    assert stats.median_counting_never(final(0.5, 0.6, 0.7, "never", "not scoreable")) == pytest.approx(0.65)
    assert stats.median_counting_never(final("not scoreable")) is None

    # an interval above 0 by a hair: dropping any of the five larger gains moves it to contain 0
    differences = {"1": 0.01, "2": 0.012, "3": 0.008, "4": 0.011, "5": 0.003, "6": -0.004, "7": 0.001}
    loo = stats.leave_one_out(differences)
    assert loo["side"] == stats.interval_side(list(differences.values())) == "above 0"
    by_hand = []
    for seed in differences:
        rest = [d for s, d in differences.items() if s != seed]
        mean = sum(rest) / len(rest)
        half = (
            stats.T975[len(rest) - 2]
            * (sum((d - mean) ** 2 for d in rest) / (len(rest) - 1)) ** 0.5
            / len(rest) ** 0.5
        )
        if mean - half <= 0:
            by_hand.append(seed)
    assert loo["flips"] == by_hand == ["1", "2", "3", "4", "5"]
    assert stats.leave_one_out({"1": 0.1, "2": 0.1, "3": 0.1})["flips"] == []  # no spread: no seed carries it


def test_training_seconds_to_the_baseline_final_and_the_plans_calibration(stats, report):
    """Seed 1: `grpo` first reaches its final 0.5 at 20 s, `replay` at 12 s: 0.6x; seed 2's target is its initial
    success, not scoreable. The calibration: per seed, the mean over the steps where both shares were recorded (seed
    1: predicted 0.6, observed 0.375; seed 2: 0.6 and 0.75), then over seeds."""
    fixture = {"methods": {name: {"runs": {s: dict(r) for s, r in m["runs"].items()}}
                           for name, m in FIXTURE["methods"].items()}}  # fmt: skip
    fixture["methods"]["replay"]["runs"]["1"]["replay"] = {
        "spread_predicted_fresh": [0.5, None, 0.7],
        "spread_observed_fresh": [0.25, 0.9, 0.5],
    }
    fixture["methods"]["replay"]["runs"]["2"]["replay"] = {
        "spread_predicted_fresh": [0.6],
        "spread_observed_fresh": [0.75],
    }
    grpo, replay = stats.summarize(fixture, "grpo")
    assert replay["to_final_time"] == {"median_counting_never": pytest.approx(0.6), "never": 0, "reached": 1}
    assert grpo["calibration"] is None
    assert replay["calibration"] == {
        "predicted": pytest.approx(0.6),
        "observed": pytest.approx(0.5625),
        "gap_range": (pytest.approx(-0.225), pytest.approx(0.15)),
        "seeds": 2,
    }
    lines = "\n".join(report.step_time_lines([grpo, replay], "grpo"))
    assert "- `replay`: 0.60x (1 reached, 0 never)" in lines
