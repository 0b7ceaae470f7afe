"""Why is a replay read of a small pool slower than it was? The read's time and the page faults it takes.

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> python benchmarks/read_faults.py --size 10000

Fills a pool as `pool_scale.py` does (its trajectories, its `fill`), then makes the trainer's replay read of 64
(`pool_scale.replay_read`: the plan, then `choose`) 200 times and prints the fastest and the median read (the calling
thread's CPU time) and the minor page faults a read takes. Run it with `PYTHONPATH` set to checkouts of two versions
to compare them: the script and its pool recipe stay this checkout's, the library is the checkout's.

A read of 64 trajectories of 1,152 tokens makes about 4.7 MB of Python floats and ints. When the allocator's arenas
that hold them are empty once the read's result is dropped, Python unmaps them, and the next read faults them in
again: hundreds of minor faults a read, which `docs/pool_storage.md` ("Reads of small pools") traces.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import pool_scale  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=10_000, help="trajectories in the pool")
    parser.add_argument("--reads", type=int, default=200, help="replay reads timed")
    args = parser.parse_args()

    import trl_exreplay
    from trl_exreplay.pool import ExperiencePool, Trajectory

    parts = pool_scale.template(128, 1024)
    base = Trajectory("t", rewards=[1.0], reward=1.0, entropy=0.5, policy_version=0, **parts)
    with tempfile.TemporaryDirectory() as work:
        pool = ExperiencePool(max_trajectories_per_task=pool_scale.PER_TASK, experience_rbound=8, work_dir=work)
        pool_scale.fill(pool, args.size, base, np.random.default_rng(1))
        pool.flush(wait=True)
        pool_scale.replay_read(pool, 1)
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for step in range(2, 2 + args.reads):
            start = time.thread_time()
            pool_scale.replay_read(pool, step)
            times.append((time.thread_time() - start) * 1e3)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.reads
        pool.close()
    print(
        f"{os.path.dirname(os.path.dirname(trl_exreplay.__file__))}: pool of {args.size:,}, read 64 fastest "
        f"{min(times):.2f} ms, median {statistics.median(times):.2f} ms (CPU), {faults:.0f} minor page faults a read"
    )


if __name__ == "__main__":
    main()
