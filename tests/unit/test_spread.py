"""The per-task success estimate and the plan that fills a batch's groups (`trl_exreplay.spread`): exact values of
the closed forms, the decay, the checkpoint file and its checks, and the plan's rules (exploration floor, per-task
cap, batch shape, seeded draws)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from trl_exreplay.pool.store import write_arrow
from trl_exreplay.spread import ESTIMATES_FILE, ESTIMATES_SCHEMA, SuccessEstimates, plan_groups, spread_probability


def beta_moment(alpha: float, beta: float, k: int) -> float:
    """E[p^k] under Beta(alpha, beta), from the Beta function (not the product the module uses)."""
    return math.exp(
        math.lgamma(alpha + k) + math.lgamma(alpha + beta) - math.lgamma(alpha) - math.lgamma(alpha + beta + k)
    )


def test_spread_probability_is_one_minus_the_all_win_and_all_fail_moments():
    alpha, beta = np.array([1.0, 5.0, 1.0, 2.5]), np.array([1.0, 5.0, 9.0, 0.7])
    expected = [1 - beta_moment(a, b, 8) - beta_moment(b, a, 8) for a, b in zip(alpha, beta)]
    assert spread_probability(alpha, beta, 8) == pytest.approx(expected, rel=1e-12)
    assert spread_probability([1.0], [1.0], 8)[0] == pytest.approx(1 - 2 / 9)  # uniform p: E[p^G] = 1 / (G + 1)
    # a task whose all-fail group would be rescued: only an all-win group teaches nothing
    rescued = spread_probability(alpha, beta, 8, rescuable=[True, False, True, False])
    assert rescued[0] == pytest.approx(1 - beta_moment(1.0, 1.0, 8)) and rescued[1] == pytest.approx(expected[1])
    # a point mass (huge counts) at p: the plain binomial answer
    assert spread_probability([3e9], [1e9], 4)[0] == pytest.approx(1 - 0.75**4 - 0.25**4, rel=1e-6)


def test_estimates_add_outcomes_and_decay_toward_the_prior_by_half_each_half_life():
    estimates = SuccessEstimates(half_life=10)
    alpha, beta = estimates.posterior(["a"], step=0)
    assert (alpha[0], beta[0]) == (1.0, 1.0)  # never seen: the prior
    estimates.update([("a", 6, 8), ("b", 0, 8), ("a", 2, 8)], step=3)  # two groups of "a" in one batch add up
    alpha, beta = estimates.posterior(["a", "b", "c"], step=3)
    assert alpha.tolist() == [9.0, 1.0, 1.0] and beta.tolist() == [9.0, 9.0, 1.0]
    alpha, beta = estimates.posterior(["a", "b"], step=13)  # one half-life later: evidence above the prior halves
    assert alpha.tolist() == [5.0, 1.0] and beta.tolist() == [5.0, 5.0]
    estimates.update([("b", 4, 4)], step=23)  # decayed to step 23 (a quarter left), then the new outcome
    alpha, beta = estimates.posterior(["b"], step=23)
    assert (alpha[0], beta[0]) == (5.0, 3.0)
    assert len(estimates) == 2
    with pytest.raises(ValueError, match="half_life is 0"):
        SuccessEstimates(half_life=0)


def test_estimates_grow_past_their_arrays_and_keep_every_task():
    estimates = SuccessEstimates(half_life=5)
    estimates.update([(f"t{i}", i % 3, 2) for i in range(1000)], step=0)
    alpha, beta = estimates.posterior([f"t{i}" for i in range(1000)], step=0)
    assert alpha.tolist() == [1.0 + i % 3 for i in range(1000)] and beta.tolist() == [3.0 - i % 3 for i in range(1000)]


def test_estimates_save_and_load_exactly(tmp_path):
    estimates = SuccessEstimates(half_life=7)
    estimates.update([("x", 1, 8), ("y", 8, 8)], step=2)
    estimates.update([("x", 3, 8), ("z", 0, 4)], step=9)
    estimates.save(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [ESTIMATES_FILE]  # no temporary file left
    again = SuccessEstimates(half_life=7)
    assert again.load(str(tmp_path)) is True
    keys = ["x", "y", "z", "w"]
    for step in (9, 30):
        for left, right in zip(estimates.posterior(keys, step), again.posterior(keys, step)):
            assert left.tolist() == right.tolist()
    assert SuccessEstimates(half_life=7).load(str(tmp_path / "missing")) is False
    # what rank 0 sends the others on resume: the same estimates
    other = SuccessEstimates(half_life=7)
    other.restore(estimates.columns())
    assert [x.tolist() for x in other.posterior(keys, 30)] == [x.tolist() for x in estimates.posterior(keys, 30)]


@pytest.mark.parametrize(
    "table, message",
    [
        (pa.table({"task": ["a"], "alpha": [1.0]}), "schema"),
        (pa.table({"task": ["a", "a"], "alpha": [1.0, 2.0], "beta": [1.0, 1.0], "step": [0, 0]}, schema=ESTIMATES_SCHEMA),
         "lists a task twice"),
        (pa.table({"task": ["a"], "alpha": [float("nan")], "beta": [1.0], "step": [0]}, schema=ESTIMATES_SCHEMA),
         "`alpha` holds a non-finite or negative value"),
        (pa.table({"task": ["a"], "alpha": [1.0], "beta": [-1.0], "step": [0]}, schema=ESTIMATES_SCHEMA),
         "`beta` holds a non-finite or negative value"),
        (pa.table({"task": ["a"], "alpha": [1.0], "beta": [1.0], "step": [-1]}, schema=ESTIMATES_SCHEMA),
         "`step` holds a non-finite or negative value"),
        (pa.table({"task": [None], "alpha": [1.0], "beta": [1.0], "step": [1]}, schema=ESTIMATES_SCHEMA), "null"),
    ],
)  # fmt: skip
def test_a_damaged_estimates_file_is_refused_naming_the_file_and_field(tmp_path, table, message):
    write_arrow(str(tmp_path / ESTIMATES_FILE), table)
    estimates = SuccessEstimates(half_life=7)
    estimates.update([("kept", 1, 2)], step=0)
    with pytest.raises(ValueError, match=f"{ESTIMATES_FILE}: .*{message}"):
        estimates.load(str(tmp_path))
    assert len(estimates) == 1  # unchanged
    (tmp_path / ESTIMATES_FILE).write_bytes(b"not arrow")
    with pytest.raises(ValueError, match="not an Arrow stream file"):
        estimates.load(str(tmp_path))


def plan(keys, alpha, beta, num_groups, explore=0.0, cap=1, seed=0, rescuable=None):
    n = len(keys)
    rescuable = np.zeros(n, bool) if rescuable is None else np.asarray(rescuable)
    return plan_groups(keys, np.asarray(alpha, float), np.asarray(beta, float), rescuable, num_groups=num_groups,
                       group_size=8, explore=explore, max_groups_per_task=cap, seed=seed)  # fmt: skip


def test_the_plan_gives_groups_to_the_tasks_likely_to_have_spread():
    # sampler's groups: two solved tasks and a never-solved one; candidates: three tasks solved half the time
    keys = ["s1", "s2", "never", "m1", "m2", "m3"]
    alpha = [200.0, 200.0, 1.0, 100.0, 100.0, 100.0]
    beta = [1.0, 1.0, 200.0, 100.0, 100.0, 100.0]
    result = plan(keys, alpha, beta, num_groups=3)
    assert sorted(result.chosen) == [3, 4, 5] and set(result.replaced()) == {0, 1, 2}
    assert result.predicted == pytest.approx(list(spread_probability([100.0] * 3, [100.0] * 3, 8)))
    # a step before a task's last update (only a crafted file has one) counts as no time: evidence never grows
    # a never-solved task whose all-fail group would be rescued teaches: it keeps its group
    result = plan(keys, alpha, beta, num_groups=3, rescuable=[False, False, True, False, False, False])
    assert result.chosen[2] == 2 and len(result.chosen) == 3


def test_the_plan_keeps_explored_groups_caps_groups_per_task_and_keeps_the_batch_shape():
    keys = ["a", "b", "c", "d", "mid", "mid", "mid", "mid"]
    alpha = [1.0, 1.0, 1.0, 1.0, 50.0, 50.0, 50.0, 50.0]
    beta = [300.0] * 4 + [50.0] * 4
    assert plan(keys, alpha, beta, num_groups=4, explore=1.0).chosen == [0, 1, 2, 3]  # every group kept as drawn
    capped = plan(keys, alpha, beta, num_groups=4, cap=2)
    assert [keys[c] for c in capped.chosen].count("mid") == 2 and len(capped.chosen) == 4
    assert [keys[c] for c in plan(keys, alpha, beta, num_groups=4, cap=4).chosen] == ["mid"] * 4
    # with exploration, some seeds keep a sampler's group: it counts toward its task's cap and is never moved
    for seed in range(20):
        result = plan(keys, alpha, beta, num_groups=4, explore=0.5, cap=1, seed=seed)
        kept = [g for g in range(4) if result.chosen[g] == g]
        assert len(result.chosen) == 4 and [keys[c] for c in result.chosen].count("mid") <= 1
        assert all(c >= 4 for g, c in enumerate(result.chosen) if g not in kept)
    # too few candidates the cap allows: the groups left keep their own rows
    assert plan(["a", "b", "m", "m"], [1, 1, 50, 50], [300, 300, 50, 50], num_groups=2).chosen in ([2, 1], [0, 2])
    with pytest.raises(ValueError, match="1 candidates for 2 groups"):
        plan(["a"], [1.0], [1.0], num_groups=2)


def test_the_plan_is_a_seeded_draw_that_tries_uncertain_tasks():
    keys = ["known", "new"]
    alpha, beta = [30.0, 1.0], [30.0, 1.0]  # known: p near 0.5; new: never seen, anything is possible
    first = [plan(keys, alpha, beta, num_groups=1, seed=seed).chosen for seed in range(200)]
    assert first == [plan(keys, alpha, beta, num_groups=1, seed=seed).chosen for seed in range(200)]  # seeded
    share_new = sum(c == [1] for c in first) / 200
    assert 0.05 < share_new < 0.6  # the uncertain task is tried now and then, the known good one mostly chosen


def test_evidence_never_grows_for_a_step_before_the_last_update():
    estimates = SuccessEstimates(half_life=10)
    estimates.update([("a", 4, 8)], step=50)
    alpha, beta = estimates.posterior(["a"], step=10)  # earlier than its update: as at step 50, not 16x the evidence
    assert (alpha[0], beta[0]) == (5.0, 5.0)
