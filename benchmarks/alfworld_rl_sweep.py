"""Sweep RL settings of the ALFWorld recipe: run `recipes/alfworld.py` once per variant, several at a time, and print
greedy success before and after RL for each, with the train success of the first and last steps.

Every variant shares `--data_dir`, so games and the warm start (cached by their settings) are made once; a variant
that changes the warm start trains its own. Each run gets `--threads` torch threads and `--env-processes` engine
workers, so `--parallel` runs use about `parallel * (threads + env_processes)` cores.

    OMP_NUM_THREADS=2 python benchmarks/alfworld_rl_sweep.py --parallel 1 --common "--num_eval_games 60" \
        --variant "lr5e-5: --max_steps 24 --learning_rate 5e-5" \
        --variant "lr2e-4: --max_steps 24 --learning_rate 2e-4" \
        --variant "no-replay: --max_steps 24 --learning_rate 2e-4 --enable_experience_replay false"
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "alfworld.py")
_LOGGED = re.compile(r"\{'loss'.*?\}")


def run_variant(name: str, args: list[str], work: str, threads: int, env_processes: int) -> dict:
    output_dir = os.path.join(work, name)
    os.makedirs(output_dir, exist_ok=True)
    command = [sys.executable, RECIPE, *args, "--output_dir", output_dir, "--env_processes", str(env_processes)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    started = time.time()
    with open(os.path.join(output_dir, "run.log"), "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    row = {"variant": name, "args": shlex.join(args), "exit": code, "minutes": (time.time() - started) / 60}
    results = os.path.join(output_dir, "alfworld_results.json")
    if code == 0 and os.path.isfile(results):
        with open(results) as f:
            row["results"] = json.load(f)["results"]
    with open(os.path.join(output_dir, "run.log")) as f:
        steps = [ast.literal_eval(m) for m in _LOGGED.findall(f.read())]
    row["train_success"] = [float(s["env/success_rate"]) for s in steps if "env/success_rate" in s]
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="'name: recipe options' (repeatable)")
    parser.add_argument("--common", default="", help="Recipe options given to every variant.")
    parser.add_argument("--work", default="outputs/alfworld_rl_sweep", help="Folder of the runs' outputs and logs.")
    parser.add_argument("--parallel", type=int, default=1, help="Runs at a time.")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--env-processes", type=int, default=1, help="Engine worker processes per run.")
    parser.add_argument("--json", default=None, help="Also write the rows to this file.")
    options = parser.parse_args(argv)

    variants = []
    for spec in options.variant:
        name, sep, rest = spec.partition(":")
        if not sep or not re.fullmatch(r"[\w.+-]+", name.strip()):
            parser.error(f"--variant {spec!r}: expected 'name: options' with a name of letters, digits, '.', '+', '-'")
        variants.append((name.strip(), shlex.split(options.common) + shlex.split(rest)))

    def run(variant):
        return run_variant(*variant, options.work, options.threads, options.env_processes)

    with ThreadPoolExecutor(options.parallel) as runs:
        rows = list(runs.map(run, variants))

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs; {options.parallel} runs at a time, "
          f"{options.threads} threads and {options.env_processes} engine workers each")  # fmt: skip
    print(f"versions: trl {version('trl')}, transformers {version('transformers')}, torch {version('torch')}, "
          f"alfworld {version('alfworld')}")  # fmt: skip
    print(f"{'variant':<20}{'split':<14}{'before':>9}{'after':>9}{'train success first/last 4 steps':>36}{'min':>7}")
    for row in rows:
        first, last = row["train_success"][:4], row["train_success"][-4:]
        curve = f"{sum(first) / max(1, len(first)):.2f} / {sum(last) / max(1, len(last)):.2f}"
        for split, result in row.get("results", {"(failed)": {"before": float("nan"), "after": float("nan")}}).items():
            print(f"{row['variant']:<20}{split:<14}{100 * result['before']:>8.1f}%{100 * result['after']:>8.1f}%"
                  f"{curve:>36}{row['minutes']:>7.1f}")  # fmt: skip
    if options.json:
        with open(options.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
