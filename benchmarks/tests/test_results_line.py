"""The results line, the paragraph README.md's first screen, docs/trainer.md and docs/results.md share, says what the
pre-registered results files say: the same text in all three, and each figure recomputed from
docs/results/preregistered/ by the harness's own per-seed summary (none read off curves averaged over seeds)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import load_script

from trl_exreplay.config import PROFILE_FIELDS

pytestmark = pytest.mark.fast  # in the fast lane: no training

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- results-line:.*?-->\n(.*?)<!-- /results-line -->", re.DOTALL)
TESTBEDS = ("single-turn", "multi-turn", "alfworld-few-games")


@pytest.fixture(scope="module")
def harness():
    return load_script("benchmarks/replay_vs_grpo.py", "replay_vs_grpo")


def results_line(path: Path) -> str:
    blocks = BLOCK.findall(path.read_text())
    assert len(blocks) == 1, f"{path}: one results line"
    return " ".join(blocks[0].split())


def entry(harness, testbed: str) -> dict:
    (found,) = harness.load_results(REPO / "docs" / "results" / "preregistered" / testbed)["testbeds"].values()
    return found


def summary(harness, testbed: str, baseline: str, method: str) -> dict:
    levels = harness.TESTBEDS[testbed].target_levels
    return next(row for row in harness.summarize(entry(harness, testbed), baseline, levels) if row["method"] == method)


def interval(stats: dict) -> str:
    d = stats["interval"] if "interval" in stats else stats
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def test_readme_the_trainer_page_and_the_results_page_share_one_results_line():
    readme = results_line(REPO / "README.md")
    assert readme == results_line(REPO / "docs" / "results.md") == results_line(REPO / "docs" / "trainer.md")


def test_the_results_line_figures_are_the_per_seed_figures_of_the_results_files(harness):
    line = results_line(REPO / "README.md")
    single, doors, alfworld = (summary(harness, t, "grpo", "exreplay") for t in TESTBEDS)
    assert [len(row["seeds"]) for row in (single, doors, alfworld)] == [20, 20, 5]
    assert "20 per testbed, 5 on ALFWorld" in line

    # Rollouts to the same seed's GRPO final: median ratio over the seeds that reached it, never, not scoreable.
    def to_final(row):
        f = row["to_final"]
        return f["ratio"]["median"], f["ratio"]["seeds"], f["never"], f["not_scoreable"]

    median, seeds, never, not_scoreable = to_final(single)
    assert not_scoreable == 0
    assert (
        f"a median {median:.2f}x GRPO's fresh rollouts on single-turn ({seeds} seeds; never reached on {never})"
        in line
    )
    median, seeds, never, not_scoreable = to_final(doors)
    assert (
        f"{median:.2f}x on the doors game ({seeds} seeds; never on {never}; {not_scoreable} not scoreable: GRPO ended "
        "at 0)" in line
    )
    doors_grpo = summary(harness, "multi-turn", "grpo", "grpo")
    unscoreable = [s for s, f in doors["to_final"]["per_seed"].items() if f["status"] == "not scoreable"]
    assert all(doors_grpo["final_per_seed"][s] == 0 for s in unscoreable)
    median, seeds, never, not_scoreable = to_final(alfworld)
    assert not_scoreable == 0
    assert f"{median:.2f}x on its 8 training games ({seeds} seeds; never on {never})" in line

    # The area under the curve over fresh rollouts, per seed; on the doors game also where neither run collapsed.
    aucs = [interval(row["auc"]["rollouts"]["paired"]) for row in (single, alfworld, doors)]
    assert f"is {aucs[0]} on single-turn, {aucs[1]} on ALFWorld and {aucs[2]} on the doors game" in line
    steady = doors["auc_steady"]
    assert f"{interval(steady)} on the {steady['seeds']} seeds where neither collapsed" in line

    # Collapses and the final difference, on all seeds and on those where neither collapsed.
    test = doors["collapse_test"]
    assert (doors["collapsed"], doors["baseline_collapsed_shared"]) == (2, 6)
    assert (
        f"fewer collapses at an aggressive learning rate ({doors['collapsed']} of 20 seeds against GRPO's "
        f"{doors['baseline_collapsed_shared']}, exact McNemar p = {test['p']:.2f})" in line
    )
    assert f"collapsed GRPO's policy on {doors['baseline_collapsed_shared']} of 20 seeds and replay's on 2" in line
    sign = doors["final"]["sign"]
    assert (
        f"{interval(doors['final'])} on all seeds ({sign['wins']} above, {sign['losses']} below, sign test p = "
        f"{sign['p']:.2f}), {interval(doors['final_steady'])} on the {doors['final_steady']['seeds']} where neither "
        "collapsed" in line
    )
    # that test's doors-game rate, as its runs recorded it (the harness's default is GRPO's tuned 3.3e-3 since)
    assert entry(harness, "multi-turn")["training"]["learning_rate"] == 1e-2 and "learning rate (1e-2, chosen" in line

    # ALFWorld's replay arm is named by what it ran: the recipe's settings.
    fields = harness.replay_fields(entry(harness, "alfworld-few-games"))
    assert (fields["replay_shaping"], fields["replay_start_ratio"], fields["replay_max_trajectories_per_task"]) == (
        "exgrpo", 0.25, 4)  # fmt: skip
    assert (
        "replay with the ALFWorld recipe's settings (`exgrpo` shaping, start at 0.25, 4 trajectories a task)" in line
    )
    assert "with the defaults" not in line

    # ExGRPO's profile against that replay arm (the pre-registered primary: final success).
    exgrpo = [summary(harness, t, "exreplay", "exgrpo") for t in TESTBEDS]
    assert all(row["final"]["interval"]["high"] < 0 for row in exgrpo)
    assert ", ".join(interval(row["final"]) for row in exgrpo[:2]) + " and " + interval(exgrpo[2]["final"]) in line


def test_no_user_page_gives_the_ratio_read_off_mean_curves_as_a_figure():
    """The mean-curve ratio ("fresh rollouts to GRPO's final", 0.38x on the doors game) appears only in the labelled
    appendix of the results page."""
    results = (REPO / "docs" / "results.md").read_text()
    appendix = results.index("#### Appendix: the ratio read off curves averaged over seeds")
    for page in (REPO / "README.md", REPO / "docs" / "trainer.md", REPO / "docs" / "index.md"):
        assert "0.38x" not in page.read_text()
    # the appendix's figure once, after its heading; elsewhere 0.38x only as one seed's own ratio in a per-seed row
    offsets, at = [], 0
    for row in results.splitlines(keepends=True):
        if "0.38x" in row and not re.match(r"\| \d+ \|", row):
            offsets.append(at)
        at += len(row)
    assert len(offsets) == 1 and offsets[0] > appendix


VERDICT = re.compile(r"<!-- verdict:.*?-->\n(.*?)<!-- /verdict -->", re.DOTALL)


def test_the_verdict_is_one_paragraph_of_readme_and_the_docs_home_with_the_per_seed_figures(harness):
    """The two-sentence verdict on README's first screen and the docs home page: the same text, its figures the
    per-seed ones of the results files."""
    (readme,) = VERDICT.findall((REPO / "README.md").read_text())
    (home,) = VERDICT.findall((REPO / "docs" / "index.md").read_text())
    assert readme == home
    verdict = " ".join(readme.split())
    single, doors = (summary(harness, t, "grpo", "exreplay") for t in TESTBEDS[:2])
    assert f"a median {single['to_final']['ratio']['median']:.2f}x GRPO's fresh rollouts on single-turn" in verdict
    assert f"{doors['to_final']['ratio']['median']:.2f}x on a multi-turn game" in verdict
    assert (
        f"collapsed on {doors['baseline_collapsed_shared']} of 20 seeds and replay's on {doors['collapsed']} "
        f"(McNemar p = {doors['collapse_test']['p']:.2f})" in verdict
    )
    assert "5-13% more time per step" in verdict and "5-13%" in (REPO / "docs" / "results.md").read_text()


def test_the_results_line_leads_with_the_every_group_teaches_test(harness):
    """The newest pre-registered test (docs/results.md, "Every group teaches"): its per-seed figures, recomputed from
    docs/results/teach/report/, lead the results line and the verdict, and the registered decision rule is applied as
    written (the profile's runs are named `teach-revisit50`, the values the tuning grid chose)."""
    line = results_line(REPO / "README.md")
    (verdict,) = VERDICT.findall((REPO / "README.md").read_text())
    verdict = " ".join(verdict.split())
    teach = "teach-revisit50"

    def rows(testbed, baseline):
        (found,) = harness.load_results(REPO / "docs" / "results" / "teach" / "report" / testbed)["testbeds"].values()
        assert {len(m["runs"]) for m in found["methods"].values()} == {20}  # every registered run, every method
        levels = harness.TESTBEDS[testbed].target_levels
        return {row["method"]: row for row in harness.summarize(found, baseline, levels)}

    def auc(row):
        p = row["auc"]["rollouts"]["paired"]
        return f"{interval(p)} ({p['sign']['wins']} seeds above, {p['sign']['losses']} below)"

    def to_final(row):
        return f"{row['to_final']['ratio']['median']:.2f}x (never on {row['to_final']['never']})"

    single, doors = (rows(t, "grpo") for t in ("single-turn", "multi-turn"))
    single_x, doors_x = (rows(t, "exreplay") for t in ("single-turn", "multi-turn"))
    assert (
        f"replay's former defaults (`exreplay`), {auc(single['exreplay'])} on single-turn and {auc(doors['exreplay'])} on the doors"
        in line
    )
    assert f"at 0.5), {auc(single[teach])} and {auc(doors[teach])};" in line
    assert f"the former defaults, {auc(single_x[teach])} and {auc(doors_x[teach])}." in line
    assert f"a median {to_final(single['exreplay'])} and {to_final(doors['exreplay'])} of GRPO's" in line
    assert f"`teach` {to_final(single[teach])} and {to_final(doors[teach])}." in line
    assert f"in a median {doors[teach]['to_final']['ratio']['median']:.2f}x GRPO's fresh rollouts" in verdict
    # The registered rule: the profile becomes the default if its interval against the defaults is above 0 on one
    # testbed and below 0 on none.
    low = [x[teach]["auc"]["rollouts"]["paired"]["interval"]["low"] for x in (single_x, doors_x)]
    high = [x[teach]["auc"]["rollouts"]["paired"]["interval"]["high"] for x in (single_x, doors_x)]
    rule = any(v > 0 for v in low) and not any(v < 0 for v in high)
    # the bounds the rule turns on, to the precision that shows which side of 0 they fall (+0.000 would not)
    assert f"its lower bound {low[1]:+.4f}, and below 0 on neither, single-turn's upper bound {high[0]:+.4f})" in line
    assert ("`teach` became the default" in line) == rule
    assert ("`teach` does not become the default" in line) == (not rule)
    # and the library's defaults are what the rule chose: the report runs' values, with nothing else set
    assert harness.PRESETS["teach"] == {} and (
        harness.PRESETS["exreplay"] == {"replay_rescue": 0, "replay_retire_solved": False}
    )
    assert {f: PROFILE_FIELDS[f] for f in ("replay_rescue", "replay_retire_solved", "replay_revisit_ratio")} == (
        {"replay_rescue": 1, "replay_retire_solved": True, "replay_revisit_ratio": 0.5}
        if rule
        else {"replay_rescue": 0, "replay_retire_solved": False, "replay_revisit_ratio": 0.0}
    )
