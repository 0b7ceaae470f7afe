"""Tests for `trl_exreplay.planner`: bucket weights, replay plans and the plan's row layout.

Expected plans and weights are worked out by hand from the layout (group g = rows g*G .. g*G+G-1).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from trl_exreplay import planner
from trl_exreplay.planner import (
    NORMAL_BUCKET_STD,
    ReplayPlan,
    bucket_weights,
    draw_replay_tasks,
    plan_replay,
    plan_rescue,
    replay_groups_due,
)
from trl_exreplay.pool.index import TaskBuckets


def plan(group_keys, replayable, ratio, G=4, k=1, weighting="uniform", seed=0):
    """The plan of a run's first generation batch at `replay_ratio=ratio`."""
    num_tasks = replay_groups_due(ratio, len(group_keys), 0)
    return plan_replay(
        group_keys, replayable, num_tasks=num_tasks, num_generations=G, num_replayed=k, weighting=weighting, seed=seed
    )


# --------------------------------------------------------------------------------------------------------------------
# replay_groups_due: replay_ratio as a long-run share of groups
# --------------------------------------------------------------------------------------------------------------------


def test_the_docstring_examples_hold():
    import doctest

    import trl_exreplay.planner

    assert doctest.testmod(trl_exreplay.planner).failed == 0


def test_one_group_a_batch_at_one_half_replays_every_second_batch():
    assert [replay_groups_due(0.5, 1, n) for n in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [replay_groups_due(0.25, 1, n) for n in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert [replay_groups_due(1.0, 1, n) for n in range(4)] == [1, 1, 1, 1]
    assert [replay_groups_due(0.0, 3, n) for n in range(4)] == [0, 0, 0, 0]


@pytest.mark.parametrize("ratio, groups", [(0.5, 2), (0.5, 4), (0.25, 8), (0.3, 10), (0.29, 100), (0.7, 10), (1.0, 6)])
def test_a_whole_share_replays_the_same_number_in_every_batch(ratio, groups):
    """Where replay_ratio * groups is a whole number, every batch replays exactly that many (the planner's count before
    the share was long-run); read as decimals, so 0.29 * 100 (28.999999999999996 in floats) is 29."""
    whole = round(ratio * groups)
    assert [replay_groups_due(ratio, groups, n) for n in range(50)] == [whole] * 50


@pytest.mark.parametrize("ratio, groups", [(0.5, 1), (0.3, 2), (0.6, 4), (0.35, 3), (1 / 3, 1), (0.123, 7)])
def test_the_share_holds_over_any_stretch_of_batches(ratio, groups):
    """Each batch replays floor or ceil of r*g, and any n consecutive batches replay r*g*n groups up to one."""
    due = [replay_groups_due(ratio, groups, n) for n in range(400)]
    share = ratio * groups
    assert set(due) <= {int(share), int(share) + 1}
    for start in (0, 17, 123):
        for length in (1, 10, 99, 250):
            assert abs(sum(due[start : start + length]) - share * length) < 1 + 1e-9


# --------------------------------------------------------------------------------------------------------------------
# bucket_weights
# --------------------------------------------------------------------------------------------------------------------


def test_bucket_weights_uniform_is_one_per_task():
    w = bucket_weights([0, 1, 1, 3], 4, "uniform")
    assert w.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_bucket_weights_normal():
    assert NORMAL_BUCKET_STD == 1.0
    # G = 4: successes 0, 1, 2, 2, 3 -> k - G/2 = -2, -1, 0, 0, 1; the bucket of 2 shares exp(0) = 1 between its tasks
    w = bucket_weights([0, 1, 2, 2, 3], 4, "normal")
    expected = [math.exp(-2.0), math.exp(-0.5), 0.5, 0.5, math.exp(-0.5)]
    np.testing.assert_allclose(w, expected, rtol=1e-12, atol=0)


def test_bucket_weights_normal_other_group_size():
    # G = 8: 2 successes -> k - 4 = -2; 6 -> 2; 4 -> 0, shared by three tasks
    w = bucket_weights([2, 4, 4, 4, 6], 8, "normal")
    expected = [math.exp(-2.0), 1 / 3, 1 / 3, 1 / 3, math.exp(-2.0)]
    np.testing.assert_allclose(w, expected, rtol=1e-12, atol=0)


def test_normal_weighting_of_a_count_above_g_is_that_of_g():
    """A task that filled several groups of one batch has more than G outcomes (here 48 successes of 56 at G = 8); it
    weighs as a task solved G times, so a pool of such tasks still draws (before: weights 0, probabilities NaN)."""
    w = bucket_weights([48, 8, 4], 8, "normal")
    np.testing.assert_allclose(w, [math.exp(-8.0), math.exp(-8.0), 1.0], rtol=1e-12, atol=0)
    buckets = TaskBuckets.from_pairs([("a", 48), ("b", 50)])
    assert sorted(
        draw_replay_tasks(buckets, 2, num_generations=8, weighting="normal", rng=np.random.default_rng(0))
    ) == [0, 1]


def test_normal_weighting_draws_buckets_as_exgrpo_does():
    """ExGRPO's weight of bucket k is exp(-(k - G/2)^2 / 2): one success wide. With the 7 buckets 1..7 of G = 8 filled
    (one task each), a draw lands in them with these probabilities (hand-computed: exp(-z^2/2) for z = -3..3 over their
    sum 2.505950); buckets 3-5 take 88% of the draws."""
    w = bucket_weights(list(range(1, 8)), 8, "normal")
    p = w / w.sum()
    np.testing.assert_allclose(p, [0.004433, 0.054006, 0.242036, 0.399050, 0.242036, 0.054006, 0.004433], atol=1e-6)
    assert p[2:5].sum() == pytest.approx(0.883122, abs=1e-6)
    # and the planner draws accordingly: first draws of 20,000 one-task plans
    buckets = TaskBuckets.from_pairs([(f"t{k}", k) for k in range(1, 8)])
    rng = np.random.default_rng(0)
    counts = np.zeros(7)
    for _ in range(20_000):
        (task,) = draw_replay_tasks(buckets, 1, num_generations=8, weighting="normal", rng=rng)
        counts[task] += 1
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.01)


def test_bucket_weights_linear():
    # G = 4: per bucket G - d = 3, 3, 1, 4; bucket 1 holds two tasks -> 1.5 each
    w = bucket_weights([1, 1, 3, 0], 4, "linear")
    assert w.tolist() == [1.5, 1.5, 1.0, 4.0]
    # G - d below 1 is clipped to 1
    assert bucket_weights([4, 5, 2], 4, "linear").tolist() == [1.0, 1.0, 2.0]


def test_bucket_weights_unknown_raises():
    with pytest.raises(ValueError, match="replay_bucket_weighting.*'uniform', 'normal', 'linear'"):
        bucket_weights([1, 2], 4, "exponential")


def test_plan_unknown_weighting_raises():
    with pytest.raises(ValueError, match="replay_bucket_weighting"):
        plan(["a", "b"], [("x", 1)], 1.0, weighting="exponential")


# --------------------------------------------------------------------------------------------------------------------
# ReplayPlan layout
# --------------------------------------------------------------------------------------------------------------------


def test_replay_plan_rows_k1():
    p = ReplayPlan(num_generations=4, num_replayed=1, replay_groups={2: "y", 0: "x"})
    assert p.num_tasks == 2
    assert p.replayed_rows() == [3, 11]
    assert [r for r in range(16) if p.is_replayed(r)] == [3, 11]


def test_replay_plan_rows_k2_and_task_of_row():
    p = ReplayPlan(num_generations=3, num_replayed=2, replay_groups={1: "x"})
    keys = ["a", "b", "c"]
    assert p.replayed_rows() == [4, 5]
    assert [p.is_replayed(r) for r in range(9)] == [False, False, False, False, True, True, False, False, False]
    # every row of a replay group belongs to the replayed task, fresh rows included
    assert [p.task_of_row(r, keys) for r in range(9)] == ["a", "a", "a", "x", "x", "x", "c", "c", "c"]


def test_empty_replay_plan():
    p = ReplayPlan(4, 1, {})
    assert p.num_tasks == 0 and p.replayed_rows() == []
    assert not any(p.is_replayed(r) for r in range(8))
    assert [p.task_of_row(r, ["a", "b"]) for r in range(8)] == ["a"] * 4 + ["b"] * 4


# --------------------------------------------------------------------------------------------------------------------
# plan_replay: sizes
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_groups, ratio, num_replayable, expected",
    [
        (4, 0.0, 3, 0),
        (4, 0.5, 0, 0),
        (3, 0.3, 5, 0),  # floor(0.9) = 0 in a run's first batch
        (4, 0.5, 5, 2),
        (4, 0.6, 5, 2),  # int(2.4) = 2
        (8, 0.5, 2, 2),  # fewer: the pool is small
        (8, 1.0, 8, 8),
        (5, 1.0, 12, 5),
    ],
)
def test_plan_size(num_groups, ratio, num_replayable, expected):
    keys = [f"g{i}" for i in range(num_groups)]
    replayable = [(f"p{i}", i % 3) for i in range(num_replayable)]
    p = plan(keys, replayable, ratio, seed=11)
    assert p.num_tasks == expected
    assert len(set(p.replay_groups.values())) == expected  # distinct tasks
    assert set(p.replay_groups.values()) <= {t for t, _ in replayable}
    assert all(0 <= g < num_groups for g in p.replay_groups)
    assert (p.num_generations, p.num_replayed) == (4, 1)


def test_plan_keeps_G_and_k():
    p = plan(["a", "b"], [("x", 1)], 0.5, G=6, k=3, seed=1)
    assert (p.num_generations, p.num_replayed) == (6, 3)
    assert p.replay_groups in ({0: "x"}, {1: "x"})
    group = next(iter(p.replay_groups))
    assert p.replayed_rows() == [group * 6 + 3, group * 6 + 4, group * 6 + 5]


# --------------------------------------------------------------------------------------------------------------------
# plan_replay: exact plans
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_drawn_tasks_in_batch_replay_in_their_own_group(seed):
    # target = int(4 * .5) = 2 = len(replayable): both drawn, both already in the batch
    p = plan(["a", "b", "c", "d"], [("d", 2), ("b", 1)], 0.5, seed=seed)
    assert p.replay_groups == {1: "b", 3: "d"}
    assert p.replayed_rows() == [7, 15]


@pytest.mark.parametrize("seed", range(5))
def test_drawn_task_replays_in_its_first_group(seed):
    p = plan(["a", "b", "a", "c"], [("a", 1)], 0.25, seed=seed)
    assert p.replay_groups == {0: "a"}


@pytest.mark.parametrize("seed", range(5))
def test_exact_plan_mixing_present_and_new_tasks(seed):
    # target 3 = every replayable task; a and b sit in groups 0 and 1, so x can only take group 2
    p = plan(["a", "b", "q"], [("x", 3), ("a", 1), ("b", 2)], 1.0, seed=seed)
    assert p.replay_groups == {0: "a", 1: "b", 2: "x"}


@pytest.mark.parametrize("seed", range(5))
def test_new_task_never_replaces_a_drawn_task_group(seed):
    # target 2: b (group 1) and x drawn; x goes to a group whose task was not drawn: 0, 2 or 3
    p = plan(["a", "b", "c", "d"], [("x", 1), ("b", 1)], 0.5, seed=seed)
    assert p.replay_groups[1] == "b"
    (x_group,) = [g for g, t in p.replay_groups.items() if t == "x"]
    assert x_group in (0, 2, 3)
    assert p.num_tasks == 2


def test_new_task_uses_every_free_group_over_seeds():
    positions = set()
    for seed in range(60):
        p = plan(["a", "b", "c", "d"], [("x", 1), ("b", 1)], 0.5, seed=seed)
        positions |= {g for g, t in p.replay_groups.items() if t == "x"}
    assert positions == {0, 2, 3}


def test_duplicate_group_keys_never_get_the_drawn_task_twice():
    # a is in groups 0 and 2; drawn, it replays in group 0 only, and group 2 (a drawn task) is not a free slot
    for seed in range(20):
        p = plan(["a", "b", "a", "c"], [("a", 1), ("x", 2)], 0.5, seed=seed)
        assert p.replay_groups[0] == "a"
        assert 2 not in p.replay_groups
        assert sorted(p.replay_groups.values()) == ["a", "x"]
        assert [g for g, t in p.replay_groups.items() if t == "x"][0] in (1, 3)


def test_plan_has_target_tasks_even_when_batch_repeats_a_drawn_task():
    # Every group holds task a (a dataset that repeats a task can give such a batch). target = int(4 * .5) = 2 and the
    # pool has 2 replayable tasks, so both a and x are drawn: a replays in group 0 and x must take one of the other
    # groups (it cannot duplicate a task there: the replay of a sits in group 0). The plan must hold 2 tasks.
    for seed in range(5):
        p = plan(["a", "a", "a", "a"], [("a", 1), ("x", 2)], 0.5, seed=seed)
        assert p.replay_groups[0] == "a"
        assert p.num_tasks == 2, p.replay_groups
        assert sorted(p.replay_groups.values()) == ["a", "x"]


# --------------------------------------------------------------------------------------------------------------------
# plan_replay: determinism and randomness
# --------------------------------------------------------------------------------------------------------------------


def _random_case(rnd: random.Random):
    num_groups = rnd.randint(1, 10)
    universe = [f"t{i}" for i in range(14)]
    keys = rnd.sample(universe, num_groups)  # distinct tasks per batch
    replayable = [(t, rnd.randint(0, 3)) for t in rnd.sample(universe, rnd.randint(0, 14))]
    return keys, replayable, rnd.choice([0.0, 0.25, 0.5, 0.75, 1.0]), rnd.choice(["uniform", "normal", "linear"])


def test_plan_invariants_on_random_cases():
    rnd = random.Random(1234)
    for case in range(300):
        keys, replayable, ratio, weighting = _random_case(rnd)
        p = plan(keys, replayable, ratio, weighting=weighting, seed=case)
        target = min(int(len(keys) * ratio), len(replayable))
        tasks = list(p.replay_groups.values())
        assert p.num_tasks == target
        assert len(set(tasks)) == len(tasks)
        assert set(tasks) <= {t for t, _ in replayable}
        assert list(p.replay_groups) == sorted(p.replay_groups)
        for g, t in p.replay_groups.items():
            assert 0 <= g < len(keys)
            if t in keys:
                assert keys.index(t) == g  # a drawn task present in the batch occupies its group
            else:
                assert keys[g] not in tasks  # a new task only replaces a group whose task was not drawn
        # the batch never holds a task twice: fresh groups and replay groups together
        batch = [p.replay_groups.get(g, keys[g]) for g in range(len(keys))]
        assert len(set(batch)) == len(batch)


def test_same_inputs_and_seed_same_plan():
    keys = [f"g{i}" for i in range(8)]
    replayable = [(f"p{i}", i % 4) for i in range(10)] + [("g3", 1), ("g5", 2)]
    for weighting in ("uniform", "normal", "linear"):
        a = plan(keys, replayable, 0.5, weighting=weighting, seed=[7, 3])
        b = plan(list(keys), list(replayable), 0.5, weighting=weighting, seed=[7, 3])
        assert a == b and a.num_tasks == 4


def test_different_seeds_give_different_plans():
    keys = [f"g{i}" for i in range(8)]
    replayable = [(f"p{i}", i % 4) for i in range(10)]
    plans = {tuple(plan(keys, replayable, 0.5, seed=[0, step]).replay_groups.items()) for step in range(20)}
    assert len(plans) > 5
    drawn = {t for p in plans for _, t in p}
    assert len(drawn) == 10  # over 20 steps every task gets drawn at least once


@pytest.mark.parametrize(
    "weighting, expected_c",
    [
        ("uniform", 1 / 3),  # every task alike
        ("linear", 0.25),  # bucket 1: 3 shared by a and b (1.5 each); bucket 3: 1 -> 1 / 4
        ("normal", 0.5),  # both buckets exp(-0.5), bucket 1 shared by two tasks -> 1 / 2
    ],
)
def test_draw_frequencies_follow_bucket_weights(weighting, expected_c):
    replayable = [("a", 1), ("b", 1), ("c", 3)]
    n = 4000
    counts = {"a": 0, "b": 0, "c": 0}
    for seed in range(n):
        p = plan(["q", "r"], replayable, 0.5, weighting=weighting, seed=seed)  # target 1
        (task,) = p.replay_groups.values()
        counts[task] += 1
    assert abs(counts["c"] / n - expected_c) < 0.03
    assert abs(counts["a"] / n - (1 - expected_c) / 2) < 0.03


def test_linear_weighting_prefers_hard_tasks():
    n = 3000
    hits = sum(
        plan(["q"], [("hard", 0), ("easy", 3)], 1.0, weighting="linear", seed=s).replay_groups == {0: "hard"}
        for s in range(n)
    )
    assert abs(hits / n - 0.8) < 0.03  # weights 4 and 1


# --------------------------------------------------------------------------------------------------------------------
# draw_replay_tasks: the O(batch) draw over bucket arrays (what the trainer draws from a pool)
# --------------------------------------------------------------------------------------------------------------------


def hand_weight(difficulty, bucket_size, G, weighting):
    """A task's weight, by hand: uniform 1; else its bucket's weight shared by the bucket's replayable tasks."""
    if weighting == "uniform":
        return 1.0
    if weighting == "normal":
        return math.exp(-0.5 * ((difficulty / G - 0.5) / 0.25) ** 2) / bucket_size
    return max(G - difficulty, 1) / bucket_size


def int_buckets(members, replayable, calls=None):
    """`TaskBuckets` over integer tasks: `members` difficulty -> tasks, `replayable(ids) -> mask` (vectorized);
    `calls` records the size of each predicate call and each listing."""
    arrays = {d: np.asarray(m, np.int64) for d, m in members.items()}

    def is_replayable(ids):
        if calls is not None:
            calls.append(len(ids))
        return replayable(np.asarray(ids, np.int64))

    def listing():
        if calls is not None:
            calls.append("listing")
        ids = np.concatenate([arrays[d] for d in sorted(arrays)])
        difficulties = np.concatenate([np.full(len(arrays[d]), d) for d in sorted(arrays)])
        ok = replayable(ids)
        return ids[ok], difficulties[ok]

    return TaskBuckets(arrays, is_replayable, listing, lambda ids: [f"t{int(i)}" for i in ids])


def in_set(tasks):
    tasks = np.asarray(sorted(tasks), np.int64)
    return lambda ids: np.isin(ids, tasks)


@pytest.mark.parametrize("weighting", ["uniform", "normal", "linear"])
def test_small_buckets_are_drawn_exactly_as_a_weighted_choice_without_replacement(weighting):
    pairs = [("a", 0), ("b", 1), ("c", 1), ("d", 2), ("e", 3), ("f", 3), ("g", 3)]
    sizes = {0: 1, 1: 2, 2: 1, 3: 3}
    w = np.array([hand_weight(d, sizes[d], 4, weighting) for _, d in pairs])
    for seed in range(20):
        expected = np.random.default_rng([seed, 5]).choice(len(pairs), size=3, replace=False, p=w / w.sum())
        drawn = draw_replay_tasks(
            TaskBuckets.from_pairs(pairs),
            3,
            num_generations=4,
            weighting=weighting,
            rng=np.random.default_rng([seed, 5]),
        )
        assert drawn == expected.tolist()
        # plan_replay over the list draws the same tasks with its seed
        p = plan(["q", "r", "s", "u", "v", "x"], pairs, 0.5, weighting=weighting, seed=[seed, 5])
        assert sorted(p.replay_groups.values()) == sorted(pairs[i][0] for i in expected)


@pytest.mark.parametrize("weighting", ["uniform", "normal", "linear"])
def test_rejection_draws_follow_the_weights_of_the_replayable_tasks_only(weighting):
    # bucket 0: 100 tasks, 10 replayable; bucket 2: 100, all replayable; bucket 3: 10, 2 replayable (tasks 200, 201)
    members = {0: range(100), 2: range(100, 200), 3: range(200, 210)}
    replayable = set(range(10)) | set(range(100, 200)) | {200, 201}
    sizes = {0: 10, 2: 100, 3: 2}
    bucket_p = {d: sizes[d] * hand_weight(d, sizes[d], 4, weighting) for d in sizes}
    total = sum(bucket_p.values())
    buckets = int_buckets(members, in_set(replayable))
    n = 3000
    hits = {0: 0, 2: 0, 3: 0}
    tasks_of_3 = {200: 0, 201: 0}
    for seed in range(n):
        (task,) = draw_replay_tasks(
            buckets, 1, num_generations=4, weighting=weighting, rng=np.random.default_rng(seed), exact_below=0
        )
        assert task in replayable
        difficulty = 0 if task < 100 else 2 if task < 200 else 3
        hits[difficulty] += 1
        if difficulty == 3:
            tasks_of_3[task] += 1
    for d in hits:
        assert abs(hits[d] / n - bucket_p[d] / total) < 0.03, (d, hits)
    if hits[3] > 200:  # uniform within the bucket's replayable tasks
        assert abs(tasks_of_3[200] / hits[3] - 0.5) < 0.1


def test_rejection_draws_without_replacement_shrink_a_drawn_bucket():
    # linear, G = 4: bucket 1 (tasks 0, 1) weighs 3, 1.5 per task; bucket 3 (40 tasks) weighs 1, 1/40 per task.
    # Drawing 2 without replacement: P({0, 1}) = 2 * (1.5 / 4) * (1.5 / 2.5) = 0.45 (successive draws with the weights
    # of the whole set); a draw that did not shrink bucket 1 once a task of it is drawn would give (3/4)^2 = 0.5625.
    buckets = int_buckets({1: [0, 1], 3: range(2, 42)}, lambda ids: np.ones(len(ids), bool))
    n = 4000
    both = 0
    for seed in range(n):
        drawn = draw_replay_tasks(
            buckets, 2, num_generations=4, weighting="linear", rng=np.random.default_rng(seed), exact_below=0
        )
        assert len(set(drawn)) == 2
        both += set(drawn) == {0, 1}
    assert abs(both / n - 0.45) < 0.03


def test_rejection_draws_fall_back_when_few_tasks_are_replayable():
    calls = []
    buckets = int_buckets({2: range(5000), 1: range(5000, 5100)}, in_set({7, 4000, 4999}), calls)
    for seed in range(10):
        rng = np.random.default_rng(seed)
        drawn = draw_replay_tasks(buckets, 10, num_generations=4, weighting="normal", rng=rng, exact_below=0)
        assert sorted(drawn) == [7, 4000, 4999]
    assert "listing" in calls  # the exact finish
    seen = set()
    for seed in range(30):
        for weighting in ("uniform", "normal"):
            rng = np.random.default_rng(seed)
            drawn = draw_replay_tasks(buckets, 2, num_generations=4, weighting=weighting, rng=rng, exact_below=0)
            assert len(set(drawn)) == 2 and set(drawn) <= {7, 4000, 4999}
            seen |= set(drawn)
    assert seen == {7, 4000, 4999}


def test_a_bucket_with_no_replayable_task_is_never_drawn():
    # bucket 2 (the heaviest under "normal") has no replayable task: every draw comes from bucket 0's 50
    buckets = int_buckets({2: range(3000), 0: range(3000, 3050)}, lambda ids: ids >= 3000)
    for seed in range(10):
        drawn = draw_replay_tasks(
            buckets, 8, num_generations=4, weighting="normal", rng=np.random.default_rng(seed), exact_below=0
        )
        assert len(set(drawn)) == 8 and all(3000 <= t < 3050 for t in drawn)


def test_a_draw_from_large_buckets_touches_a_few_tasks_only():
    calls = []
    members = {2: np.arange(1_000_000), 4: np.arange(1_000_000, 1_500_000), 6: np.arange(1_500_000, 1_500_100)}
    buckets = int_buckets(members, lambda ids: ids % 3 != 0, calls)
    for weighting in ("uniform", "normal", "linear"):
        calls.clear()
        drawn = draw_replay_tasks(buckets, 64, num_generations=8, weighting=weighting, rng=np.random.default_rng(1))
        assert len(set(drawn)) == 64 and all(t % 3 for t in drawn)
        assert "listing" not in calls and sum(calls) < 64 * 40, (weighting, sum(calls))


def test_plan_from_buckets_keeps_the_plan_invariants(monkeypatch):
    monkeypatch.setattr(planner, "EXACT_DRAW_TASKS", 0)
    members = {0: range(40), 1: range(40, 90), 3: range(90, 100)}
    buckets = int_buckets(members, lambda ids: ids % 4 != 1)
    keys = ["t0", "t4", "t5", "q", "r", "s", "t8", "u"]  # t0, t4 and t8 are replayable pool tasks; t5 is not
    for seed in range(40):
        p = plan(keys, buckets, 0.5, weighting="normal", seed=seed)
        tasks = list(p.replay_groups.values())
        assert p.num_tasks == 4 and len(set(tasks)) == 4
        assert all(int(t[1:]) % 4 != 1 for t in tasks)
        for g, t in p.replay_groups.items():
            if t in keys:
                assert keys.index(t) == g
            else:
                assert keys[g] not in tasks


@pytest.mark.parametrize("weighting", ["uniform", "normal"])
def test_a_bucket_mostly_not_replayable_is_scanned_once_not_listed(weighting):
    # bucket 1 holds 100,000 tasks none of which can be replayed: one scan of it, no listing of everything
    calls = []
    buckets = int_buckets({1: range(100_000), 2: range(100_000, 102_000)}, lambda ids: ids >= 100_000, calls)
    drawn = draw_replay_tasks(buckets, 64, num_generations=4, weighting=weighting, rng=np.random.default_rng(3))
    assert len(set(drawn)) == 64 and all(t >= 100_000 for t in drawn)
    assert "listing" not in calls
    assert calls.count(100_000) == 1 and sum(calls) < 100_000 + 64 * 40


def test_rank_rows_and_fresh_rows_per_rank():
    # 3 groups of G=4 over 2 ranks of 6 rows; groups 0 and 2 replay pool tasks "p" and "c" (group 2's own), k=2.
    plan = ReplayPlan(4, 2, {0: "p", 2: "c"})
    group_keys = ["a", "b", "c"]
    selected = {"p": ["p0", "p1"], "c": ["c0", "c1"]}
    assert plan.fresh_rows_per_rank(12, 6) == [4, 4]  # rank 0: rows 2, 3 replayed; rank 1: rows 10, 11
    swapped, replayed = plan.rank_rows(0, 6, group_keys, selected)
    assert swapped == {0: "p", 1: "p", 2: "p", 3: "p"} and replayed == {2: "p0", 3: "p1"}
    swapped, replayed = plan.rank_rows(6, 6, group_keys, selected)
    assert swapped == {} and replayed == {4: "c0", 5: "c1"}  # group 2's task is its own: no row swapped


def test_plan_rescue_takes_all_fail_fresh_groups_of_tasks_with_successes():
    """Groups of 4. A group is rescued only if none of its counted rows won, at least one failed, its task holds
    successes, and it is not skipped (a replay group, a guided one); None rows (replayed, no reward) do not count."""
    rows = (
        [False, False, None, False]  # 0: all counted rows failed: rescued
        + [False, False, True, False]  # 1: one success: it has a spread already
        + [None] * 4  # 2: nothing counted
        + [False] * 4  # 3: all failed, but its task holds nothing
        + [False] * 4  # 4: all failed, skipped (a replay group)
        + [False] * 4  # 5: the same task as group 0, also rescued
    )
    keys = ["a", "b", "c", "d", "e", "a"]
    has = [True, True, True, False, True, True]
    assert plan_rescue(rows, keys, 4, 1, has, skip_groups=[4]) == {0: "a", 5: "a"}
    assert plan_rescue(rows, keys, 4, 2, has, skip_groups=[4]) == {0: "a", 5: "a"}
    assert plan_rescue(rows, keys, 4, 0, has) == {}
