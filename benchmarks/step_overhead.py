"""What does replay cost per optimizer step? The same testbed configuration with replay off and on, timed in one run.

    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --testbed single-turn --testbed multi-turn

For each testbed of `benchmarks/replay_vs_grpo.py`, `ExReplayGRPOTrainer` trains the testbed's configuration twice
from the same initial model, with `enable_experience_replay=False` and with the config defaults. Steps are timed from
the step at which replay starts (before it the two runs do the same work) to the end, and split into parts:

* generation: the model's `generate` calls (single-turn `_generate_single_turn`, multi-turn `generate_batch`);
* environment: the environments' `reset` and `step` (multi-turn);
* reward: `_calculate_rewards`;
* pool add: `_flush_pending` (outcomes and trajectories into the pool);
* pool sample: `select_trajectories` without the entropy forward (buckets, candidates, reads);
* entropy forward: `current_policy_entropies` (the current policy's no-grad forward over candidates);
* spread plan: `plan_groups` (`replay_spread_plan`: which drawn tasks get the step's groups);
* loss and backward: `training_step` without `_prepare_inputs`;
* other: the rest of the step (optimizer, scheduler, TRL's bookkeeping, old/ref log-probs, rollout assembly).

The target: replay step time / GRPO step time <= (1 - fraction of generation saved) + 0.03.

Two versions of the library, compared in one run (a change must not slow the step): with `--against DIR` (a checkout
of the other version, e.g. `git worktree add /tmp/before <commit>`), each round runs this script (the same testbeds
and clocks) once on this checkout's library and once on DIR's, each in a process of its own, in alternating order
(with `--concurrent`, at the same time: on a machine whose speed drifts from minute to minute, the pair then shares
it). It prints each round's median step times (the median over a run's timed steps: a step slowed by another process
on the machine moves the mean, not the median) and their ratio, then each figure's mean over rounds and the paired
difference of the two versions with its 95% t interval (means over steps too):

    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --against /tmp/before --rounds 10 [--concurrent]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_harness.statistics import paired_interval  # noqa: E402
from replay_testbeds import TESTBEDS  # noqa: E402

PARTS = ("generation", "environment", "reward", "pool add", "pool sample", "entropy forward", "spread plan",
         "loss and backward")  # fmt: skip
TIMED_METHODS = {
    "_generate_single_turn": "generation",
    "_calculate_rewards": "reward",
    "_flush_pending": "pool add",
    "training_step": "training step",
    "_prepare_inputs": "prepare inputs",
}
# Functions the trainer's parts call by their module's name for them: (module, name) -> part.
TIMED_FUNCTIONS = {
    ("trl_exreplay.envs.multiturn", "generate_batch"): "generation",
    ("trl_exreplay.replay", "select_trajectories"): "pool select",
    ("trl_exreplay.selection", "current_policy_entropies"): "entropy forward",
    ("trl_exreplay.replay", "plan_groups"): "spread plan",
}


def timed_trainer_class(clock: dict):
    """`ExReplayGRPOTrainer` whose methods of `TIMED_METHODS` add their wall time to `clock["seconds"]`.

    Each wrapper calls the class's own method, whose `super()` calls reach TRL's unwrapped methods: no part is counted
    twice, and the parts are disjoint except where the step's decomposition below subtracts them."""
    from trl_exreplay import ExReplayGRPOTrainer

    def timed(name, label):
        def method(self, *args, **kwargs):
            began = time.perf_counter()
            try:
                return getattr(ExReplayGRPOTrainer, name)(self, *args, **kwargs)
            finally:
                if clock["on"]:
                    clock["seconds"][label] += time.perf_counter() - began

        return method

    methods = {name: timed(name, label) for name, label in TIMED_METHODS.items() if hasattr(ExReplayGRPOTrainer, name)}
    return type("TimedExReplayGRPOTrainer", (ExReplayGRPOTrainer,), methods)


@contextlib.contextmanager
def timed_functions(clock: dict):
    """While open, the functions of `TIMED_FUNCTIONS` add their wall time to `clock["seconds"]`."""
    originals = {}
    for (module_name, name), label in TIMED_FUNCTIONS.items():
        try:  # another version of the library (`--against`) may lack it: that part is then not timed
            module = importlib.import_module(module_name)
            originals[module, name] = function = getattr(module, name)
        except (ImportError, AttributeError):
            print(f"not timed (absent from this version of the library): {module_name}.{name}")
            continue

        def wrapper(*args, _function=function, _label=label, **kwargs):
            began = time.perf_counter()
            try:
                return _function(*args, **kwargs)
            finally:
                if clock["on"]:
                    clock["seconds"][_label] += time.perf_counter() - began

        setattr(module, name, wrapper)
    try:
        yield
    finally:
        for (module, name), function in originals.items():
            setattr(module, name, function)


def timed_env_factory(factory, clock: dict):
    """An environment class whose `reset` and `step` add their wall time to `clock["seconds"]["environment"]`."""

    def timed(method):
        def wrapper(self, *args):
            began = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                if clock["on"]:
                    clock["seconds"]["environment"] += time.perf_counter() - began

        return wrapper

    return type("TimedEnv", (factory,), {"reset": timed(factory.reset), "step": timed(factory.step)})


def time_run(testbed, initial, replay: bool, max_steps: int) -> dict:
    """Per-step seconds of each part, over the steps from replay's start to the end."""
    from transformers import PrinterCallback, TrainerCallback

    from trl_exreplay import ExReplayGRPOConfig, MultiTurnSettings

    clock = {"on": False, "seconds": defaultdict(float), "steps": 0, "step_seconds": 0.0, "durations": []}
    settings = {**testbed.training, **testbed.trainer_kwargs(), "max_steps": max_steps}
    episodes = {k: v for k, v in settings.items() if k in MultiTurnSettings.__dataclass_fields__}  # the games' part
    output_dir = tempfile.mkdtemp(prefix="step_overhead-")
    args = ExReplayGRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, enable_experience_replay=replay,
        **{k: v for k, v in settings.items() if k not in episodes},
    )  # fmt: skip
    first_timed = int(args.replay_start_ratio * max_steps) + 1  # the first step at which replay may replay

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock["on"] = state.global_step + 1 >= first_timed
            clock["began"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if clock["on"]:
                clock["steps"] += 1
                clock["durations"].append(time.perf_counter() - clock["began"])
                clock["step_seconds"] += clock["durations"][-1]
            clock["on"] = False

    model, tokenizer = copy.deepcopy(initial[0]), initial[1]
    text_env_factory = testbed.text_env_factory()
    try:
        kwargs = (
            {
                "text_env_factory": timed_env_factory(text_env_factory, clock),
                "multi_turn": MultiTurnSettings(**episodes),
            }
            if text_env_factory is not None
            else {}
        )
        trainer = timed_trainer_class(clock)(
            model=model,
            reward_funcs=testbed.reward_funcs(),
            args=args,
            train_dataset=testbed.train_dataset(repeats=max_steps),
            processing_class=tokenizer,
            callbacks=[StepClock()],
            **kwargs,
        )
        trainer.remove_callback(PrinterCallback)
        with timed_functions(clock):
            trainer.train()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    generated = [e["replay/generated_rows"] for e in trainer.state.log_history if "replay/generated_rows" in e]
    rows = settings["per_device_train_batch_size"]
    timed_generated = generated[first_timed - 1 :] if generated else [rows] * clock["steps"]
    s, n = clock["seconds"], clock["steps"]
    parts = {
        "generation": s["generation"],
        "environment": s["environment"],
        "reward": s["reward"],
        "pool add": s["pool add"],
        "pool sample": s["pool select"] - s["entropy forward"],
        "entropy forward": s["entropy forward"],
        "spread plan": s["spread plan"],
        "loss and backward": s["training step"] - s["prepare inputs"],
    }
    parts["other"] = clock["step_seconds"] - sum(parts.values())
    return {
        "step_s": clock["step_seconds"] / n,
        "step_median_s": statistics.median(clock["durations"]),
        "parts": {name: value / n for name, value in parts.items()},
        "steps": n,
        "generated_fraction": sum(timed_generated) / (rows * len(timed_generated)),
    }


# The table's step lines: "  step   <grpo ms>   <exreplay ms>" (mean) and "  step, median   ...".
STEP_LINE = re.compile(r"^\s+step\s+([0-9.]+)\s+([0-9.]+)\s*$", re.MULTILINE)
MEDIAN_LINE = re.compile(r"^\s+step, median\s+([0-9.]+)\s+([0-9.]+)\s*$", re.MULTILINE)
LIBRARY_LINE = re.compile(r"^library from (.+)$", re.MULTILINE)

# What each round runs: this script, in a process that first says where its library was imported from.
RUN_SCRIPT = """import runpy, sys, trl_exreplay
print("library from", trl_exreplay.__file__, flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")"""


def start_on_library(checkout: Path, testbed: str, extra: list[str]) -> subprocess.Popen:
    """Start one run of this script (its testbeds and clocks) on the library of `checkout`, imported first (the
    process starts in `checkout`, with `PYTHONPATH` set to it)."""
    command = [sys.executable, "-c", RUN_SCRIPT, str(Path(__file__).resolve()), "--testbed", testbed, *extra]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    return subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_run(run: subprocess.Popen, checkout: Path) -> dict:
    """A started run's ms per step, mean and median, of grpo and exreplay, their ratios, and the library's path."""
    stdout, stderr = run.communicate()
    mean, median, library = (pattern.search(stdout) for pattern in (STEP_LINE, MEDIAN_LINE, LIBRARY_LINE))
    if run.returncode or mean is None or median is None or library is None:
        raise RuntimeError(f"the run on {checkout}'s library failed:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    grpo, exreplay, grpo_median, exreplay_median = (float(v) for v in (*mean.groups(), *median.groups()))
    return {
        "grpo_ms": grpo, "exreplay_ms": exreplay, "ratio": exreplay / grpo, "grpo_median_ms": grpo_median,
        "exreplay_median_ms": exreplay_median, "median_ratio": exreplay_median / grpo_median, "library": library[1],
    }  # fmt: skip


def describe_checkout(checkout: Path) -> str:
    """The checkout's commit, and whether its tracked files differ from it."""
    git = ["git", "-C", str(checkout)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return f"{commit}{' (modified)' if dirty.stdout.strip() else ''}"


def compare(options) -> dict:
    """`--against`: this checkout and another, `--rounds` runs each in alternating order, paired by round."""
    checkouts = {"this": Path(__file__).resolve().parents[1], "against": Path(options.against).resolve()}
    for name, checkout in checkouts.items():
        print(f"{name}: {checkout} at {describe_checkout(checkout)}")
    extra = [*(["--max-steps", str(options.max_steps)] if options.max_steps else []), "--seed", str(options.seed)]
    results = {}
    for testbed in options.testbed or ["single-turn"]:
        runs = {name: [] for name in checkouts}
        print(f"\n{testbed}: median ms per step (grpo, exreplay) and their ratio, per round")
        for round_ in range(options.rounds):
            order = list(checkouts) if round_ % 2 == 0 else list(reversed(checkouts))  # drift falls on both alike
            if options.concurrent:  # both at once, one a core: what slows the machine slows both
                started = {name: start_on_library(checkouts[name], testbed, extra) for name in order}
                for name in order:
                    runs[name].append(finish_run(started[name], checkouts[name]))
            else:
                for name in order:
                    runs[name].append(finish_run(start_on_library(checkouts[name], testbed, extra), checkouts[name]))
            line = "  ".join(
                f"{name} {r['grpo_median_ms']:.1f} {r['exreplay_median_ms']:.1f} {r['median_ratio']:.3f}"
                for name, r in ((n, runs[n][-1]) for n in checkouts)
            )
            print(f"  round {round_ + 1}: {line}", flush=True)
        for name in checkouts:
            print(f"  {name}: library from {sorted({r['library'] for r in runs[name]})}")
        results[testbed] = runs
        for key in ("grpo_median_ms", "exreplay_median_ms", "median_ratio", "grpo_ms", "exreplay_ms", "ratio"):
            this, against = ([r[key] for r in runs[n]] for n in checkouts)
            interval = paired_interval([a - b for a, b in zip(this, against)])
            summary = f"  {key:<18} this {_mean_std(this)}  against {_mean_std(against)}"
            if interval is not None:
                summary += (
                    f"  this - against {interval['mean']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]"
                )
            print(summary)
    return results


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {std:.3f}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--testbed", action="append", choices=sorted(TESTBEDS), help="Repeat; default: single-turn.")
    parser.add_argument("--max-steps", type=int, help="Steps per run (default: the testbed's).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the initial model.")
    parser.add_argument("--against", help="A checkout of another version to compare this one with (see above).")
    parser.add_argument("--rounds", type=int, default=6, help="With --against: runs of each version per testbed.")
    parser.add_argument(
        "--concurrent", action="store_true",
        help="With --against: run the two versions of a round at the same time (a machine with two free cores; with "
        "OMP_NUM_THREADS=1 each run takes one), so that a change in the machine's speed falls on both.",
    )  # fmt: skip
    options = parser.parse_args(argv)
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(f"versions: trl {version('trl')}, transformers {version('transformers')}, torch {version('torch')}")
    if options.against:
        return compare(options)
    results = {}
    for name in options.testbed or ["single-turn"]:
        testbed = TESTBEDS[name]()
        initial = testbed.build(options.seed)
        steps = options.max_steps or testbed.training["max_steps"]
        off = time_run(testbed, initial, replay=False, max_steps=steps)
        on = time_run(testbed, initial, replay=True, max_steps=steps)
        saved = 1 - on["generated_fraction"]
        ratio = on["step_s"] / off["step_s"]
        results[name] = {"grpo": off, "exreplay": on, "ratio": ratio, "generation_saved": saved}
        print(f"\n{name}: {on['steps']} timed steps each (from replay's start), ms per step")
        print(f"  {'part':<20}{'grpo':>10}{'exreplay':>10}")
        for part in (*PARTS, "other"):
            print(f"  {part:<20}{1000 * off['parts'][part]:>10.1f}{1000 * on['parts'][part]:>10.1f}")
        print(f"  {'step':<20}{1000 * off['step_s']:>10.1f}{1000 * on['step_s']:>10.1f}")
        print(f"  {'step, median':<20}{1000 * off['step_median_s']:>10.1f}{1000 * on['step_median_s']:>10.1f}")
        print(f"  step time ratio {ratio:.3f}; generation saved {100 * saved:.1f}%; "
              f"target ratio <= {1 - saved + 0.03:.3f}: {'met' if ratio <= 1 - saved + 0.03 else 'not met'}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
