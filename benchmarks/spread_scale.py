"""What replay_spread_plan's estimates cost at scale: memory and time per step with a million tasks known.

    OMP_NUM_THREADS=1 python benchmarks/spread_scale.py --tasks 1000000

Builds `SuccessEstimates` holding `--tasks` tasks (task ids of a realistic length, added a batch of 64 groups at a
time, as a run adds them), then times, at that size, what a step does with them: the plan of a batch (the posterior
of its candidates, one Thompson draw, the plan) for `--groups` groups of G=8 with 4 candidates a group, and the update
from the batch's outcomes; and what a checkpoint does: save and load. Memory is the process's resident set growth
while the estimates fill (psutil), and the arrays' own bytes. Each time is the median of `--repeats` runs.

The step it is judged against is the GPU step of docs/pool_storage.md ("The step the pool is judged against": the
ALFWorld recipe's RL step on one H200, 2.3 s), whose batch is 4 groups; `--groups 64` is a larger batch than it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from importlib.metadata import version

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from trl_exreplay.spread import SuccessEstimates, plan_groups  # noqa: E402

STEP_S = 2.3  # docs/pool_storage.md: the fastest RL step measured on a GPU (docs/gpu.md)
G = 8


def task_id(i: int) -> str:
    return f"deepmath-103k/train/{i:09d}"  # 29 characters: a dataset name, a split and a row number


def timed(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=1_000_000)
    parser.add_argument("--groups", type=int, default=64, help="groups of a generation batch")
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args(argv)
    process = psutil.Process()
    rss_before = process.memory_info().rss
    estimates = SuccessEstimates(half_life=50)
    rng = np.random.default_rng(0)
    began = time.perf_counter()
    for start in range(0, options.tasks, options.groups):
        batch = range(start, min(start + options.groups, options.tasks))
        estimates.update([(task_id(i), int(rng.integers(G + 1)), G) for i in batch], step=start // options.groups)
    fill_s = time.perf_counter() - began
    rss_growth = process.memory_info().rss - rss_before
    arrays = estimates._alpha.nbytes + estimates._beta.nbytes + estimates._step.nbytes
    step = options.tasks // options.groups

    candidates = options.groups * 4

    def plan() -> None:
        keys = [task_id(int(i)) for i in rng.integers(options.tasks, size=candidates)]
        alpha, beta = estimates.posterior(keys, step)
        plan_groups(keys, alpha, beta, np.zeros(candidates, bool), num_groups=options.groups, group_size=G,
                    explore=0.1, max_groups_per_task=1, seed=[0, step])  # fmt: skip

    def update() -> None:
        keys = [task_id(int(i)) for i in rng.integers(options.tasks, size=options.groups)]
        estimates.update([(k, 3, G) for k in keys], step)

    plan_s, update_s = timed(plan, options.repeats), timed(update, options.repeats)
    with tempfile.TemporaryDirectory() as folder:
        save_s = timed(lambda: estimates.save(folder), 3)
        size = os.path.getsize(os.path.join(folder, "exreplay_estimates.arrow"))
        load_s = timed(lambda: SuccessEstimates(half_life=50).load(folder), 3)

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"versions: numpy {version('numpy')}, pyarrow {version('pyarrow')}, python {platform.python_version()}")
    print(f"{len(estimates):,} tasks known (filled in {fill_s:.1f} s, {options.groups} groups a batch)")
    print(f"  memory: resident set +{rss_growth / 2**20:.0f} MiB (arrays {arrays / 2**20:.0f} MiB; the rest the task ids "
          "and their index)")  # fmt: skip
    print(f"  per step, {options.groups} groups of {G} ({candidates} candidates):")
    share = 100 * (plan_s + update_s) / STEP_S
    print(f"    plan {1e3 * plan_s:.2f} ms, update {1e3 * update_s:.2f} ms: {share:.3f}% of a {STEP_S} s step")
    print(f"  per checkpoint: save {save_s:.2f} s ({size / 2**20:.0f} MiB), load {load_s:.2f} s")


if __name__ == "__main__":
    main()
