"""Child process of `tests/unit/test_pool_store.py::test_killed_saves_always_leave_the_last_complete_pool`.

Changes a pool and saves it to FOLDER in a loop until killed: new trajectories, evictions of written ones
(dead rows), skip-set clears, new task rows, compactions, one or two kept snapshots. Prints ``saving <i> <content
hash>`` before each save and ``saved <i> <content hash> <seconds the save took>`` after it.

With ``--sweep``, kills instead a forked copy of itself before the 1st, 2nd, ... filesystem operation (link,
rename, remove, fsync, mkdir, rmtree) of each of a few saves, in turn, checks after each kill that the folder loads
as the last committed pool (or the new one, after the commit), then saves for real and goes on; prints one JSON line
with what it checked.

Usage: python pool_saver.py FOLDER WORK_DIR SEED [--sweep]
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory


def trajectory(rng: np.random.Generator, task_id: str, version: int) -> Trajectory:
    n = int(rng.integers(1, 300))
    return Trajectory(
        task_id,
        prompt_ids=rng.integers(0, 1000, 8).tolist(),
        completion_ids=rng.integers(0, 1000, n).tolist(),
        completion_mask=rng.integers(0, 2, n).tolist(),
        logps=(-rng.random(n)).tolist(),
        rewards=[1.0],
        reward=1.0,
        entropy=float(rng.random()),
        policy_version=version,
    )


def change(pool: ExperiencePool, rng: np.random.Generator, save: int) -> None:
    for _ in range(8):
        task_id = f"task-{int(rng.integers(20))}"
        successes = int(rng.integers(0, 7))
        row = json.dumps({"task_id": task_id, "prompt": f"solve {task_id}", "variant": int(rng.integers(3))})
        successful = [trajectory(rng, task_id, save) for _ in range(min(successes, 3))]
        pool.record_outcome(TaskOutcome(task_id, successes, 6, successful, row))


def sweep(folder: str, work_dir: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=6, work_dir=work_dir, shard_rows=16)
    report = {"kills": 0, "loaded_old": 0, "loaded_new": 0, "bad": []}
    for save in range(1, 6):
        committed = pool.content_hash() if save > 1 else None
        change(pool, rng, save)
        pool.flush()  # nothing pending or to compact: a forked save writes no shard into the scratch folder it shares
        new = pool.content_hash()
        for number in range(10_000) if save > 1 else ():
            child = os.fork()
            if child == 0:  # the writer: killed before operation `number` of this save, if it has that many
                from kill_points import die_before_operation  # beside this script, run as one

                die_before_operation(number)
                pool.save(folder)
                os._exit(0)
            _, status = os.waitpid(child, 0)
            if os.WIFEXITED(status):
                break  # the save has fewer operations: all its instants were visited
            report["kills"] += 1
            loaded = ExperiencePool.load(folder)
            digest = loaded.content_hash()
            if loaded.rejected_rows or digest not in (committed, new):
                report["bad"].append([save, number, loaded.rejected_rows])
            report["loaded_old" if digest == committed else "loaded_new"] += 1
            loaded.close()
        pool.save(folder)
    print(json.dumps(report), flush=True)


def main(folder: str, work_dir: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=6, work_dir=work_dir, shard_rows=16)
    save = 0
    while True:
        save += 1
        change(pool, rng, save)
        digest = pool.content_hash()
        print("saving", save, digest, flush=True)
        start = time.perf_counter()
        pool.save(folder)
        print("saved", save, digest, time.perf_counter() - start, flush=True)


if __name__ == "__main__":
    (sweep if sys.argv[4:] == ["--sweep"] else main)(sys.argv[1], sys.argv[2], int(sys.argv[3]))
