"""ALFWorld environment throughput: resets/s and steps/s, in this process, across an `EnvProcessPool` and across a
`RayEnvPool`.

ALFWorld's engine is CPU-bound Python (textworld + fast-downward), so threads cannot use more than one core; the
process pool runs the environments in worker processes. This script measures, in one run:

* serial: one `AlfWorldEnv` in this process, episodes one after another;
* parallel, for each of `--backends`: `--envs` environments on an `EnvProcessPool` of `--workers` processes
  ("processes") or on a `RayEnvPool` of `--workers` Ray actors of a local Ray instance ("ray"), driven from threads as
  the multi-turn rollout drives them.

For each: cold resets (first load of a game), warm resets (the same game again, loaded and translated already) and
steps (seeded uniform-random admissible actions). Serial warm resets are also measured with `game_cache=0`. The
ratios parallel/serial are printed with the machine and versions.

    OMP_NUM_THREADS=1 python benchmarks/alfworld_env_throughput.py --workers 2 --envs 4 --backends processes,ray
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import re
import sys
import tempfile
import threading
import time
from importlib.metadata import version

from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks, generate_games, install_game_cache, random_agent
from trl_exreplay.envs.process import EnvProcessPool

_ADMISSIBLE = re.compile(r"\nAdmissible actions: (.*)\.$", re.DOTALL)


def random_action(observation: str, rng: random.Random) -> str:
    """`random_agent`'s choice among the admissible actions the prompt lists: read from the observation rather than
    asked with `env.admissible_actions()`, which on a remote environment would add a round trip per step."""
    match = _ADMISSIBLE.search(observation)
    return random_agent(observation, match.group(1).split(", ") if match else ["look"], rng)


def play(env, tasks, steps: int, rng: random.Random) -> dict[str, float]:
    """Cold reset of each task, `steps` random steps on each, then a warm reset of each: seconds and counts."""
    seconds = {"cold_reset": 0.0, "warm_reset": 0.0, "step": 0.0}
    counts = {"cold_reset": 0, "warm_reset": 0, "step": 0}
    for task in tasks:
        start = time.perf_counter()
        observation = env.reset(task)
        seconds["cold_reset"] += time.perf_counter() - start
        counts["cold_reset"] += 1
        for _ in range(steps):
            start = time.perf_counter()
            observation, _, done, _ = env.step(random_action(observation, rng))
            seconds["step"] += time.perf_counter() - start
            counts["step"] += 1
            if done:
                observation = env.reset(task)
        start = time.perf_counter()
        env.reset(task)
        seconds["warm_reset"] += time.perf_counter() - start
        counts["warm_reset"] += 1
    return {"seconds": seconds, "counts": counts}


def uncached_warm_resets(tasks) -> float:
    """Resets/s of the game already loaded, with the process's translation cache emptied and off: what `game_cache`
    saves."""
    import fast_downward

    install_game_cache(0)
    memo = fast_downward.pddl2sas
    size, memo.max_entries = memo.max_entries, 0
    memo.entries.clear()
    env = AlfWorldEnv(max_steps=10_000, game_cache=0)
    seconds = 0.0
    for task in tasks:
        env.reset(task)
        start = time.perf_counter()
        env.reset(task)
        seconds += time.perf_counter() - start
    env.close()
    memo.max_entries = size
    return len(tasks) / seconds


def rates(result: dict) -> dict[str, float]:
    return {kind: result["counts"][kind] / result["seconds"][kind] for kind in result["counts"]}


def make_pool(backend: str, workers: int):
    factory = functools.partial(AlfWorldEnv, max_steps=10_000)
    if backend == "ray":
        import ray

        from trl_exreplay.envs.ray_pool import RayEnvPool

        if not ray.is_initialized():  # a local instance with a CPU per actor, whatever this machine has
            ray.init(num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False)
        return RayEnvPool(factory, workers=workers, cpus_per_worker=1.0)
    return EnvProcessPool(factory, workers=workers)


def parallel(backend: str, pool_workers: int, num_envs: int, tasks, warmup, steps: int, seed: int) -> dict:
    """Rounds of `num_envs` tasks, one per remote env, each env driven by its own thread. In each round the three
    phases (cold reset, steps, warm reset) are separated by barriers and timed on the wall clock."""
    rounds = [tasks[i : i + num_envs] for i in range(0, len(tasks), num_envs)]
    barrier = threading.Barrier(num_envs + 1, timeout=900)  # a failed thread breaks it rather than hanging all
    counts = dict.fromkeys(("cold_reset", "warm_reset", "step"), 0)
    wall = dict.fromkeys(counts, 0.0)
    lock = threading.Lock()

    def count(kind: str) -> None:
        with lock:
            counts[kind] += 1

    def drive(index: int, env) -> None:
        rng = random.Random(f"{seed}|{index}")
        for batch in rounds:
            task = batch[index] if index < len(batch) else None
            barrier.wait()
            if task is not None:
                observation = env.reset(task)
                count("cold_reset")
            barrier.wait()
            barrier.wait()
            for _ in range(steps if task is not None else 0):
                observation, _, done, _ = env.step(random_action(observation, rng))
                count("step")
                if done:
                    observation = env.reset(task)
            barrier.wait()
            barrier.wait()
            if task is not None:
                env.reset(task)
                count("warm_reset")
            barrier.wait()

    with make_pool(backend, pool_workers) as pool:
        envs = [pool() for _ in range(num_envs)]
        for env in envs:  # untimed: start the worker and its engine, so cold resets time the game's first load only
            env.reset(warmup)
        threads = [threading.Thread(target=drive, args=(i, env), daemon=True) for i, env in enumerate(envs)]
        for thread in threads:
            thread.start()
        for _ in rounds:
            for kind in ("cold_reset", "step", "warm_reset"):
                barrier.wait()
                start = time.perf_counter()
                barrier.wait()
                wall[kind] += time.perf_counter() - start
        for thread in threads:
            thread.join()
        for env in envs:
            env.close()
    return {kind: counts[kind] / wall[kind] for kind in counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", help="a json_2.1.1 split folder; default: generate --num-games train games")
    parser.add_argument("--num-games", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="random steps per game")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="worker processes, or Ray actors")
    parser.add_argument("--backends", default="processes,ray", help="comma-separated: processes, ray")
    parser.add_argument("--envs", type=int, default=None, help="environments driven at once (default 2*workers)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    envs = args.envs or 2 * args.workers

    with tempfile.TemporaryDirectory() as tmp:
        games = args.games
        if games is None:
            generate_games(tmp, split="train", num_games=args.num_games + 1, seed=args.seed, workers=args.workers)
            games = os.path.join(tmp, "json_2.1.1", "train")
        tasks = list(alfworld_tasks(games))[: args.num_games + 1]
        tasks, warmup = tasks[:-1], tasks[-1]  # a game outside the timed ones, to start engines with

        no_cache = uncached_warm_resets(tasks)
        env = AlfWorldEnv(max_steps=10_000)
        env.reset(warmup)
        serial = rates(play(env, tasks, args.steps, random.Random(args.seed)))
        env.close()
        backends = args.backends.split(",")
        parallel_rates = {b: parallel(b, args.workers, envs, tasks, warmup, args.steps, args.seed) for b in backends}

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print(f"versions: alfworld {version('alfworld')}, textworld {version('textworld')}")
    if "ray" in backends:
        print(f"ray {version('ray')}: a local instance, one CPU per actor")
    print(f"games: {len(tasks)}, random steps per game: {args.steps}, pool: {args.workers} workers, {envs} envs")
    print(f"{'':14s} {'serial':>8s}" + "".join(f" {b:>10s} {'ratio':>7s}" for b in backends))
    for kind, label in (("cold_reset", "cold resets/s"), ("warm_reset", "warm resets/s"), ("step", "steps/s")):
        s = serial[kind]
        cells = "".join(f" {parallel_rates[b][kind]:10.2f} {parallel_rates[b][kind] / s:6.2f}x" for b in backends)
        print(f"{label:14s} {s:8.2f}{cells}")
    print(f"warm resets/s without the game cache (serial): {no_cache:.2f}")


if __name__ == "__main__":
    main()
