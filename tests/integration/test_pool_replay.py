"""The pool's side of replay at scale: bucket arrays kept as tasks move, the O(batch) draw of replay tasks from them
(`ExperiencePool.replay_buckets` + `planner.plan_replay`), `select` (what the trainer replays, chosen on the index),
and batched shard reads.

Expected draws and weights are worked out independently of the code under test (by hand, or from the pool's own
listing of replayable tasks, `replayable_tasks`, which is what the trainer drew from before).
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
from helpers import traj

from trl_exreplay import planner
from trl_exreplay.planner import plan_replay
from trl_exreplay.pool import ExperiencePool, TaskOutcome, rules
from trl_exreplay.pool.store import Shard, read_arrow


def record(pool, task_id, successes, entropies=(), version=0, num_fresh=4, task_row="default", n=3):
    task_row = json.dumps({"task_id": task_id}) if task_row == "default" else task_row
    trajectories = [traj(task_id, e, version, n=n, first=10 + i) for i, e in enumerate(entropies)]
    pool.record_outcome(TaskOutcome(task_id, successes, num_fresh, trajectories, task_row))


def bucket_members(pool, **limits) -> dict[int, list[str]]:
    buckets = pool.replay_buckets(**limits)
    return {d: buckets.names(m) for d, m in buckets.members.items()}


def drawn_tasks(pool, seed, wanted, weighting="uniform", G=4, **limits) -> list[str]:
    keys = [f"group-{g}" for g in range(wanted)]
    p = plan_replay(
        keys,
        pool.replay_buckets(**limits),
        num_tasks=wanted,
        num_generations=G,
        num_replayed=limits.get("min_trajectories", 1),
        weighting=weighting,
        seed=seed,
    )
    return list(p.replay_groups.values())


@pytest.fixture
def rejection(monkeypatch):
    """Small pools are drawn from exactly (over the listing); these tests want the O(batch) rejection draw."""
    monkeypatch.setattr(planner, "EXACT_DRAW_TASKS", 0)


# --------------------------------------------------------------------------------------------------------------------
# Bucket arrays
# --------------------------------------------------------------------------------------------------------------------


def test_bucket_arrays_follow_every_move_into_out_of_and_between_buckets():
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_store_rbound=4)
    rnd = random.Random(3)
    for step in range(400):
        task = f"t{rnd.randrange(40)}"
        record(pool, task, rnd.choice([0, 1, 2, 3, 4]), [rnd.random()], version=step)  # 4 of 4: the skip set
        members = bucket_members(pool)  # the bucketed tasks that hold trajectories (others cannot be replayed)
        holding = {d: sorted(t for t in ts if pool.trajectories(t)) for d, ts in pool.buckets().items()}
        assert {d: sorted(m) for d, m in members.items()} == {d: ts for d, ts in holding.items() if ts}
        assert all(len(set(m)) == len(m) for m in members.values())
    assert pool.skip_set and len(pool.buckets()) >= 3
    assert any(not pool.trajectories(t) for t in pool.buckets()[0])  # bucket 0: tasks never solved, left out


def test_live_and_loaded_pools_keep_the_same_bucket_arrays_and_draws(tmp_path, rejection):
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_store_rbound=4)
    rnd = random.Random(5)
    for step in range(800):  # tasks leave and re-enter buckets: the arrays are no longer in bucket order
        record(pool, f"t{rnd.randrange(200)}", rnd.choice([0, 1, 1, 2, 3, 4]), [rnd.random()], version=step)
    members = bucket_members(pool)
    assert sum(len(m) for m in members.values()) > 16 * 6  # drawing 6: by rejection, not over the listing
    assert any(m != [t for t in pool.buckets()[d] if pool.trajectories(t)] for d, m in members.items())
    pool.save(str(tmp_path / "pool"))
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    assert bucket_members(loaded) == members
    for seed in range(20):
        for weighting in ("uniform", "normal"):
            assert drawn_tasks(loaded, seed, 6, weighting) == drawn_tasks(pool, seed, 6, weighting)


# --------------------------------------------------------------------------------------------------------------------
# Drawing replay tasks from the buckets
# --------------------------------------------------------------------------------------------------------------------


def limited_pool():
    """Tasks in three buckets with every reason not to be replayable: skip set, no task row, too few trajectories,
    too old (versions 0..9)."""
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=4)
    rnd = random.Random(11)
    for i in range(300):
        successes = rnd.choice([1, 2, 3])
        count = rnd.choice([1, 2, 3])
        row = None if i % 17 == 0 else "default"
        record(pool, f"t{i:03d}", successes, [rnd.random() for _ in range(count)], version=i % 10, task_row=row)
    for i in range(0, 300, 13):
        record(pool, f"t{i:03d}", 4)  # fully solved: the skip set
    return pool


LIMITS = [
    {},
    {"min_trajectories": 2},
    {"min_trajectories": 1, "current_step": 10, "max_policy_age": 2},
    {"min_trajectories": 2, "current_step": 9, "max_policy_age": 5},
]


@pytest.mark.parametrize("limits", LIMITS)
def test_drawn_tasks_are_replayable_under_every_limit(limits, rejection):
    pool = limited_pool()
    replayable = {task for task, _ in pool.replayable_tasks(**limits)}
    assert 20 < len(replayable) < 270  # some of the 300 are not
    seen = set()
    for seed in range(30):
        for weighting in ("uniform", "normal", "linear"):
            tasks = drawn_tasks(pool, [seed, 1], 12, weighting, **limits)
            assert len(tasks) == 12 and len(set(tasks)) == 12
            assert set(tasks) <= replayable, set(tasks) - replayable
            seen |= set(tasks)
    assert len(seen) > len(replayable) // 2
    # asking for more than are replayable gives every replayable task
    assert set(drawn_tasks(pool, 0, 300, "normal", **limits)) == replayable


def test_draws_follow_the_bucket_weights_of_the_replayable_tasks(rejection):
    # bucket 1: 40 tasks, 20 of them too old at step 10 with age 3; bucket 2: 4 tasks; bucket 3: 60 tasks.
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_store_rbound=4)
    for i in range(40):
        record(pool, f"a{i}", 1, [0.5], version=0 if i % 2 else 9)
    for i in range(4):
        record(pool, f"b{i}", 2, [0.5], version=9)
    for i in range(60):
        record(pool, f"c{i}", 3, [0.5], version=9)
    limits = {"current_step": 10, "max_policy_age": 3}
    counts = {1: 20, 2: 4, 3: 60}  # replayable tasks per bucket
    normal = {d: math.exp(-0.5 * ((d / 4 - 0.5) / 0.25) ** 2) for d in counts}  # shared by the bucket's tasks
    n = 2000
    for weighting, expected in (
        ("normal", {d: normal[d] / sum(normal.values()) for d in counts}),
        ("uniform", {d: counts[d] / 84 for d in counts}),
    ):
        hits = {d: 0 for d in counts}
        for seed in range(n):
            (task,) = drawn_tasks(pool, seed, 1, weighting, **limits)
            assert not (task.startswith("a") and int(task[1:]) % 2)  # never a too-old one
            hits[{"a": 1, "b": 2, "c": 3}[task[0]]] += 1
        for d in counts:
            assert abs(hits[d] / n - expected[d]) < 0.035, (weighting, hits)


@pytest.mark.parametrize("weighting", ["uniform", "normal", "linear"])
def test_small_pools_plan_exactly_as_from_the_listed_replayable_tasks(weighting):
    pool = limited_pool()
    keys = ["t001", "t002", "q", "r", "t005", "s", "u", "v"]
    for limits in LIMITS:
        buckets = pool.replay_buckets(**limits)
        listed = pool.replayable_tasks(**limits)
        for seed in range(10):
            kwargs = dict(num_tasks=4, num_generations=4, num_replayed=1, weighting=weighting, seed=[seed, 2])
            assert plan_replay(keys, buckets, **kwargs) == plan_replay(keys, listed, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# select: what the trainer replays, chosen on the index
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["argmin", "argmax", "random"])
def test_select_is_the_rule_over_the_read_trajectories(mode, tmp_path):
    """`pool.select` decides on the index what `rules.select` decides over the trajectories read whole (their saved
    entropies and ids), with the same draws, and reads those."""
    pool = ExperiencePool(
        replay_max_trajectories_per_task=4, replay_store_rbound=8, replay_select_mode=mode, shard_rows=4
    )
    rnd = random.Random(2)
    for step in range(12):
        for task in ("a", "b", "c", "d"):
            record(pool, task, 3, [round(rnd.random(), 1) for _ in range(2)], version=step)
        if step == 8:
            pool.flush()  # some read from shard files, the last ones still pending
    for limits in ({}, {"current_step": 11, "max_policy_age": 3}):
        k = 1 if limits else 2
        read = {t: pool.trajectories(t, limits.get("current_step"), limits.get("max_policy_age")) for t in "cadb"}
        tasks = [t for t in read if len(read[t]) >= k]  # those a plan can hold
        assert len(tasks) >= 2, limits

        def want(rng, read=read, tasks=tasks, k=k):
            saved = {t: ([c.entropy for c in read[t]], [c.traj_id for c in read[t]]) for t in tasks}
            return {t: [read[t][i] for i in order] for t, order in rules.select(saved, k, mode, rng).items()}

        for seed in range(3):
            got = pool.select(tasks, k, rng=np.random.default_rng(seed), **limits)
            assert list(got) == tasks and got == want(np.random.default_rng(seed))
        if mode == "random":  # no rng: one seeded by the pool's seed
            assert pool.select(tasks, k, **limits) == want(np.random.default_rng(pool.seed))
    with pytest.raises(ValueError, match="Cannot select 5 trajectories out of 4"):
        pool.select(["a"], 5)
    with pytest.raises(ValueError, match="Cannot select 1 trajectories out of 0"):
        pool.select(["unknown"], 1)


# --------------------------------------------------------------------------------------------------------------------
# Reads: rows of memory-mapped shards, in any order
# --------------------------------------------------------------------------------------------------------------------


def test_rows_read_in_any_order_across_shards_are_the_arrow_values():
    pool = ExperiencePool(replay_max_trajectories_per_task=64, replay_store_rbound=8, shard_rows=16)
    rnd = random.Random(4)
    for i in range(60):
        record(pool, "a", 3, [rnd.random()], n=rnd.randrange(1, 3000), version=i)
    log = pool._trajectories
    keys = pool.index.keys(pool.index.task_index["a"])
    assert log.stats()["shards"] == 3 and log.stats()["pending_rows"] == 12  # 48 rows written, 12 pending
    names = ("prompt_ids", "completion_ids", "completion_mask", "logps", "rewards", "reward")
    picks = [40, 3, 3, 4, 59, 0, 5, 20, 21, 22, 50, 17, 16, 15]  # unsorted, repeated, adjacent, far apart, pending
    got = log.read([keys[i] for i in picks], names)
    for i, found in zip(picks, got):
        where = int(log.where[keys[i]])
        if i >= 48:
            assert (
                where == -1 and found == log.pending[keys[i]].select(list(names)).to_pylist()[0]
            )  # its one-row table
            continue
        assert isinstance(found, dict) and where >= 0
        shard = log.shards[where >> 32]
        assert isinstance(shard, Shard)
        table = read_arrow(shard.path)  # the file itself, read apart from the pool's mapping
        assert found == {name: table.column(name)[where & 0xFFFFFFFF].as_py() for name in names}
    written = [i for i in picks if i < 48]
    assert log.read([keys[i] for i in written], ("traj_id", "policy_version")) == [
        {"traj_id": i, "policy_version": i} for i in written
    ]  # each key's own row


def test_a_pool_holds_no_file_descriptor_for_its_shards(tmp_path):
    """Shards are memory maps, not open files: a live or loaded pool of many shards holds no descriptor for them
    (a pool of 1M trajectories has thousands of shards; a descriptor each would pass the usual limit of 1024)."""
    descriptors = len(os.listdir("/proc/self/fd"))
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_store_rbound=8, shard_rows=4)
    for i in range(40):
        record(pool, f"t{i}", 2, [0.1, 0.2])
    pool.flush()
    pool.save(str(tmp_path / "pool"))
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    for p in (pool, loaded):
        assert p.storage_stats()["trajectory_shards"] == 20
        chosen = p.select(p.stored_tasks(), 1)
        assert len(chosen) == 40 and all(ts[0].completion_ids == [10, 11, 12] for ts in chosen.values())
        assert [p.task_row(f"t{i}") for i in range(40)] == [{"task_id": f"t{i}"} for i in range(40)]
    assert len(os.listdir("/proc/self/fd")) == descriptors
    with open("/proc/self/maps") as f:  # address perms offset dev inode path
        mapped = {int(line.split()[4]) for line in f if line.rstrip().endswith(".arrow")}
    shards = [s for p in (pool, loaded) for s in p._trajectories.shards.values()]
    assert len(shards) == 40 and {s.inode[1] for s in shards} <= mapped  # read through their mappings
