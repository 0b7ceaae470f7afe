"""The `datasets`-only store that `benchmarks/pool_scale.py` measures ours against: it must keep the same trajectories
by the same rule, or its figures compare ours with something else."""

from __future__ import annotations

import random

from helpers import load_script


def test_datasets_store_keeps_the_lowest_entropy_rows_and_round_trips(tmp_path):
    scale = load_script("benchmarks/pool_scale.py", "pool_scale")
    base = {**scale.template(4, 6), "rewards": [1.0], "reward": 1.0}
    pool = scale.DatasetsPool(str(tmp_path), per_task=2)
    entropies = {"a": [0.9, 0.1, 0.5], "b": [0.3]}
    for task, values in entropies.items():
        for version, entropy in enumerate(values):
            pool.add(scale._datasets_record(base, task, entropy, version))
    pool.save()  # writes the pending rows as a shard with `datasets`, then the index
    assert {t: sorted(e for _, e in entries) for t, entries in pool.index.items()} == {"a": [0.1, 0.5], "b": [0.3]}
    loaded = scale.DatasetsPool.load(str(tmp_path), per_task=2)
    assert loaded.index == pool.index and len(loaded.data) == 4  # the evicted row's bytes stay in its shard
    rows = loaded.sample(2, random.Random(0))[:]
    assert sorted(zip(rows["task_id"], rows["entropy"])) == [("a", 0.10000000149011612), ("b", 0.30000001192092896)]
    assert rows["completion_ids"][0] == base["completion_ids"] and rows["policy_version"] in ([1, 0], [0, 1])
