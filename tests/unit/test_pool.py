"""Tests for `trl_exreplay.pool`: buckets, skip set, store bounds, eviction, selection and persistence.

Expected values are worked out by hand from the ExGRPO / AgentEvolver design, never by calling the code under test.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np
import pyarrow as pa
import pytest
from helpers import reseal_pool

from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory, task_key
from trl_exreplay.pool.check import PoolFormatError
from trl_exreplay.pool.persistence import read_state, state_files
from trl_exreplay.pool.store import TRAJECTORY_SCHEMA, read_arrow


def f32(x: float) -> float:
    """What the pool stores for a float: its float32 value."""
    return float(np.float32(x))


def traj(task_id: str, entropy: float, version: int = 0, n: int = 2, reward: float = 1.0, first_token: int = 3):
    completion = [first_token + i for i in range(n)]
    return Trajectory(
        task_id,
        prompt_ids=[1, 2],
        completion_ids=completion,
        completion_mask=[1] * n,
        logps=[-0.1 * (i + 1) for i in range(n)],
        rewards=[reward, 0.5],
        reward=reward,
        entropy=entropy,
        policy_version=version,
    )


def outcome(task_id, successes, num_fresh=4, entropies=(), version=0, task_row="default"):
    row = json.dumps({"task_id": task_id, "prompt": f"solve {task_id}"}) if task_row == "default" else task_row
    return TaskOutcome(task_id, successes, num_fresh, [traj(task_id, e, version) for e in entropies], row)


def entropies(pool, task_id):
    return [t.entropy for t in pool.trajectories(task_id)]


def ids(pool, task_id):
    return [t.traj_id for t in pool.trajectories(task_id)]


# --------------------------------------------------------------------------------------------------------------------
# Trajectory
# --------------------------------------------------------------------------------------------------------------------


def test_trajectory_normalises_to_stored_dtypes():
    t = Trajectory(
        "t",
        prompt_ids=np.array([1, 2], dtype=np.int64),
        completion_ids=(np.int32(5), 6),
        completion_mask=[True, False],
        logps=[0.1, -0.3],
        rewards=np.array([0.7], dtype=np.float64),
        reward=0.7,
        entropy=0.1,
        policy_version=np.int64(3),
    )
    assert t.prompt_ids == [1, 2] and all(type(x) is int for x in t.prompt_ids)
    assert t.completion_ids == [5, 6] and all(type(x) is int for x in t.completion_ids)
    assert t.completion_mask == [1, 0] and all(type(x) is int for x in t.completion_mask)
    # float32 rounding: 0.1 is not exactly representable, so the stored value differs from the Python literal
    assert t.logps == [f32(0.1), f32(-0.3)] and t.logps[0] != 0.1
    assert t.rewards == [f32(0.7)] and type(t.rewards[0]) is float
    assert t.reward == f32(0.7) and type(t.reward) is float
    assert t.entropy == f32(0.1) and t.entropy != 0.1
    assert t.policy_version == 3 and type(t.policy_version) is int
    assert t.traj_id == -1


@pytest.mark.parametrize(
    "mask, logps",
    [([1], [-0.1, -0.2]), ([1, 1], [-0.1]), ([1, 1, 1], [-0.1, -0.2])],
    ids=["short_mask", "short_logps", "long_mask"],
)
def test_trajectory_length_mismatch_raises(mask, logps):
    with pytest.raises(ValueError, match="must have the same length"):
        Trajectory("t", [1], [3, 4], mask, logps, [1.0], 1.0, 0.5, 0)


# --------------------------------------------------------------------------------------------------------------------
# Buckets and skip set
# --------------------------------------------------------------------------------------------------------------------


def test_buckets_hold_each_task_by_its_successes():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("t1", 2, entropies=[0.5]))
    pool.record_outcome(outcome("t2", 1, entropies=[0.5]))
    pool.record_outcome(outcome("t3", 2))
    pool.record_outcome(outcome("t4", 0))
    assert pool.buckets() == {0: ["t4"], 1: ["t2"], 2: ["t1", "t3"]}
    assert [pool.bucket_of(t) for t in ("t1", "t2", "t3", "t4", "nope")] == [2, 1, 2, 0, None]
    assert pool.skip_set == []


def test_task_moves_to_its_latest_bucket_only():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("t1", 2, entropies=[0.5]))
    pool.record_outcome(outcome("t2", 2, entropies=[0.4]))
    pool.record_outcome(outcome("t1", 1, entropies=[0.3]))
    assert pool.buckets() == {1: ["t1"], 2: ["t2"]}
    pool.record_outcome(outcome("t1", 2))
    # back in bucket 2, after t2 (bucket order follows the latest update)
    assert pool.buckets() == {2: ["t2", "t1"]}
    all_tasks = [t for tasks in pool.buckets().values() for t in tasks]
    assert sorted(all_tasks) == ["t1", "t2"]
    # the earlier trajectories of t1 are kept: moving bucket does not clear the store
    assert entropies(pool, "t1") == [f32(0.5), f32(0.3)]


def test_fully_solved_task_enters_skip_set_and_leaves_buckets_and_store():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("t1", 2, entropies=[0.5, 0.6]))
    pool.record_outcome(outcome("t2", 1, entropies=[0.2]))
    assert pool.num_trajectories == 3
    pool.record_outcome(outcome("t1", 4, num_fresh=4, entropies=[0.1, 0.1, 0.1, 0.1]))
    assert pool.skip_set == ["t1"]
    assert pool.bucket_of("t1") is None
    assert pool.buckets() == {1: ["t2"]}
    assert pool.trajectories("t1") == []
    assert pool.num_trajectories == 1 and pool.num_tasks == 1
    # the task row is kept (the task can still be rolled out), but the task is not replayable
    assert pool.task_row("t1") == {"task_id": "t1", "prompt": "solve t1"}
    assert pool.replayable_tasks() == [("t2", 1)]


def test_skip_set_task_leaves_it_when_not_fully_solved():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("t1", 3, num_fresh=3))  # all 3 fresh rollouts succeed: skip
    pool.record_outcome(outcome("t2", 4, num_fresh=4))
    assert pool.skip_set == ["t1", "t2"]
    assert pool.buckets() == {}
    pool.record_outcome(outcome("t1", 3, num_fresh=4, entropies=[0.7, 0.2, 0.5]))
    assert pool.skip_set == ["t2"]
    assert pool.buckets() == {3: ["t1"]}
    assert entropies(pool, "t1") == [f32(0.7), f32(0.2), f32(0.5)]
    # fully solved again: back in the skip set, store cleared again
    pool.record_outcome(outcome("t1", 2, num_fresh=2))
    assert pool.skip_set == ["t2", "t1"]
    assert pool.trajectories("t1") == [] and pool.buckets() == {}


def test_no_fresh_rollouts_is_not_fully_solved():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("t1", 0, num_fresh=0))
    assert pool.skip_set == []
    assert pool.buckets() == {0: ["t1"]}


def test_stats_counts():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("t1", 2, entropies=[0.5, 0.6]))
    pool.record_outcome(outcome("t2", 2, entropies=[0.5]))
    pool.record_outcome(outcome("t3", 0))
    pool.record_outcome(outcome("t4", 4))
    assert pool.stats() == {
        "pool_tasks": 2.0,
        "pool_trajectories": 3.0,
        "skip_set": 1.0,
        "pool_rejected_rows": 0.0,
        "bucket_0": 1.0,
        "bucket_2": 2.0,
    }


# --------------------------------------------------------------------------------------------------------------------
# Store bounds, capacity, eviction, store mode
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("successes, stored", [(0, False), (1, False), (2, True), (3, False)])
def test_store_only_strictly_between_bounds(successes, stored):
    pool = ExperiencePool(replay_store_lbound=1, replay_store_rbound=3)
    pool.record_outcome(outcome("t", successes, num_fresh=4, entropies=[0.3] * successes))
    assert pool.bucket_of("t") == successes  # bucketed whatever the bounds
    assert pool.num_trajectories == (successes if stored else 0)


def test_default_bounds_store_one_to_rbound_minus_one():
    pool = ExperiencePool(replay_store_rbound=4)
    for s in range(4):
        pool.record_outcome(outcome(f"t{s}", s, num_fresh=4, entropies=[0.3] * s))
    assert [len(pool.trajectories(f"t{s}")) for s in range(4)] == [0, 1, 2, 3]


def test_traj_ids_are_sequential_across_tasks_and_drops():
    pool = ExperiencePool(replay_max_trajectories_per_task=1, replay_store_rbound=4)
    pool.record_outcome(outcome("a", 2, entropies=[0.5, 0.9]))  # ids 0 (kept), 1 (dropped: higher entropy)
    pool.record_outcome(outcome("b", 1, entropies=[0.4]))  # id 2
    assert ids(pool, "a") == [0] and ids(pool, "b") == [2]


def test_argmin_eviction_replaces_highest_entropy_else_drops():
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_select_mode="argmin")
    assert [pool.add(traj("t", e)) for e in (0.5, 0.2, 0.9)] == [True, True, True]
    assert entropies(pool, "t") == [f32(0.5), f32(0.2), f32(0.9)] and ids(pool, "t") == [0, 1, 2]
    assert pool.add(traj("t", 0.4)) is True  # replaces 0.9 in place
    assert entropies(pool, "t") == [f32(0.5), f32(0.2), f32(0.4)] and ids(pool, "t") == [0, 1, 3]
    assert pool.add(traj("t", 0.6)) is False  # higher than every stored one: dropped
    assert pool.add(traj("t", 0.5)) is False  # equal to the highest: not lower, dropped
    assert entropies(pool, "t") == [f32(0.5), f32(0.2), f32(0.4)] and ids(pool, "t") == [0, 1, 3]
    assert pool.add(traj("t", 0.1)) is True  # replaces 0.5
    assert entropies(pool, "t") == [f32(0.1), f32(0.2), f32(0.4)] and ids(pool, "t") == [6, 1, 3]


def test_argmax_eviction_replaces_lowest_entropy_else_drops():
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_select_mode="argmax")
    for e in (0.5, 0.2, 0.9):
        pool.add(traj("t", e))
    assert pool.add(traj("t", 0.1)) is False
    assert pool.add(traj("t", 0.2)) is False  # equal to the lowest: not higher, dropped
    assert pool.add(traj("t", 0.7)) is True  # replaces 0.2 in place
    assert entropies(pool, "t") == [f32(0.5), f32(0.7), f32(0.9)] and ids(pool, "t") == [0, 5, 2]
    assert pool.add(traj("t", 0.6)) is True  # replaces 0.5
    assert entropies(pool, "t") == [f32(0.6), f32(0.7), f32(0.9)] and ids(pool, "t") == [6, 5, 2]


def test_random_eviction_is_fifo():
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_select_mode="random")
    results = [pool.add(traj("t", e)) for e in (0.1, 0.9, 0.5, 0.3)]
    assert results == [True, True, True, True]
    assert ids(pool, "t") == [2, 3] and entropies(pool, "t") == [f32(0.5), f32(0.3)]


def test_capacity_is_per_task():
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_select_mode="argmin", replay_store_rbound=4)
    pool.record_outcome(outcome("a", 3, entropies=[0.3, 0.1, 0.2]))  # 0.2 replaces 0.3
    pool.record_outcome(outcome("b", 2, entropies=[0.9, 0.8]))
    assert entropies(pool, "a") == [f32(0.2), f32(0.1)]
    assert entropies(pool, "b") == [f32(0.9), f32(0.8)]
    assert pool.num_trajectories == 4 and pool.num_tasks == 2


@pytest.mark.parametrize(
    "mode, store_mode, expected",
    [
        ("argmin", "all", [0.3, 0.1, 0.2]),
        ("argmin", "best", [0.1]),
        ("argmax", "best", [0.3]),
        ("random", "all", [0.3, 0.1, 0.2]),
    ],
)
def test_pool_store_mode(mode, store_mode, expected):
    pool = ExperiencePool(replay_select_mode=mode, replay_store_mode=store_mode, replay_store_rbound=4)
    pool.record_outcome(outcome("t", 3, entropies=[0.3, 0.1, 0.2]))
    assert entropies(pool, "t") == [f32(e) for e in expected]


def test_pool_store_mode_best_random_stores_one_deterministically():
    def build(seed):
        pool = ExperiencePool(replay_select_mode="random", replay_store_mode="best", replay_store_rbound=4, seed=seed)
        for step in range(6):
            pool.record_outcome(outcome("t", 3, entropies=[0.1 * step + 0.01 * i for i in range(3)]))
        return pool

    a, b = build(0), build(0)
    assert len(a.trajectories("t")) == 5  # one per outcome, 6 outcomes, capacity 5 (FIFO)
    assert entropies(a, "t") == entropies(b, "t")
    for step, e in enumerate(entropies(a, "t"), start=1):
        assert e in [f32(0.1 * step + 0.01 * i) for i in range(3)]


def test_pool_store_mode_best_keeps_capacity_rule():
    pool = ExperiencePool(replay_max_trajectories_per_task=1, replay_store_mode="best", replay_store_rbound=4)
    pool.record_outcome(outcome("t", 2, entropies=[0.4, 0.6]))
    pool.record_outcome(outcome("t", 2, entropies=[0.5, 0.7]))  # best 0.5 is not lower than 0.4: dropped
    assert entropies(pool, "t") == [f32(0.4)]
    pool.record_outcome(outcome("t", 2, entropies=[0.3, 0.2]))
    assert entropies(pool, "t") == [f32(0.2)]


# --------------------------------------------------------------------------------------------------------------------
# Queries: candidates, replayable tasks, selection, task rows
# --------------------------------------------------------------------------------------------------------------------


def test_trajectories_policy_age():
    pool = ExperiencePool()
    for version in (1, 5, 8):
        pool.add(traj("t", 0.5, version=version))
    versions = lambda ts: [t.policy_version for t in ts]  # noqa: E731
    assert versions(pool.trajectories("t")) == [1, 5, 8]
    assert versions(pool.trajectories("t", current_step=10)) == [1, 5, 8]
    assert versions(pool.trajectories("t", max_policy_age=0)) == [1, 5, 8]
    assert versions(pool.trajectories("t", current_step=10, max_policy_age=5)) == [5, 8]  # age 5 is allowed
    assert versions(pool.trajectories("t", current_step=10, max_policy_age=1)) == []
    assert versions(pool.trajectories("t", current_step=8, max_policy_age=0)) == [8]
    assert pool.trajectories("unknown") == []


def test_replayable_tasks():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("A", 2, entropies=[0.5, 0.6], version=0))
    pool.record_outcome(outcome("B", 1, entropies=[0.5], version=9))
    pool.record_outcome(outcome("C", 2, entropies=[0.5, 0.6], task_row=None))  # no task row: cannot roll out
    pool.record_outcome(outcome("D", 0))  # bucketed, nothing stored
    pool.record_outcome(outcome("E", 2, entropies=[0.5]))
    pool.record_outcome(outcome("E", 4))  # skip set
    pool.add(traj("A", 0.4, version=9))
    assert pool.replayable_tasks() == [("A", 2), ("B", 1)]
    assert pool.replayable_tasks(min_trajectories=2) == [("A", 2)]
    assert pool.replayable_tasks(min_trajectories=3) == [("A", 2)]
    assert pool.replayable_tasks(min_trajectories=4) == []
    assert pool.replayable_tasks(1, current_step=10, max_policy_age=1) == [("A", 2), ("B", 1)]
    assert pool.replayable_tasks(2, current_step=10, max_policy_age=1) == []  # A has a single young trajectory
    assert pool.replayable_tasks(1, current_step=11, max_policy_age=1) == []
    # a task row arriving later makes C replayable; a later unstored outcome moves A's bucket and order
    pool.record_outcome(outcome("C", 1))
    pool.record_outcome(outcome("A", 0))
    assert pool.replayable_tasks() == [("B", 1), ("C", 1), ("A", 0)]


def test_task_row():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("A", 1, task_row=json.dumps({"prompt": [{"role": "user", "content": "hi"}], "x": 1})))
    pool.record_outcome(outcome("B", 1, task_row=None))
    assert pool.task_row("A") == {"prompt": [{"role": "user", "content": "hi"}], "x": 1}
    assert pool.task_row("B") is None
    # a later outcome without a row keeps the recorded one
    pool.record_outcome(outcome("A", 2, task_row=None))
    assert pool.task_row("A") == {"prompt": [{"role": "user", "content": "hi"}], "x": 1}


def _stored(pool, values):
    """Store trajectories of task "t" with the entropies `values` (ids 0, 1, ...)."""
    for e in values:
        pool.add(traj("t", e))


def _selected(pool, num, rng=None):
    return [t.traj_id for t in pool.select(["t"], num, rng=rng)["t"]]


def test_select_argmin_by_saved_entropy():
    pool = ExperiencePool(replay_max_trajectories_per_task=10, replay_select_mode="argmin")
    _stored(pool, [0.5, 0.1, 0.3, 0.1])
    assert _selected(pool, 1) == [1]
    assert _selected(pool, 2) == [1, 3]  # tie on entropy: older first
    assert _selected(pool, 3) == [1, 3, 2]
    assert _selected(pool, 0) == []


def test_select_argmax_by_saved_entropy():
    pool = ExperiencePool(replay_max_trajectories_per_task=10, replay_select_mode="argmax")
    _stored(pool, [0.5, 0.1, 0.3, 0.5])
    assert _selected(pool, 1) == [0]
    assert _selected(pool, 3) == [0, 3, 2]


def test_select_random():
    pool = ExperiencePool(replay_max_trajectories_per_task=10, replay_select_mode="random", seed=3)
    _stored(pool, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    picked = _selected(pool, 3)
    assert len(set(picked)) == 3 and set(picked) <= set(range(6))
    assert _selected(pool, 3) == picked  # pool seed: deterministic
    assert sorted(_selected(pool, 6)) == [0, 1, 2, 3, 4, 5]
    assert _selected(pool, 6, np.random.default_rng(7)) == _selected(pool, 6, np.random.default_rng(7))
    orders = {tuple(_selected(pool, 6, np.random.default_rng(s))) for s in range(10)}
    assert len(orders) > 1  # the rng really drives the choice


@pytest.mark.parametrize("mode", ["argmin", "argmax", "random"])
def test_select_more_than_candidates_raises(mode):
    pool = ExperiencePool(replay_select_mode=mode)
    _stored(pool, [0.1, 0.2])
    with pytest.raises(ValueError, match="Cannot select 3"):
        pool.select(["t"], 3)


# --------------------------------------------------------------------------------------------------------------------
# task_key
# --------------------------------------------------------------------------------------------------------------------


def test_task_key_uses_column():
    assert task_key({"task_id": 7, "prompt": "x"}, "task_id") == "7"
    assert task_key({"id": "abc", "prompt": "x"}, "id") == "abc"


def test_task_key_hashes_prompt_when_column_missing_or_none():
    prompt = [{"role": "user", "content": "héllo"}]
    blob = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    expected = "prompt-" + hashlib.sha1(blob.encode()).hexdigest()[:16]
    assert task_key({"prompt": prompt}, "task_id") == expected
    assert task_key({"prompt": prompt, "task_id": None}, "task_id") == expected
    reordered = [{"content": "héllo", "role": "user"}]
    assert task_key({"prompt": reordered}, "task_id") == expected  # key order does not matter
    assert task_key({"prompt": "other"}, "task_id") != expected
    assert len(expected) == len("prompt-") + 16


# --------------------------------------------------------------------------------------------------------------------
# content_hash
# --------------------------------------------------------------------------------------------------------------------


def build_pool(**kwargs) -> ExperiencePool:
    """A pool with several buckets, a skip set, task rows, evictions and several trajectory versions."""
    settings = dict(
        replay_max_trajectories_per_task=2, replay_store_lbound=0, replay_store_rbound=4, replay_select_mode="argmin"
    )
    pool = ExperiencePool(**{**settings, **kwargs})
    pool.record_outcome(outcome("a", 2, entropies=[0.31, 0.12], version=1))
    pool.record_outcome(outcome("b", 1, entropies=[0.77], version=2))
    pool.record_outcome(outcome("c", 3, entropies=[0.5, 0.25, 0.125], version=2))
    pool.record_outcome(outcome("d", 4))
    pool.record_outcome(outcome("e", 0))
    pool.record_outcome(outcome("a", 1, entropies=[0.05], version=3))  # evicts 0.31
    pool.record_outcome(outcome("f", 2, entropies=[0.2, 0.3], task_row=None))
    return pool


def test_content_hash_equal_for_equal_pools_and_sensitive_to_content():
    a, b = build_pool(), build_pool()
    assert a.content_hash() == b.content_hash()
    assert len(a.content_hash()) == 64
    before = a.content_hash()
    a.trajectories("b")[0].entropy = f32(0.78)  # the pool hands out copies: its content does not change
    a.trajectories("b")[0].logps[0] = 5.0
    assert a.content_hash() == before and a.trajectories("b")[0].entropy == f32(0.77)
    one_entropy_differs = build_pool()
    one_entropy_differs.record_outcome(outcome("zz", 1, entropies=[0.78]))
    a.record_outcome(outcome("zz", 1, entropies=[0.77]))
    assert a.content_hash() != one_entropy_differs.content_hash()
    assert build_pool(seed=1).content_hash() != b.content_hash()  # settings are content
    c = build_pool()
    c.record_outcome(outcome("g", 0))
    assert c.content_hash() != b.content_hash()


# --------------------------------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------------------------------


def assert_same_pool(loaded: ExperiencePool, pool: ExperiencePool):
    assert loaded.content_hash() == pool.content_hash()
    assert loaded.buckets() == pool.buckets()
    assert loaded.skip_set == pool.skip_set
    assert loaded.replayable_tasks() == pool.replayable_tasks()
    assert loaded.stats() == pool.stats()
    for name in (
        "replay_max_trajectories_per_task",
        "replay_store_lbound",
        "replay_store_rbound",
        "replay_select_mode",
    ):
        assert getattr(loaded, name) == getattr(pool, name)
    assert (loaded.replay_store_mode, loaded.seed) == (pool.replay_store_mode, pool.seed)
    tasks = [t for tasks in pool.buckets().values() for t in tasks] + pool.skip_set
    for task_id in tasks:
        assert loaded.task_row(task_id) == pool.task_row(task_id)
        got, want = loaded.trajectories(task_id), pool.trajectories(task_id)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.task_id == w.task_id
            assert g.prompt_ids == w.prompt_ids
            assert g.completion_ids == w.completion_ids
            assert g.completion_mask == w.completion_mask
            assert g.logps == w.logps
            assert g.rewards == w.rewards
            assert g.reward == w.reward
            assert g.entropy == w.entropy
            assert g.policy_version == w.policy_version
            assert g.traj_id == w.traj_id
            assert g == w


def test_save_load_round_trip(tmp_path):
    pool = build_pool()
    # the fixture really holds what the round trip is meant to cover
    assert pool.buckets() == {0: ["e"], 1: ["b", "a"], 2: ["f"], 3: ["c"]}
    assert pool.skip_set == ["d"] and pool.num_trajectories == 7
    assert entropies(pool, "c") == [f32(0.125), f32(0.25)] and ids(pool, "c") == [5, 4]
    assert entropies(pool, "a") == [f32(0.05), f32(0.12)]
    pool.save(str(tmp_path / "pool"))
    assert sorted(os.listdir(tmp_path)) == ["pool"]  # no temporary folder left behind
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    assert loaded.rejected_rows == 0
    assert_same_pool(loaded, pool)
    assert entropies(loaded, "a") == [f32(0.05), f32(0.12)]
    assert loaded.trajectories("b")[0].logps == [f32(-0.1), f32(-0.2)]


def test_loaded_pool_continues_like_the_live_one(tmp_path):
    pool = build_pool(replay_select_mode="random", replay_store_mode="best")
    pool.save(str(tmp_path / "pool"))
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    for p in (pool, loaded):  # traj ids and the "best"/random draw depend on the persisted counters
        p.record_outcome(outcome("b", 3, entropies=[0.6, 0.7, 0.8], version=4))
        p.record_outcome(outcome("h", 1, entropies=[0.9], version=4))
    assert loaded.content_hash() == pool.content_hash()
    assert ids(loaded, "h") == ids(pool, "h")


def test_save_load_empty_pool(tmp_path):
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=6, seed=5)
    pool.save(str(tmp_path / "pool"))
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    assert loaded.content_hash() == pool.content_hash()
    assert loaded.num_trajectories == 0 and loaded.buckets() == {} and loaded.skip_set == []
    assert (loaded.replay_max_trajectories_per_task, loaded.replay_store_rbound, loaded.seed) == (3, 6, 5)


def test_save_load_pool_without_trajectories(tmp_path):
    # early in training: tasks bucketed and skipped, nothing stored yet (a checkpoint must still resume)
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(outcome("a", 0))
    pool.record_outcome(outcome("b", 4))
    pool.record_outcome(outcome("c", 2, entropies=[0.5]))
    pool.record_outcome(outcome("c", 4))
    assert pool.num_trajectories == 0
    pool.save(str(tmp_path / "pool"))
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    assert_same_pool(loaded, pool)
    assert loaded.buckets() == {0: ["a"]} and loaded.skip_set == ["b", "c"]


def test_save_over_existing_pool(tmp_path):
    path = str(tmp_path / "pool")
    first = build_pool()
    first.save(path)
    second = build_pool()
    second.record_outcome(outcome("b", 4))  # b goes to the skip set
    second.record_outcome(outcome("z", 2, entropies=[0.4]))
    assert second.content_hash() != first.content_hash()
    second.save(path)
    assert sorted(os.listdir(tmp_path)) == ["pool"]  # the old copy and the temporary folder are gone
    loaded = ExperiencePool.load(path)
    assert_same_pool(loaded, second)
    assert loaded.skip_set == ["d", "b"] and loaded.trajectories("b") == []


def test_save_creates_parent_folders(tmp_path):
    path = str(tmp_path / "a" / "b" / "pool")
    build_pool().save(path)
    assert ExperiencePool.load(path).content_hash() == build_pool().content_hash()


def test_leftover_tmp_folder_does_not_break_load(tmp_path):
    pool = build_pool()
    path = str(tmp_path / "pool")
    pool.save(path)
    junk = tmp_path / ".pool.tmp-deadbeef"
    junk.mkdir()
    (junk / "state.json").write_text("{not json")
    assert_same_pool(ExperiencePool.load(path), pool)
    pool.record_outcome(outcome("b", 4))
    pool.save(path)  # saving again next to the leftover works too
    assert_same_pool(ExperiencePool.load(path), pool)


def files_of(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def test_interrupted_save_leaves_the_previous_pool(tmp_path):
    pool = build_pool()
    path = tmp_path / "pool"
    pool.save(str(path))
    committed = files_of(path)
    assert committed == sorted(state_files(read_state(str(path))))
    # what a save killed before its commit leaves: new shards and tasks table, temporary files, a half state.json
    shard = next(name for name in committed if name.startswith("trajectories-"))
    os.link(path / shard, path / "trajectories-0123456789abcdef.arrow")
    (path / "tasks-0123456789abcdef.arrow").write_bytes(b"ARROW1 half a table")
    (path / ".tasks-0123456789abcdef.arrow.tmp-0123456789ab").write_bytes(b"partial")
    (path / ".state.json.tmp-0123456789ab").write_text('{"format_version": 2, "snap')
    assert_same_pool(ExperiencePool.load(str(path)), pool)
    pool.record_outcome(outcome("b", 4))
    pool.record_outcome(outcome("z", 2, entropies=[0.4]))
    pool.save(str(path))  # the next save removes the leftovers
    assert files_of(path) == sorted(state_files(read_state(str(path))))
    assert_same_pool(ExperiencePool.load(str(path)), pool)


def test_load_missing_pool_raises(tmp_path):
    (tmp_path / ".pool.tmp-0000aaaa").mkdir()
    with pytest.raises(FileNotFoundError, match="No experience pool"):
        ExperiencePool.load(str(tmp_path / "pool"))
    with pytest.raises(FileNotFoundError):
        ExperiencePool.load(str(tmp_path / "missing_parent" / "pool"))


def test_failed_save_keeps_previous_pool_and_cleans_up(tmp_path, monkeypatch):
    import trl_exreplay.pool.persistence as pool_module

    pool = build_pool()
    path = tmp_path / "pool"
    pool.save(str(path))
    committed = files_of(path)
    changed = build_pool()
    changed.record_outcome(outcome("z", 2, entropies=[0.4]))

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pool_module, "write_json_atomic", boom)  # the commit fails, after shards and tasks table
    with pytest.raises(OSError, match="disk full"):
        changed.save(str(path))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["pool"]
    assert files_of(path) == committed  # what the failed save added is gone
    assert_same_pool(ExperiencePool.load(str(path)), pool)
    changed.save(str(path))
    assert_same_pool(ExperiencePool.load(str(path)), changed)


def test_a_failed_shard_write_keeps_its_rows_waiting_the_index_whole_and_fails_the_save(tmp_path, monkeypatch, caplog):
    """A full disk on the training path: the outcome is recorded whole (as on the ranks that hold the index only, which
    write nothing), the rows wait, no partial file is left, and a save raises until a write succeeds."""
    import trl_exreplay.pool.store as store

    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=4, shard_rows=2)
    index_only = ExperiencePool.from_index_snapshot(pool.index_snapshot())
    write = store.write_arrow

    def full_disk(path, table):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "write_arrow", full_disk)
    with caplog.at_level(logging.WARNING, logger="trl_exreplay.pool"):
        for p in (pool, index_only):
            p.record_outcome(outcome("a", 3, entropies=[0.1, 0.2, 0.3]))  # the 2nd and 3rd adds' writes fail
    assert [r.getMessage().count("could not write a shard") for r in caplog.records] == [1]  # said once
    assert pool.index_hash() == index_only.index_hash()
    assert entropies(pool, "a") == [f32(0.1), f32(0.2), f32(0.3)]  # read from the rows that wait
    assert pool.storage_stats()["trajectory_pending_rows"] == 3
    assert [f for _, _, fs in os.walk(pool.scratch_folder()) for f in fs] == []  # no partial file left
    with pytest.raises(OSError, match="No space left"):
        pool.save(str(tmp_path / "pool"))
    assert not (tmp_path / "pool" / "state.json").exists()
    monkeypatch.setattr(store, "write_arrow", write)
    pool.save(str(tmp_path / "pool"))
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    assert loaded.rejected_rows == 0 and entropies(loaded, "a") == [f32(0.1), f32(0.2), f32(0.3)]
    assert loaded.content_hash() == pool.content_hash() and loaded.index_hash() == index_only.index_hash()


def test_load_rejects_other_format_version(tmp_path):
    path = tmp_path / "pool"
    build_pool().save(str(path))
    state = json.loads((path / "state.json").read_text())
    state["format_version"] = 99
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="format_version 99"):
        ExperiencePool.load(str(path))


def _rewrite_rows(path, edit):
    """Replace the trajectory shards of the pool saved at `path` by `edit(rows)` of their rows (a new file under
    the same name: the shards are hard links shared with the live pool, which must not change)."""
    for name in state_files(read_state(path)):
        if not name.startswith("trajectories-"):
            continue
        file = os.path.join(path, name)
        rows = edit(read_arrow(file).to_pylist())
        table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
        with pa.OSFile(file + ".new", "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        os.replace(file + ".new", file)
    reseal_pool(path)  # crafted with valid checksums: the rows themselves must be refused


def test_row_with_bad_shape_is_rejected_not_fatal(tmp_path):
    pool = build_pool()
    path = str(tmp_path / "pool")
    pool.save(path)
    bad_id = pool.trajectories("c")[0].traj_id

    def edit(rows):
        for row in rows:
            if row["traj_id"] == bad_id:
                row["completion_mask"] = row["completion_mask"][:-1]  # one token short
        return rows

    _rewrite_rows(path, edit)
    loaded = ExperiencePool.load(path)
    assert loaded.rejected_rows == 1
    assert loaded.num_trajectories == pool.num_trajectories - 1
    assert ids(loaded, "c") == [t.traj_id for t in pool.trajectories("c")[1:]]
    for task_id in ("a", "b", "f"):
        assert loaded.trajectories(task_id) == pool.trajectories(task_id)
    assert loaded.buckets() == pool.buckets() and loaded.skip_set == pool.skip_set


def test_rows_are_found_by_id_and_a_row_of_another_task_or_a_missing_one_is_counted(tmp_path):
    pool = build_pool()
    path = str(tmp_path / "pool")
    pool.save(path)
    b_id, (c_first, c_second) = pool.trajectories("b")[0].traj_id, ids(pool, "c")

    def edit(rows):
        for row in rows:
            if row["traj_id"] == b_id:
                row["task_id"] = "c"  # the row claims another task than the one that lists it
        rows.reverse()  # where a row is does not matter: it is found by its id
        return [row for row in rows if row["traj_id"] != c_first]  # a listed trajectory no shard holds

    _rewrite_rows(path, edit)
    loaded = ExperiencePool.load(path)
    assert loaded.rejected_reasons == {"row of another task": 1, "missing row": 1}
    assert loaded.trajectories("b") == [] and ids(loaded, "c") == [c_second]
    for task_id in ("a", "f"):
        assert loaded.trajectories(task_id) == pool.trajectories(task_id)

    def duplicate(rows):
        return rows + [rows[0]]

    _rewrite_rows(path, duplicate)
    with pytest.raises(PoolFormatError, match="holds a trajectory that another row of the pool holds too"):
        ExperiencePool.load(path)


@pytest.mark.parametrize(
    "column", ["prompt_ids", "logps", "rewards", "reward", "entropy", "policy_version", "traj_id"]
)
def test_a_null_in_a_shard_refuses_the_pool_naming_file_and_column(tmp_path, column):
    # The pool never writes a null: one is a hand-made file, refused as a whole, with a clear error.
    pool = build_pool()
    path = str(tmp_path / "pool")
    pool.save(path)
    bad_id = pool.trajectories("b")[0].traj_id

    def edit(rows):
        for row in rows:
            if row["traj_id"] == bad_id:
                row[column] = [1, None] if column in ("prompt_ids", "logps", "rewards") else None
        return rows

    _rewrite_rows(path, edit)
    with pytest.raises(PoolFormatError, match=rf"trajectories-[0-9a-f]{{16}}\.arrow: column `{column}` holds a null"):
        ExperiencePool.load(path)


def test_stale_trajectories_are_evicted_first_under_max_policy_age():
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_select_mode="argmin", replay_max_policy_age=5)
    pool.add(traj("t", entropy=0.1, version=0))
    pool.add(traj("t", entropy=0.2, version=0))
    # a higher-entropy but young trajectory would be refused by argmin; the stale ones make room instead
    assert pool.add(traj("t", entropy=0.9, version=10))
    assert sorted(t.policy_version for t in pool.trajectories("t")) == [0, 10]
    assert [t.entropy for t in pool.trajectories("t")] == [f32(0.2), f32(0.9)]
    assert pool.add(traj("t", entropy=0.8, version=11))
    assert sorted(t.policy_version for t in pool.trajectories("t")) == [10, 11]
    # nothing stale left: back to argmin eviction (0.95 > max entropy 0.9: dropped)
    assert not pool.add(traj("t", entropy=0.95, version=12))
    assert [len(pool.trajectories("t", current_step=12, max_policy_age=5))] == [2]


def test_configure_reports_changed_settings_and_refuses_unknown_ones():
    pool = ExperiencePool(replay_max_trajectories_per_task=5, replay_select_mode="argmin")
    assert pool.configure(replay_max_trajectories_per_task=5, replay_select_mode="argmax") == ["replay_select_mode"]
    assert pool.replay_select_mode == "argmax"
    with pytest.raises(ValueError, match="capacity"):
        pool.configure(capacity=3)


@pytest.mark.parametrize("first", [True, False])
def test_a_save_that_fails_after_its_commit_keeps_what_it_committed(tmp_path, monkeypatch, first):
    """An error after `state.json` was replaced (a signal in the last fsync) must not prune the files it names."""
    import trl_exreplay.pool.persistence as persistence

    pool, path = build_pool(), str(tmp_path / "pool")
    if not first:
        ExperiencePool(replay_store_rbound=4).save(path)
    real = persistence.fsync_path

    def fsync(target):
        committed = os.path.exists(os.path.join(path, "state.json")) and read_state(path)
        if target == path and committed and committed["counters"]["num_outcomes"] == pool.index.num_outcomes:
            raise KeyboardInterrupt  # the commit is done: this is its final fsync
        real(target)

    monkeypatch.setattr(persistence, "fsync_path", fsync)
    with pytest.raises(KeyboardInterrupt):
        pool.save(path)
    monkeypatch.setattr(persistence, "fsync_path", real)
    assert ExperiencePool.load(path).content_hash() == pool.content_hash()


def test_a_row_no_task_lists_must_have_an_id_below_next_traj_id(tmp_path):
    # An unlisted row is an evicted one; with an id the pool has yet to hand out, a later save would hold it twice.
    pool, path = build_pool(), str(tmp_path / "pool")
    pool.save(path)
    _rewrite_rows(path, lambda rows: rows + [{**rows[0], "traj_id": pool.index.next_traj_id}])
    with pytest.raises(PoolFormatError, match=r"holds a `traj_id` outside \[0, counters.next_traj_id\)"):
        ExperiencePool.load(path)


def test_a_save_removes_only_the_files_it_writes(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    theirs = ["tasks-todo.txt", "trajectories-notes.md", "tasks-0123.arrow"]
    for name in theirs:
        (folder / name).write_text("mine")
    (folder / "trajectories-old").mkdir()
    pool = build_pool()
    pool.save(str(folder))
    pool.record_outcome(outcome("z", 2, entropies=[0.4]))
    pool.save(str(folder))
    assert ExperiencePool.load(str(folder)).content_hash() == pool.content_hash()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*theirs, "trajectories-old", *state_files(read_state(str(folder)))]
    )


def test_a_lowered_capacity_keeps_the_best_of_each_task_and_saves_a_pool_its_load_accepts(tmp_path):
    pool = build_pool(replay_max_trajectories_per_task=3)
    assert entropies(pool, "c") == [f32(0.5), f32(0.25), f32(0.125)]
    assert pool.configure(replay_max_trajectories_per_task=1) == ["replay_max_trajectories_per_task"]
    assert entropies(pool, "c") == [f32(0.125)] and entropies(pool, "a") == [f32(0.05)]  # argmin: the lowest
    pool.save(str(tmp_path / "pool"))
    assert ExperiencePool.load(str(tmp_path / "pool")).content_hash() == pool.content_hash()
