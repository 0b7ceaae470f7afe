"""Experience pool at scale: `ExperiencePool` (memory-mapped Arrow shards) against the design of ExGRPO's code
(github.com/ElliottYan/LUFFY, folder ExGRPO: its dataset's `experience`, a Python dict of each question's trajectories
in RAM, `verl/mix_src/experience/rl_dataset_with_experience.py`, pickled whole with the data loader at each checkpoint,
`_save_checkpoint` in `verl/trainer/ppo/ray_trainer.py`), measured in the same run.

For each size N (trajectories of ``--prompt-tokens`` + ``--completion-tokens`` tokens with a log-prob per completion
token, 5 per task, N / 5 tasks), each step in a fresh process so that memory is measured cleanly:

* ours, build: fill a pool through `record_outcome`, save it, then time add 512 (with no row pending before, so that
  the adds only buffer their rows), the write of 512 buffered rows (`flush`: an Arrow shard file, then the compaction
  of the shards more dead than live, synchronously on the calling thread, as a training step pays it once its rows
  fill a shard), the replay read of 64: the trainer's per-step replay selection for
  64 replay groups of 128 (the calls `ExReplayGRPOTrainer` makes, with its default settings but the trajectories
  replayed by saved entropy: `plan_replay` over `pool.replay_buckets(...)`, then `pool.select(...)`, which reads the
  64 chosen trajectories), the plan alone, the same plan drawn from the full list of replayable tasks
  (`replayable_tasks`, what the trainer did before: O(pool)), an incremental save into the same folder and into a
  new checkpoint folder.
* ours, load: RSS with an empty pool, load the saved pool, the replay read of 64, add 512 and save incrementally: RSS
  growth.
* baseline, build: ``{task: [trajectory dict of numpy arrays]}`` (compact: Python lists of token ids and log-probs
  would need ~120 GB at 1M), same fill; add 512 (lists -> arrays; this library's per-task capacity and argmin
  eviction), sample 64 as ExGRPO's code does (``random.sample`` of the valid task list, `sample_experience_uids` in
  `verl/mix_src/experience/experience_helpers.py`; argmin entropy), save = ``pickle.dump`` of the whole dict.
* baseline, load: RSS growth of ``pickle.load``.

Prints a table and writes JSON (figures, machine, versions). Data lives in a temporary folder, removed at the end.

    OMP_NUM_THREADS=1 python benchmarks/pool_scale.py --sizes 10000,100000,1000000 --json pool_scale.json

Two versions of ours in one run (a change to the pool must keep its figures): ``--against DIR`` runs each version's
own script on its own library, one after the other, and prints the figures a training step or a checkpoint pays with
their ratio (this / DIR):

    OMP_NUM_THREADS=1 python benchmarks/pool_scale.py --sizes 1000000 --against /tmp/before --json against.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import pickle
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

PER_TASK = 5
ADD, SAMPLE = 512, 64


# ------------------------------------------------------------------------------------------------------------ helpers
def rss_mb() -> dict[str, float]:
    """Resident memory of this process (MB): total, anonymous and file-backed (mapped shards) parts, and the peak."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def median_ms(fn, repeats: int, cpu: bool = False):
    """Median wall time of `fn(i)` (ms); with `cpu`, also the median CPU time of the calling thread (ms), which
    other processes on the machine do not inflate."""
    walls, cpus = [], []
    for i in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn(i)
        walls.append((time.perf_counter() - start) * 1e3)
        cpus.append((time.thread_time() - start_cpu) * 1e3)
    return (statistics.median(walls), statistics.median(cpus)) if cpu else statistics.median(walls)


def template(prompt_tokens: int, completion_tokens: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "prompt_ids": rng.integers(0, 150_000, prompt_tokens).tolist(),
        "completion_ids": rng.integers(0, 150_000, completion_tokens).tolist(),
        "completion_mask": [1] * completion_tokens,
        "logps": np.float32(-rng.random(completion_tokens)).tolist(),
    }


def replay_plan(pool, step: int, replayable=None):
    """The trainer's draw of one step's replay tasks, with the defaults of `ExReplayGRPOConfig` (128 groups of G = 8,
    replay_ratio 0.5, k = 1, uniform bucket weighting, no age limit)."""
    from trl_exreplay.planner import plan_replay

    return plan_replay(
        [f"group-{g}" for g in range(2 * SAMPLE)],
        pool.replay_buckets(1, step, None) if replayable is None else replayable(),
        num_tasks=SAMPLE,  # replay_ratio 0.5 of 2 * SAMPLE groups
        num_generations=8,
        num_replayed=1,
        weighting="uniform",
        seed=[0, step, 0],
    )


def replay_read(pool, step: int) -> dict:
    """One step's replay read (`selection.select_trajectories` with replay_select_by_current_entropy=False: the replayed
    trajectory by saved entropy, since scoring candidates under the current policy needs a model): the plan, then
    `pool.select`, which reads the chosen trajectories from the shards."""
    plan = replay_plan(pool, step)
    return pool.select(list(plan.replay_groups.values()), 1, step, None, np.random.default_rng([0, step, 0, 1]))


def make_trajectory(base, task_id: str, entropy: float, version: int):
    # Setup only (not timed): a shallow copy of one normalised trajectory instead of `Trajectory(...)`, whose
    # per-token normalisation would make filling a million trajectories take ten minutes more.
    trajectory = copy.copy(base)
    trajectory.task_id, trajectory.entropy, trajectory.policy_version = task_id, entropy, version
    return trajectory


def entropy_of(rng: np.random.Generator) -> float:
    return float(np.float32(rng.random()))


def fill(pool, size: int, base, rng: np.random.Generator) -> None:
    """`size` trajectories, `PER_TASK` successful ones for each task, recorded as the trainer records outcomes."""
    from trl_exreplay.pool import TaskOutcome

    for task in range(size // PER_TASK):
        task_id = f"task-{task:07d}"
        successful = [make_trajectory(base, task_id, entropy_of(rng), 0) for _ in range(PER_TASK)]
        row = json.dumps({"task_id": task_id, "prompt": [{"role": "user", "content": f"solve task {task}"}]})
        pool.record_outcome(TaskOutcome(task_id, PER_TASK, 8, successful, row))


# ------------------------------------------------------------------------------------------------------------ ours
def ours_build(size: int, folder: str, prompt_tokens: int, completion_tokens: int) -> dict:
    from trl_exreplay.pool import ExperiencePool, Trajectory

    parts = template(prompt_tokens, completion_tokens)
    base = Trajectory("t", rewards=[1.0], reward=1.0, entropy=0.5, policy_version=0, **parts)
    rng = np.random.default_rng(1)
    baseline_rss = rss_mb()
    pool = ExperiencePool(replay_max_trajectories_per_task=PER_TASK, replay_store_rbound=8, work_dir=folder)
    start = time.perf_counter()
    fill(pool, size, base, rng)
    pool.flush()
    fill_s = time.perf_counter() - start
    saved = os.path.join(folder, "pool")
    start = time.perf_counter()
    pool.save(saved)
    first_save_s = time.perf_counter() - start
    os.sync()  # let the kernel write back the fill's ~10 GB now, not during the measurements

    tasks = size // PER_TASK
    version = [1]

    def add(_):
        batch = [
            make_trajectory(base, f"task-{int(t):07d}", entropy_of(rng), version[0])
            for t in rng.integers(0, tasks, ADD)
        ]
        pool.flush()  # start with no row pending: the timed adds write no shard (`flush_ms` times a write)
        start, start_cpu = time.perf_counter(), time.thread_time()
        for trajectory in batch:
            pool.add(trajectory)
        version[0] += 1
        return (time.perf_counter() - start) * 1e3, (time.thread_time() - start_cpu) * 1e3

    adds = [add(i) for i in range(5)]
    add_ms, add_cpu_ms = statistics.median(a for a, _ in adds), statistics.median(c for _, c in adds)
    # The same adds without the row checks (non-finite values, mask values, token ids; issue 24), to tell the store's
    # own cost from theirs.
    import trl_exreplay.pool.experience_pool as pool_module

    checks = pool_module.bad_trajectory_rows
    pool_module.bad_trajectory_rows = lambda table, rows, vocab_size: (np.zeros(len(rows), bool), {})
    try:
        unchecked_ms = statistics.median(add(5 + i)[0] for i in range(5))
    finally:
        pool_module.bad_trajectory_rows = checks

    # The write of 512 buffered rows: one Arrow shard file, then the compaction of the shards more dead than live, on
    # the calling thread (a training step pays it when its rows fill a shard of `shard_rows`).
    def write(i):
        pool.flush()  # untimed: the rows the adds above left pending
        while (missing := ADD - pool.storage_stats()["trajectory_pending_rows"]) > 0:  # an add may be refused
            for t in rng.integers(0, tasks, missing):
                pool.add(make_trajectory(base, f"task-{int(t):07d}", entropy_of(rng), 99 + i))
        start, start_cpu = time.perf_counter(), time.thread_time()
        pool.flush()
        return (time.perf_counter() - start) * 1e3, (time.thread_time() - start_cpu) * 1e3

    writes = [write(i) for i in range(5)]
    flush_ms, flush_cpu_ms = statistics.median(w for w, _ in writes), statistics.median(c for _, c in writes)

    step = version[0]
    assert (
        replay_plan(pool, step).num_tasks == SAMPLE and sum(len(v) for v in replay_read(pool, step).values()) == SAMPLE
    )
    plan_ms, plan_cpu_ms = median_ms(lambda i: replay_plan(pool, step + i), 20, cpu=True)
    sample_ms, sample_cpu_ms = median_ms(lambda i: replay_read(pool, step + i), 50, cpu=True)
    listed_ms = median_ms(lambda i: replay_plan(pool, step + i, lambda: pool.replayable_tasks(1, step, None)), 5)

    def incremental(target):
        for trajectory in [
            make_trajectory(base, f"task-{int(t):07d}", entropy_of(rng), 200) for t in rng.integers(0, tasks, ADD)
        ]:
            pool.add(trajectory)
        pool.flush()
        start = time.perf_counter()
        pool.save(target)
        return (time.perf_counter() - start) * 1e3

    save_ms = statistics.median(incremental(saved) for _ in range(3))
    checkpoint_ms = statistics.median(incremental(os.path.join(folder, f"checkpoint-{i}")) for i in range(3))
    for i in range(3):
        shutil.rmtree(os.path.join(folder, f"checkpoint-{i}"))
    gc.collect()
    memory = rss_mb()
    stats = pool.storage_stats()
    return {
        "fill_s": fill_s,
        "first_save_s": first_save_s,
        "add_ms": add_ms,
        "add_cpu_ms": add_cpu_ms,
        "add_unchecked_ms": unchecked_ms,
        "flush_ms": flush_ms,
        "flush_cpu_ms": flush_cpu_ms,
        "sample_ms": sample_ms,  # the replay read of 64: for ours, the trainer's plan and `select`
        "sample_cpu_ms": sample_cpu_ms,
        "sample_touched_ms": sample_ms,  # `select` returns Python lists: nothing is left to convert
        "sample_touched_cpu_ms": sample_cpu_ms,
        "trainer_plan_ms": plan_ms,
        "trainer_plan_cpu_ms": plan_cpu_ms,
        "trainer_plan_listed_ms": listed_ms,
        "save_ms": save_ms,
        "checkpoint_save_ms": checkpoint_ms,
        "rss_empty_mb": baseline_rss,
        "rss_mb": memory,
        "rss_growth_mb": memory["VmRSS"] - baseline_rss["VmRSS"],
        "trajectories": pool.num_trajectories,
        "storage": stats,
        "disk_gb": sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(saved) for n in ns) / 1e9,
    }


def ours_load(size: int, folder: str, prompt_tokens: int, completion_tokens: int) -> dict:
    from trl_exreplay.pool import ExperiencePool, Trajectory

    parts = template(prompt_tokens, completion_tokens)
    base = Trajectory("t", rewards=[1.0], reward=1.0, entropy=0.5, policy_version=0, **parts)
    empty = ExperiencePool(work_dir=folder)

    # The integrity checks' cost: the default load (every file's size, name, xxh3-64 checksum, Arrow layout and row
    # values checked) against one without the checksums, both after a first load that brings the files into the page
    # cache where RAM allows (so both read from the same cache state), the second twice to see the spread.
    def unverified() -> float:
        start = time.perf_counter()
        ExperiencePool.load(os.path.join(folder, "pool"), work_dir=folder, verify=False).close()
        return time.perf_counter() - start

    first_s = unverified()
    unverified_s = unverified()
    gc.collect()
    before = rss_mb()
    start = time.perf_counter()
    pool = ExperiencePool.load(os.path.join(folder, "pool"), work_dir=folder)
    load_s = time.perf_counter() - start
    after_load = rss_mb()
    unverified_again_s = unverified()
    sample_ms, sample_cpu_ms = median_ms(lambda i: replay_read(pool, 100 + i), 50, cpu=True)
    rng = np.random.default_rng(2)
    for t in rng.integers(0, size // PER_TASK, ADD):
        pool.add(make_trajectory(base, f"task-{int(t):07d}", entropy_of(rng), 300))
    pool.save(os.path.join(folder, "pool"))
    gc.collect()
    memory = rss_mb()
    del empty
    return {
        "load_s": load_s,
        "load_without_checksums_s": unverified_s,
        "load_without_checksums_again_s": unverified_again_s,
        "first_load_s": first_s,
        "sample_after_load_ms": sample_ms,
        "sample_after_load_cpu_ms": sample_cpu_ms,
        "rss_empty_mb": before,
        "rss_after_load_mb": after_load,
        "rss_mb": memory,
        "rss_growth_mb": memory["VmRSS"] - before["VmRSS"],
        "trajectories": pool.num_trajectories,
    }


# -------------------------------------------------------------------------------------------------------- baseline
class DictPool:
    """ExGRPO's pool with this library's per-task capacity: task -> list of trajectories in RAM, a skip set, pickled
    whole to save."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.task2trajectories: dict[str, list[dict]] = {}
        self.skip: set[str] = set()

    def add(self, trajectory) -> None:
        entry = {
            "prompt_ids": np.asarray(trajectory.prompt_ids, np.int32),
            "completion_ids": np.asarray(trajectory.completion_ids, np.int32),
            "completion_mask": np.asarray(trajectory.completion_mask, np.int8),
            "logps": np.asarray(trajectory.logps, np.float32),
            "entropy": trajectory.entropy,
            "policy_version": trajectory.policy_version,
        }
        stored = self.task2trajectories.setdefault(trajectory.task_id, [])
        if len(stored) < self.capacity:
            stored.append(entry)
            return
        worst = max(range(len(stored)), key=lambda i: stored[i]["entropy"])
        if entry["entropy"] < stored[worst]["entropy"]:
            stored[worst] = entry

    def sample(self, num: int, rng: random.Random) -> list[dict]:
        valid = [t for t, ts in self.task2trajectories.items() if ts and t not in self.skip]
        return [min(self.task2trajectories[t], key=lambda e: e["entropy"]) for t in rng.sample(valid, num)]


def baseline_build(size: int, folder: str, prompt_tokens: int, completion_tokens: int) -> dict:
    from trl_exreplay.pool import Trajectory

    parts = template(prompt_tokens, completion_tokens)
    base = Trajectory("t", rewards=[1.0], reward=1.0, entropy=0.5, policy_version=0, **parts)
    arrays = {
        "prompt_ids": np.asarray(parts["prompt_ids"], np.int32),
        "completion_ids": np.asarray(parts["completion_ids"], np.int32),
        "completion_mask": np.asarray(parts["completion_mask"], np.int8),
        "logps": np.asarray(parts["logps"], np.float32),
    }
    rng = np.random.default_rng(1)
    before = rss_mb()
    pool = DictPool(PER_TASK)
    start = time.perf_counter()
    for task in range(size // PER_TASK):  # setup: own copies of the arrays (not timed as adds)
        pool.task2trajectories[f"task-{task:07d}"] = [
            {**{k: v.copy() for k, v in arrays.items()}, "entropy": entropy_of(rng), "policy_version": 0}
            for _ in range(PER_TASK)
        ]
    fill_s = time.perf_counter() - start
    tasks = size // PER_TASK

    def add(_):
        batch = [make_trajectory(base, f"task-{int(t):07d}", entropy_of(rng), 1) for t in rng.integers(0, tasks, ADD)]
        start, start_cpu = time.perf_counter(), time.thread_time()
        for trajectory in batch:
            pool.add(trajectory)
        return (time.perf_counter() - start) * 1e3, (time.thread_time() - start_cpu) * 1e3

    adds = [add(i) for i in range(5)]
    add_ms, add_cpu_ms = statistics.median(a for a, _ in adds), statistics.median(c for _, c in adds)
    sample_ms, sample_cpu_ms = median_ms(lambda i: pool.sample(SAMPLE, random.Random(i)), 20, cpu=True)
    path = os.path.join(folder, "pool.pkl")
    start = time.perf_counter()
    with open(path, "wb") as f:
        pickle.dump(pool.task2trajectories, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())
    save_s = time.perf_counter() - start
    memory = rss_mb()
    return {
        "fill_s": fill_s,
        "add_ms": add_ms,
        "add_cpu_ms": add_cpu_ms,
        "sample_ms": sample_ms,
        "sample_cpu_ms": sample_cpu_ms,
        "save_ms": save_s * 1e3,
        "rss_empty_mb": before,
        "rss_mb": memory,
        "rss_growth_mb": memory["VmRSS"] - before["VmRSS"],
        "disk_gb": os.path.getsize(path) / 1e9,
    }


def baseline_load(size: int, folder: str, prompt_tokens: int, completion_tokens: int) -> dict:
    gc.collect()
    before = rss_mb()
    start = time.perf_counter()
    with open(os.path.join(folder, "pool.pkl"), "rb") as f:
        store = pickle.load(f)
    load_s = time.perf_counter() - start
    memory = rss_mb()
    assert sum(len(ts) for ts in store.values()) >= size
    return {
        "load_s": load_s,
        "rss_empty_mb": before,
        "rss_mb": memory,
        "rss_growth_mb": memory["VmRSS"] - before["VmRSS"],
    }


# ------------------------------------------------------------------------------------------------------------ ranks
def io_bytes() -> dict[str, int]:
    """This process's I/O counters: bytes handed to write calls (`wchar`) and bytes sent to the block device."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(":") for line in f)
    return {"wchar": int(fields["wchar"]), "write_bytes": int(fields["write_bytes"])}


def mapped_pss_mb(folder: str) -> float:
    """Proportional set size (MB) of this process's mappings of files under `folder`."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if (
                head and "-" in head[0] and len(head) >= 5
            ):  # a mapping's first line; its path, if any, is the 6th field
                inside = len(head) >= 6 and head[5].startswith(folder)
            elif inside and head and head[0] == "Pss:":
                total += int(head[1])
    return total / 1024


def files_under(folder: str | None) -> tuple[int, int]:
    """Files and bytes under `folder`."""
    if folder is None or not os.path.isdir(folder):
        return 0, 0
    paths = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    return len(paths), sum(os.path.getsize(path) for path in paths if os.path.isfile(path))


def rank_worker(size: int, folder: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """One rank of `--ranks`: the pool as the trainer keeps it (the same outcomes recorded in the same order on every
    rank, under the run's work folder), one step's add and replay read, and a checkpoint save by rank 0 only
    (`should_save`); bytes written, files, mapped memory and times of this rank. `POOL_SCALE_SHARING`: "broadcast"
    (as `ExReplayGRPOTrainer`: rank 0 alone holds the rows, the other ranks its index, made with
    `ExperiencePool.from_index_snapshot`, and they receive the rows rank 0 reads for a step with
    `broadcast_object_list`) or "none" (every rank holds and writes the whole pool: one copy per rank)."""
    import torch.distributed as dist

    from trl_exreplay.pool import ExperiencePool, Trajectory

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    parts = template(prompt_tokens, completion_tokens)
    base = Trajectory("t", rewards=[1.0], reward=1.0, entropy=0.5, policy_version=0, **parts)
    rng = np.random.default_rng(1)  # the same draws on every rank: the pools are rank-identical, as in training
    work = os.path.join(folder, "work")
    pool = ExperiencePool(replay_max_trajectories_per_task=PER_TASK, replay_store_rbound=8, work_dir=work)
    broadcast = os.environ.get("POOL_SCALE_SHARING", "none") == "broadcast"
    if broadcast:  # as the trainer takes a pool: rank 0's index sent to the others
        snapshot = [pool.index_snapshot() if rank == 0 else None]
        dist.broadcast_object_list(snapshot, src=0)
        if rank != 0:
            pool.close()
            pool = ExperiencePool.from_index_snapshot(snapshot[0])
    dist.barrier()
    io_start = io_bytes()
    start = time.perf_counter()
    fill(pool, size, base, rng)
    if pool.holds_rows:  # an index-only pool (`from_index_snapshot`) has no rows to write
        pool.flush()
    fill_s = time.perf_counter() - start
    dist.barrier()
    batch = [
        make_trajectory(base, f"task-{int(t):07d}", entropy_of(rng), 1) for t in rng.integers(0, size // PER_TASK, ADD)
    ]
    start = time.perf_counter()
    for trajectory in batch:
        pool.add(trajectory)
    if pool.holds_rows:
        pool.flush()
    add_ms = (time.perf_counter() - start) * 1e3
    dist.barrier()
    if broadcast:  # rank 0 reads the step's rows and sends them; the others receive them

        def read(step):
            rows = [replay_read(pool, step) if rank == 0 else None]
            dist.broadcast_object_list(rows, src=0)
            return rows[0]

        sample_ms = median_ms(lambda i: read(2 + i), 10)
    else:
        sample_ms = median_ms(lambda i: replay_read(pool, 2 + i), 10)
    dist.barrier()
    save_ms = None
    if rank == 0:
        start = time.perf_counter()
        pool.save(os.path.join(folder, "checkpoint", "exreplay_pool"))
        save_ms = (time.perf_counter() - start) * 1e3
    dist.barrier()
    io_end = io_bytes()
    scratch = pool.scratch_folder()  # this rank's live shards (None: it holds none)
    files, disk = files_under(scratch)
    out = {
        "rank": rank,
        "fill_s": fill_s,
        "add_ms": add_ms,
        "sample_ms": sample_ms,
        "save_ms": save_ms,
        "wchar_mb": (io_end["wchar"] - io_start["wchar"]) / 1e6,
        "write_bytes_mb": (io_end["write_bytes"] - io_start["write_bytes"]) / 1e6,
        "scratch_files": files,
        "scratch_mb": disk / 1e6,
        "mapped_pss_mb": mapped_pss_mb(folder),
        "pool_hash": pool.index_hash(),
    }
    dist.barrier()
    pool.close()
    dist.destroy_process_group()
    return out


def run_ranks(world: int, size: int, folder: str, args, sharing: str) -> list[dict]:
    """`world` rank processes of `rank_worker` meeting over gloo on a loopback port; their results, by rank."""
    from accelerate.utils.other import get_free_port

    port = get_free_port()
    processes = []
    for rank in range(world):
        command = [sys.executable, os.path.abspath(__file__), "--worker", "rank", "--size", str(size), "--dir", folder,
                   "--prompt-tokens", str(args.prompt_tokens), "--completion-tokens", str(args.completion_tokens)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "POOL_SCALE_SHARING": sharing}  # fmt: skip
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start, results = time.perf_counter(), []
    for rank, process in enumerate(processes):
        stdout, stderr = process.communicate(timeout=3600)
        if process.returncode != 0:
            raise RuntimeError(f"rank {rank} of {world} failed:\n{stderr[-4000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    print(f"  ranks {world}, sharing {sharing}: {time.perf_counter() - start:7.1f} s", flush=True)
    assert len({r["pool_hash"] for r in results}) == 1, "the ranks' pool indexes differ"
    return results


def ranks_table(by_world: dict, size: int) -> str:
    """Per number of ranks, every rank holding the pool ("none") and rank 0 alone ("broadcast", the trainer's): sums
    over the ranks (bytes, files, mapped memory), the slowest rank's times, and the ratio of the bytes to 1 rank's."""
    lines = [
        f"{size:,} trajectories, every rank's pool under one work folder (the trainer's `_exreplay_pool_work`), "
        "checkpoint saved by rank 0. MB written: handed to write calls (`wchar`, sockets included: `broadcast` sends its rows "
        "that way), all ranks. MB on disk: the ranks' live shard files (one copy in the page cache each). Files: shard "
        "files, all ranks. PSS: the ranks' mappings of pool files, summed (`datasets` memory-maps the shards: the "
        "pages a rank has read). Times: the slowest rank.",
        "",
        "| ranks | sharing | MB written | vs 1 rank | MB on disk | files | PSS MB | add 512 | read 64 | save (rank 0) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, modes in sorted(by_world.items()):
        for sharing, ranks in modes.items():
            one = sum(r["wchar_mb"] for r in by_world[min(by_world)][sharing])
            written = sum(r["wchar_mb"] for r in ranks)
            lines.append(
                f"| {world} | {sharing} | {written:,.0f} | {written / one:.2f}x | {sum(r['scratch_mb'] for r in ranks):,.0f} | "
                f"{sum(r['scratch_files'] for r in ranks)} | {sum(r['mapped_pss_mb'] for r in ranks):.1f} | "
                f"{fmt_ms(max(r['add_ms'] for r in ranks))} | {fmt_ms(max(r['sample_ms'] for r in ranks))} | "
                f"{fmt_ms(ranks[0]['save_ms'])} |"
            )
    return "\n".join(lines)


WORKERS = {
    "rank": rank_worker,
    "ours_build": ours_build,
    "ours_load": ours_load,
    "baseline_build": baseline_build,
    "baseline_load": baseline_load,
}


# ---------------------------------------------------------------------------------------------------------- driver
def run_worker(role: str, size: int, folder: str, args, checkout: str | None = None) -> dict:
    """Run `role` in a fresh process; with `checkout`, that checkout's own script on its own library (`--against`)."""
    script = os.path.abspath(__file__) if checkout is None else os.path.join(checkout, "benchmarks", "pool_scale.py")
    command = [
        sys.executable,
        script,
        "--worker",
        role,
        "--size",
        str(size),
        "--dir",
        folder,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--completion-tokens",
        str(args.completion_tokens),
    ]
    root = checkout or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": root}
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{role} {size} failed:\n{result.stderr[-4000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"  {role:15s} N={size:>9,d}  {time.perf_counter() - start:7.1f} s", flush=True)
    return out


def machine() -> dict:
    import datasets
    import pyarrow

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's library
    import trl_exreplay

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) / 1024**2
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except OSError:
        commit = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(total, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "pyarrow": pyarrow.__version__,
        "datasets": datasets.__version__,
        "trl_exreplay": trl_exreplay.__version__,
        "git_commit": commit,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }


def fmt_ms(value: float) -> str:
    return f"{value / 1e3:.2f} s" if value >= 1e4 else f"{value:.1f} ms" if value >= 10 else f"{value:.2f} ms"


def both(figures: dict, name: str) -> str:
    return f"{fmt_ms(figures[name + '_ms'])} ({fmt_ms(figures[name + '_cpu_ms'])})"


def table(results: dict) -> str:
    lines = [
        "Wall time, and in parentheses the calling thread's CPU time (what other processes on the machine do not "
        "inflate). `read 64`: one step's replay read: for ours the trainer's draw of 64 replay tasks over the buckets "
        "and the read of each one's lowest-entropy trajectory (`plan_replay`, `select`); for the dict, 64 tasks drawn "
        "as ExGRPO's code does (`random.sample` of the valid task list) and the lowest-entropy trajectory of each.",
        "",
        "| trajectories | pool | add 512 | read 64 | save (incremental) | load | RSS growth |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for size, r in results.items():
        ours, base = r["ours"], r["baseline"]
        lines.append(
            f"| {int(size):,} | sharded (ours) | {both(ours['build'], 'add')} | {both(ours['build'], 'sample')} "
            f"| {fmt_ms(ours['build']['save_ms'])} | {ours['load']['load_s']:.2f} s "
            f"| {max(ours['build']['rss_growth_mb'], ours['load']['rss_growth_mb']):.0f} MB |"
        )
        lines.append(
            f"| {int(size):,} | dict + pickle | {both(base['build'], 'add')} | {both(base['build'], 'sample')} "
            f"| {fmt_ms(base['build']['save_ms'])} | {base['load']['load_s']:.2f} s "
            f"| {max(base['build']['rss_growth_mb'], base['load']['rss_growth_mb']):.0f} MB |"
        )
        ratio = lambda a, b: f"{b / a:.0f}x" if a > 0 else "-"  # noqa: E731
        lines.append(
            f"| | baseline / ours | {ratio(ours['build']['add_ms'], base['build']['add_ms'])} "
            f"| {ratio(ours['build']['sample_ms'], base['build']['sample_ms'])} "
            f"| {ratio(ours['build']['save_ms'], base['build']['save_ms'])} "
            f"| {ratio(ours['load']['load_s'], base['load']['load_s'])} "
            f"| {ratio(max(ours['build']['rss_growth_mb'], ours['load']['rss_growth_mb'], 1), max(base['build']['rss_growth_mb'], base['load']['rss_growth_mb']))} |"  # noqa: E501
        )
    lines += [
        "",
        "Sharded pool (ours), more figures. Trainer, 64 replay groups of 128: `plan` draws the replay tasks from the "
        "bucket arrays (`plan_replay` over `replay_buckets`; `read 64` above also selects and reads the replayed "
        "trajectories); `plan from full list` is the former path (`plan_replay` over `replayable_tasks`, O(pool)). "
        "`flush 512`: the write of 512 buffered rows, on the calling thread (a shard file, then the compaction of the "
        "shards more dead than live).",
        "",
        "| trajectories | trainer: plan | plan from full list "
        "| flush 512 | save to a new checkpoint | first (full) save | read 64 after load "
        "| RSS after load: anon / file | disk: shards / pickle | load: checksums on / off |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, r in results.items():
        b, lo = r["ours"]["build"], r["ours"]["load"]
        lines.append(
            f"| {int(size):,} | {both(b, 'trainer_plan')} "
            f"| {fmt_ms(b['trainer_plan_listed_ms'])} | {both(b, 'flush')} | {fmt_ms(b['checkpoint_save_ms'])} "
            f"| {b['first_save_s']:.2f} s | {fmt_ms(lo['sample_after_load_ms'])} ({fmt_ms(lo['sample_after_load_cpu_ms'])}) "
            f"| {lo['rss_mb']['RssAnon'] - lo['rss_empty_mb']['RssAnon']:.0f} / "
            f"{lo['rss_mb']['RssFile'] - lo['rss_empty_mb']['RssFile']:.0f} MB "
            f"| {b['disk_gb']:.2f} / {r['baseline']['build']['disk_gb']:.2f} GB "
            f"| {lo['load_s']:.2f} / {lo.get('load_without_checksums_s', float('nan')):.2f} s |"
        )
    return "\n".join(lines)


def main_ranks(args, size: int, worlds: list[int]) -> None:
    by_world, load_before = {}, os.getloadavg()
    root = tempfile.mkdtemp(prefix="pool-scale-ranks-", dir=args.tmp)
    try:
        for world in worlds:
            by_world[world] = {}
            for sharing in ("none", "broadcast"):
                folder = os.path.join(root, f"ranks-{world}-{sharing}")
                os.makedirs(folder)
                by_world[world][sharing] = run_ranks(world, size, folder, args, sharing)
                shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "machine": machine(),
        "setup": {
            "trajectories": size,
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "add": ADD,
            "sample": SAMPLE,
        },  # fmt: skip
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "ranks": {str(world): ranks for world, ranks in by_world.items()},
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print()
    print(ranks_table(by_world, size))
    print(f"\nmachine: {report['machine']['cpu']}, {report['machine']['cores']} cores; figures in {args.json}")


# The figures a training step or a checkpoint pays, as (label, phase, key, unit). The calling thread's CPU time is
# beside the wall time of a step's add and read: other work on the machine inflates the wall time, hardly the CPU's.
AGAINST_FIGURES = (
    ("add 512", "build", "add_ms", "ms"),
    ("add 512, CPU", "build", "add_cpu_ms", "ms"),
    ("flush 512", "build", "flush_ms", "ms"),  # at 9acb35b and before, the writer thread's
    ("read 64", "build", "sample_ms", "ms"),
    ("read 64, CPU", "build", "sample_cpu_ms", "ms"),
    ("incremental save", "build", "save_ms", "ms"),
    ("save into a new checkpoint", "build", "checkpoint_save_ms", "ms"),
    ("RSS growth, build", "build", "rss_growth_mb", "MB"),
    ("load", "load", "load_s", "s"),
    ("load without checksums", "load", "load_without_checksums_s", "s"),
    ("read 64 after load", "load", "sample_after_load_ms", "ms"),
    ("read 64 after load, CPU", "load", "sample_after_load_cpu_ms", "ms"),
    ("RSS growth after load", "load", "rss_growth_mb", "MB"),
)


def main_against(args, sizes: list[int]) -> None:
    """`--against DIR`: ours in this checkout and in DIR, each run by its own script on its own library, one after
    the other for each size and round (the order alternating between rounds), so that both meet the same machine."""
    checkouts = {"this": None, "against": os.path.abspath(args.against)}
    runs = {name: {size: [] for size in sizes} for name in checkouts}
    root = tempfile.mkdtemp(prefix="pool-scale-", dir=args.tmp)
    load_before = os.getloadavg()
    try:
        for size in sizes:
            for round_ in range(args.rounds):
                order = list(checkouts) if round_ % 2 == 0 else list(reversed(checkouts))
                for name in order:
                    folder = os.path.join(root, f"{name}-{size}")
                    os.makedirs(folder)
                    print(f"{name} (round {round_ + 1})", flush=True)
                    build = run_worker("ours_build", size, folder, args, checkouts[name])
                    load = run_worker("ours_load", size, folder, args, checkouts[name])
                    shutil.rmtree(folder)
                    runs[name][size].append({"build": build, "load": load})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"machine": machine(), "against": checkouts["against"], "load_average": load_before, "runs": runs}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print("\n| trajectories | figure | this | against | this / against |\n|---:|---|---:|---:|---:|")
    for size in sizes:
        for label, phase, key, unit in AGAINST_FIGURES:
            this, against = (statistics.median(r[phase][key] for r in runs[n][size]) for n in checkouts)
            ratio = f"{this / against:.2f}x" if against else "-"
            print(f"| {size:,} | {label} | {this:.3g} {unit} | {against:.3g} {unit} | {ratio} |")
    print(f"\n(medians over {args.rounds} round(s); load average before: {load_before}, after: {os.getloadavg()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated numbers of trajectories")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=1024)
    parser.add_argument("--json", default="pool_scale.json", help="where to write the figures")
    parser.add_argument("--tmp", default=None, help="parent folder of the data (on disk, not tmpfs)")
    parser.add_argument(
        "--no-baseline", action="store_true", help="measure ours only (the baseline needs ~13 GB of RAM at 1M)"
    )
    parser.add_argument(
        "--ranks",
        default=None,
        help="comma-separated numbers of ranks (e.g. 1,2,4,8): measure the pool kept on every rank, as in training, "
        "at the first of --sizes, instead of the single-process comparison",
    )
    parser.add_argument(
        "--against",
        default=None,
        help="a checkout of another version: measure ours there and here, in one run (the figures a step or a "
        "checkpoint pays, with their ratio)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="with --against: runs of each version per size")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.size, args.dir, args.prompt_tokens, args.completion_tokens)))
        return

    sizes = [int(s) for s in args.sizes.split(",")]
    if args.ranks:
        main_ranks(args, sizes[0], [int(n) for n in args.ranks.split(",")])
        return
    if args.against:
        main_against(args, sizes)
        return
    results, load_before = {}, os.getloadavg()
    root = tempfile.mkdtemp(prefix="pool-scale-", dir=args.tmp)
    try:
        for size in sizes:
            ours_dir, base_dir = os.path.join(root, f"ours-{size}"), os.path.join(root, f"baseline-{size}")
            os.makedirs(ours_dir)
            os.makedirs(base_dir)
            ours = {"build": run_worker("ours_build", size, ours_dir, args)}
            ours["load"] = run_worker("ours_load", size, ours_dir, args)
            shutil.rmtree(ours_dir)
            results[str(size)] = {"ours": ours}
            if args.no_baseline:
                continue
            base = {"build": run_worker("baseline_build", size, base_dir, args)}
            base["load"] = run_worker("baseline_load", size, base_dir, args)
            shutil.rmtree(base_dir)
            results[str(size)]["baseline"] = base
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "machine": machine(),
        "setup": {
            "prompt_tokens": args.prompt_tokens,
            "completion_tokens": args.completion_tokens,
            "trajectories_per_task": PER_TASK,
            "add": ADD,
            "sample": SAMPLE,
        },
        "load_average": {"before": load_before, "after": os.getloadavg()},  # other work on the machine
        "results": results,
    }
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print()
    if args.no_baseline:
        for size, r in results.items():
            b, lo = r["ours"]["build"], r["ours"]["load"]
            print(
                f"{int(size):,} trajectories: add 512 {fmt_ms(b['add_ms'])} ({fmt_ms(b['add_unchecked_ms'])} without "
                "the row checks)"
            )
            print(
                f"{int(size):,} trajectories ({b['disk_gb']:.2f} GB of shards): load {lo['load_s']:.2f} s with "
                f"checksums, {lo['load_without_checksums_s']:.2f} and {lo['load_without_checksums_again_s']:.2f} s "
                f"without (first load: {lo['first_load_s']:.2f} s); read 64 after load "
                f"{fmt_ms(lo['sample_after_load_ms'])}; RSS growth {lo['rss_growth_mb']:.0f} MB"
            )
    else:
        print(table(results))
    print(f"\nload average (1, 5, 15 min) before: {load_before}, after: {report['load_average']['after']}")
    print(
        f"\nmachine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
        f"{report['machine']['memory_gb']} GB; figures in {args.json}"
    )


if __name__ == "__main__":
    main()
