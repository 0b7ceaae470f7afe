"""Does experience replay learn more per fresh rollout than plain GRPO? One harness for every testbed.

    OMP_NUM_THREADS=1 python benchmarks/replay_vs_grpo.py --testbed single-turn \\
        --methods grpo,exreplay,exreplay-exgrpo --seeds 0,1,2,3,4 --out results/tuning
    python benchmarks/replay_vs_grpo.py --report results/tuning      # tables (markdown) and plots again

Each method of a testbed starts, per seed, from the same model (the testbed's tiny model initialised with the seed,
then its warm start), trains with the same batch size for the same number of optimizer steps, and is measured every
`eval_every` steps on held-out problems that training never sees, with the same sampling draws for every method
(evaluation runs under `torch.random.fork_rng`, so it never moves the training's random stream). Replay generates
fewer fresh rollouts per step, so curves are drawn against **fresh rollouts consumed** (generated completions, or
environment episodes), not steps.

`grpo` is `ExReplayGRPOTrainer` with `enable_experience_replay=False`. For the first seed of a testbed TRL's own
`GRPOTrainer` can train (the single-turn one; multi-turn testbeds use this library's `text_env_factory`), the harness also
trains `GRPOTrainer` on the same run and records whether every logged loss and every point of its curve is identical
to `grpo`'s (the drop-in claim, measured; `--no-trl-check` skips it).

`DIR/results.json` (merged across calls: a run is keyed by testbed, method and seed, and a later call replaces it; a
call whose testbed settings differ from those of the runs already there is refused):

    {
      "schema": 1,
      "testbeds": {
        "<testbed>": {
          "summary": str, "training": {config fields shared by every method}, "model": {tiny model fields},
          "eval_every": int,
          "rows_per_step": int,                       # completions (episodes) per optimizer step
          "methods": {
            "<method>": {
              "preset": {config fields the method sets (`experience_from_testbed`: the testbed's experience)},
              "runs": {
                "<seed>": {
                  "points": [{"step": int, "fresh_rollouts": int, "heldout_success": float,
                              "train_success": float | null, "wall_s": float}, ...],  # step 0 is the initial model
                  "replay": {"rows_fraction": [float per step], "pool_tasks": [...], "pool_trajectories": [...],
                             "skip_set": [...], "importance_ratio_mean": [...], "policy_age": [...],
                             "buckets": [{successes: tasks} per step]},                # empty without replay
                  "guidance": {"guided_fraction": [float per step], "success_guided": [float | null], ...},
                                                 # GUIDE_SERIES, only in experience-guided runs
                  "wall_s": float, "step_s": float,   # training time (evaluation excluded), per optimizer step
                  "losses": [float per step], "settings": {every config field this run set},
                  "zero_std_groups": [float per step],  # TRL's frac_reward_zero_std (absent in older runs)
                  "run": {"command": str, "commit": str, "versions": {...}, "machine": {...}, "date": str}
                }
              }
            }
          },
          "trl_check": {"seed": int, "identical": bool, "max_loss_diff": float, "max_point_diff": float, "run": {...}}
        }
      }
    }

`train_success` is the mean total reward of the step's fresh rollouts (their success rate: rewards are 0 or 1 in
these testbeds); `wall_s` in a point is training time so far. `DIR/<testbed>.png` plots held-out success against fresh
rollouts: the mean over seeds and the min-max band, one line per method.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the testbeds live beside this script

from replay_testbeds import TESTBEDS  # noqa: E402

SCHEMA = 1
GUIDED = {
    "guidance_train": "mixed",
    "guidance_ratio": 0.5,
    "guidance_trained_prompt": "plain",
    "guidance_update_freq": 1,
}
# Named presets: the ExReplayGRPOConfig fields a method sets on top of the testbed's training settings.
PRESETS: dict[str, dict] = {
    "grpo": {"enable_experience_replay": False},
    "exreplay": {},
    "exreplay-exgrpo": {"replay_shaping": "exgrpo"},  # the shaping alone (before replay_profile existed)
    # ExGRPO's published recipe (replay_profile, docs/config.md "Profiles"), and the same without retired questions
    "exgrpo": {"replay_profile": "exgrpo"},
    "exgrpo-noretire": {"replay_profile": "exgrpo", "replay_retire_solved": False},
    # Every group teaches (`replay_profile="teach"`): rescue of all-fail groups, retired questions revisited
    "teach": {"replay_profile": "teach"},
    # Its values tried on the tuning seeds (50-54) of its pre-registered test: revisits twice as often, rescue alone
    "teach-revisit50": {"replay_profile": "teach", "replay_revisit_ratio": 0.5},
    "teach-rescue-only": {"replay_profile": "teach", "replay_retire_solved": False, "replay_revisit_ratio": 0.0},
    # Candidates tried on the tuning seeds (0-4); see docs/results.md for what they showed.
    "exreplay-k4": {"replay_trajectories_per_group": 4},  # half of a replayed task's group is replayed
    "exreplay-early": {"replay_start_ratio": 0.1},
    "exreplay-k4-early-r75": {"replay_trajectories_per_group": 4, "replay_start_ratio": 0.1, "replay_ratio": 0.75},
    "exreplay-normal": {"replay_bucket_weighting": "normal"},  # ExGRPO's Gaussian over buckets (medium tasks)
    "exreplay-linear": {"replay_bucket_weighting": "linear"},  # harder tasks (fewer successes) drawn more
    "exreplay-random": {"replay_select_mode": "random"},  # random replay, FIFO eviction (not lowest entropy)
    "exreplay-tight-clip": {"replay_clip_high": 0.2},  # replayed ratios clipped as fresh ones are (1 + 0.2)
    "exreplay-saved-entropy": {"replay_select_by_current_entropy": False},  # rank by stored entropy: no extra forward
    # Experience-guided rollouts (seed 003), as its recommended configuration sets them: half of each task's rollouts
    # get retrieved experience, every training sample has it stripped (trained off-policy); the offline provider
    # summarises each step's successes (the seed's `updated_freq: 0` relies on a prebuilt store, which these runs lack).
    "exreplay-guided": GUIDED,
    "grpo-guided": {"enable_experience_replay": False, **GUIDED},  # guidance alone: its effect without replay
    # The same, with the testbed's experience (`Testbed.experience_settings` and `.experience_provider()`): e.g. the
    # environment's own summariser hook and a template the tiny model's vocabulary can spell.
    "exreplay-guided-env": {**GUIDED, "experience_from_testbed": True},
    "grpo-guided-env": {"enable_experience_replay": False, **GUIDED, "experience_from_testbed": True},
    # Tried on the tuning seeds: guided rows trained on their guided prompt (on-policy), so the policy learns to read it.
    "exreplay-guided-env-keep": {**GUIDED, "guidance_trained_prompt": "guided", "experience_from_testbed": True},
}
COMMON = dict(use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True)


def rows_per_step(settings: dict) -> int:
    """Completions (episodes) per optimizer step of a one-process run: its batch times its accumulation steps."""
    return settings["per_device_train_batch_size"] * settings.get("gradient_accumulation_steps", 1)


REPLAY_SERIES = ("rows_fraction", "pool_tasks", "pool_trajectories", "skip_set", "importance_ratio_mean", "policy_age")
# The `guide/` metrics of experience-guided runs, per step (None where a step has no value, e.g. no guided row).
GUIDE_SERIES = ("guided_fraction", "discarded_fraction", "records_per_rollout", "success_guided", "success_unguided",
                "store_records", "summarizer_backlog", "summarizer_failures", "retrieve_failures")  # fmt: skip


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def run_record() -> dict:
    """Where and how a run was made: the command, commit, versions and machine."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            cwd=Path(__file__).parent, check=True,
        ).stdout.strip()  # fmt: skip
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "commit": commit,
        "versions": {name: version(name) for name in ("trl", "transformers", "torch", "accelerate", "datasets")},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gpu": _gpu_name(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "python": platform.python_version(),
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


class _Recorder:
    """A `TrainerCallback` that measures held-out success every `eval_every` steps and counts fresh rollouts."""

    def __init__(self, testbed, tokenizer, rows_per_step: int, max_steps: int, bar_label: str, progress: bool):
        from transformers import TrainerCallback

        recorder = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                recorder.start(model)

            def on_log(self, args, state, control, logs=None, model=None, **kwargs):
                if logs is not None and "loss" in logs:
                    recorder.logged(state.global_step, logs, model)

        self.callback = Callback()
        self.testbed, self.tokenizer = testbed, tokenizer
        self.rows_per_step, self.max_steps = rows_per_step, max_steps
        self.points, self.losses, self.zero_std_groups = [], [], []
        self.replay = {name: [] for name in REPLAY_SERIES}
        self.guidance = {name: [] for name in GUIDE_SERIES}
        self.fresh = 0
        self.eval_seconds = 0.0
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=max_steps, desc=bar_label, unit="step", leave=True)

    def start(self, model):
        self.started = time.perf_counter()
        self.point(0, model, train_success=None)

    def training_seconds(self) -> float:
        return time.perf_counter() - self.started - self.eval_seconds

    def point(self, step, model, train_success):
        began = time.perf_counter()
        success = self.testbed.heldout_success(model, self.tokenizer)
        self.eval_seconds += time.perf_counter() - began
        self.points.append(
            {"step": step, "fresh_rollouts": self.fresh, "heldout_success": success, "train_success": train_success,
             "wall_s": round(self.training_seconds(), 3)}
        )  # fmt: skip
        if self.testbed.last_detail:  # e.g. per held-out split
            self.points[-1]["heldout_detail"] = dict(self.testbed.last_detail)
        if self.bar is not None:
            self.bar.set_postfix(heldout=f"{success:.3f}", fresh=self.fresh)

    def logged(self, step, logs, model):
        # One generation per optimizer step (steps_per_generation = gradient_accumulation_steps), logged every step.
        self.fresh += int(round(logs.get("replay/generated_rows", self.rows_per_step)))
        self.losses.append(logs["loss"])
        self.zero_std_groups.append(logs.get("frac_reward_zero_std"))
        train_success = logs.get("replay/fresh_reward", logs.get("env/success_rate", logs.get("reward")))
        if "replay/rows_fraction" in logs:
            for name in REPLAY_SERIES:
                self.replay[name].append(logs.get(f"replay/{name}"))
            # Tasks per difficulty bucket (successes among a task's latest fresh rollouts), stored or not.
            buckets = {k.removeprefix("replay/bucket_"): v for k, v in logs.items() if k.startswith("replay/bucket_")}
            self.replay.setdefault("buckets", []).append(buckets)
        if "guide/guided_fraction" in logs:
            for name in GUIDE_SERIES:
                self.guidance[name].append(logs.get(f"guide/{name}"))
        if self.bar is not None:
            self.bar.update(1)
        if step % self.testbed.eval_every == 0 or step == self.max_steps:
            self.point(step, model, train_success)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def train_one(testbed, method: str, seed: int, initial: tuple, *, progress: bool = True, trl: bool = False) -> dict:
    """Train `method` on `testbed` from `initial` = (model, tokenizer) (copied) and return its run record."""
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer

    model, tokenizer = copy.deepcopy(initial[0]), initial[1]
    preset = dict(PRESETS[method])
    from_testbed = preset.pop("experience_from_testbed", False)
    extra = testbed.experience_settings if from_testbed else {}
    settings = {**COMMON, **testbed.training, **testbed.trainer_kwargs(), **preset, **extra, "seed": seed}
    max_steps = settings["max_steps"]
    label = f"{testbed.name} {'trl-GRPOTrainer' if trl else method} seed {seed}"
    recorder = _Recorder(testbed, tokenizer, rows_per_step(settings), max_steps, label, progress)
    with tempfile.TemporaryDirectory() as output_dir:
        if trl:
            known = GRPOConfig.__dataclass_fields__
            args = GRPOConfig(output_dir=output_dir, **{k: v for k, v in settings.items() if k in known})
            trainer_cls = GRPOTrainer
        else:
            args = ExReplayGRPOConfig(output_dir=output_dir, **settings)
            trainer_cls = ExReplayGRPOTrainer
        text_env_factory = testbed.text_env_factory()
        kwargs = {"text_env_factory": text_env_factory} if text_env_factory is not None else {}
        provider = testbed.experience_provider() if from_testbed else None
        if provider is not None:
            kwargs["experience_provider"] = provider
        trainer = trainer_cls(
            model=model,
            reward_funcs=testbed.reward_funcs(),
            args=args,
            train_dataset=testbed.train_dataset(repeats=max_steps),
            processing_class=tokenizer,
            callbacks=[recorder.callback],
            **kwargs,
        )
        trainer.remove_callback(PrinterCallback)  # with disable_tqdm it prints every log; the bar shows progress
        try:
            trainer.train()
        finally:
            recorder.close()
    wall = recorder.training_seconds()
    return {
        "points": recorder.points,
        "losses": recorder.losses,
        "zero_std_groups": recorder.zero_std_groups,
        "replay": recorder.replay,
        **({"guidance": recorder.guidance} if recorder.guidance["guided_fraction"] else {}),
        "wall_s": round(wall, 3),
        "step_s": round(wall / max_steps, 4),
        "settings": {k: v for k, v in settings.items() if k not in COMMON},  # what this run trained with
        "run": run_record(),
    }


# ------------------------------------------------------------------------------------------------- results file
def load_results(out: Path) -> dict:
    path = out / "results.json"
    if not path.exists():
        return {"schema": SCHEMA, "testbeds": {}}
    results = json.loads(path.read_text())
    validate_results(results)
    return results


POINT_FIELDS = {
    "step": int,
    "fresh_rollouts": int,
    "heldout_success": float,
    "train_success": (float, type(None)),
    "wall_s": float,
}
RUN_FIELDS = {
    "points": list,
    "losses": list,
    "replay": dict,
    "wall_s": float,
    "step_s": float,
    "settings": dict,
    "run": dict,
}


def validate_results(results: dict) -> None:
    """Raise `ValueError` naming the first field of `results` that does not follow the schema of this docstring."""

    def need(value, kind, where):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds:
            kinds = (*kinds, int)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ValueError(f"results.json: {where} is {value!r}, expected {' or '.join(k.__name__ for k in kinds)}")

    need(results.get("schema"), int, "schema")
    if results["schema"] != SCHEMA:
        raise ValueError(f"results.json: schema is {results['schema']}, expected {SCHEMA}")
    need(results.get("testbeds"), dict, "testbeds")
    for name, entry in results["testbeds"].items():
        for key, kind in (("summary", str), ("training", dict), ("eval_every", int), ("rows_per_step", int),
                          ("methods", dict)):  # fmt: skip
            need(entry.get(key), kind, f"testbeds.{name}.{key}")
        for method, method_entry in entry["methods"].items():
            need(method_entry.get("preset"), dict, f"testbeds.{name}.methods.{method}.preset")
            for seed, run in method_entry.get("runs", {}).items():
                where = f"testbeds.{name}.methods.{method}.runs.{seed}"
                for key, kind in RUN_FIELDS.items():
                    need(run.get(key), kind, f"{where}.{key}")
                for key in ("command", "commit", "versions", "machine", "date"):
                    if key not in run["run"]:
                        raise ValueError(f"results.json: {where}.run.{key} is missing")
                steps = [point.get("step") for point in run["points"]]
                if not steps or steps[0] != 0 or steps != sorted(set(steps)):
                    raise ValueError(f"results.json: {where}.points steps are {steps}, expected 0 first, increasing")
                for i, point in enumerate(run["points"]):
                    for key, kind in POINT_FIELDS.items():
                        need(point.get(key), kind, f"{where}.points[{i}].{key}")
                    if not 0.0 <= point["heldout_success"] <= 1.0:
                        raise ValueError(f"results.json: {where}.points[{i}].heldout_success is out of [0, 1]")
        check = entry.get("trl_check")
        if check is not None:
            need(check.get("identical"), bool, f"testbeds.{name}.trl_check.identical")


def update_results(out: Path, change) -> dict:
    """Apply `change(results)` to `out/results.json` as it is on disk now, and write it back; returns the results.

    Harness calls may run at once (one per core, on the same testbed or not): the read-modify-write holds an exclusive
    lock, and the file is replaced atomically (temp file, then rename), so a killed run leaves the old file or the new.
    """
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load_results(out)
        change(results)
        fd, tmp = tempfile.mkstemp(dir=out, prefix=".results.", suffix=".tmp")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; results are meant to be shared
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(results, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out / "results.json")
        except BaseException:
            os.unlink(tmp)
            raise
    return results


def testbed_entry(results: dict, testbed) -> dict:
    """The entry of `testbed` in `results` (created if missing), with its current settings."""
    entry = results["testbeds"].setdefault(testbed.name, {"methods": {}})
    entry.update(
        summary=testbed.summary,
        measure=testbed.measure,
        training={**testbed.training, **testbed.trainer_kwargs()},
        model=testbed.model_kwargs,
        eval_every=testbed.eval_every,
        rows_per_step=rows_per_step(testbed.training),
    )
    return entry


def check_same_settings(out: Path, testbed) -> None:
    """Refuse, before any training, a call whose testbed settings (training fields, model) differ from those of the
    runs already in `out/results.json`: one entry records one set of settings for all its runs."""
    entry = load_results(out)["testbeds"].get(testbed.name)
    if entry is None or not any(m.get("runs") for m in entry["methods"].values()):
        return
    ours = json.loads(json.dumps({"training": {**testbed.training, **testbed.trainer_kwargs()},
                                  "model": testbed.model_kwargs}))  # fmt: skip
    for key, value in ours.items():
        if key in entry and entry[key] != value:
            raise ValueError(
                f"{out / 'results.json'} holds {testbed.name} runs with {key} {entry[key]}, and this call's is {value}: "
                "give it another --out (one results file, one set of settings per testbed)."
            )


def record_run(out: Path, testbed, method: str, seed: int, run: dict) -> dict:
    def change(results):
        method_entry = testbed_entry(results, testbed)["methods"].setdefault(method, {"runs": {}})
        method_entry["preset"] = PRESETS[method]
        method_entry["runs"][str(seed)] = run

    return update_results(out, change)


def record_trl_check(out: Path, testbed, check: dict) -> dict:
    return update_results(out, lambda results: testbed_entry(results, testbed).update(trl_check=check))


def compare_with_trl(ours: dict, theirs: dict) -> dict:
    """Whether TRL's GRPOTrainer gave the same run as `grpo`: every logged loss and every curve point."""
    pairs = list(zip(ours["losses"], theirs["losses"]))
    loss_diff = max((abs(a - b) for a, b in pairs), default=math.inf)
    point_diff = max(
        (abs(a[key] - b[key]) for a, b in zip(ours["points"], theirs["points"]) for key in ("heldout_success",)),
        default=math.inf,
    )
    same_length = len(ours["losses"]) == len(theirs["losses"]) and len(ours["points"]) == len(theirs["points"])
    return {"identical": same_length and loss_diff == 0 and point_diff == 0, "max_loss_diff": loss_diff,
            "max_point_diff": point_diff}  # fmt: skip


# ------------------------------------------------------------------------------------------------- analysis
def method_curve(runs: dict) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per evaluation point (over seeds): mean fresh rollouts, mean, min and max held-out success."""
    series = [run["points"] for run in runs.values()]
    n = min(len(points) for points in series)
    xs = [sum(points[i]["fresh_rollouts"] for points in series) / len(series) for i in range(n)]
    ys = [[points[i]["heldout_success"] for points in series] for i in range(n)]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


# 97.5% quantiles of Student's t for 1..30 degrees of freedom (no scipy needed); past 30, the value at 30 (wider than
# the exact one, never narrower).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def paired_interval(differences: list[float]) -> dict | None:
    """Mean of per-seed differences to the baseline and its 95% t interval (None without two seeds)."""
    n = len(differences)
    if n < 2:
        return None
    mean = sum(differences) / n
    std = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    half = T975[min(n - 1, len(T975)) - 1] * std / math.sqrt(n)
    return {"mean": mean, "std": std, "low": mean - half, "high": mean + half, "seeds": n}


def sign_test(differences: list[float]) -> dict:
    """Seeds above and below the baseline (ties dropped) and the exact two-sided binomial p of so lopsided a split
    under "either is as likely"."""
    wins, losses = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
    n = wins + losses
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n if n else 1.0
    return {"wins": wins, "losses": losses, "ties": len(differences) - n, "p": min(1.0, 2 * tail)}


def collapsed(points: list[dict]) -> bool:
    """A run that ends below half its own best held-out success (and had one above 0)."""
    best = max(p["heldout_success"] for p in points)
    return best > 0 and points[-1]["heldout_success"] < best / 2


def rollouts_to_reach(xs: list[float], ys: list[float], level: float) -> float | None:
    """Fresh rollouts at which the curve first reaches `level` (linear between points); None if it never does."""
    for i, y in enumerate(ys):
        if y >= level - 1e-12:
            if i == 0:
                return xs[0]
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (xs[i] - x0) * (level - y0) / (y - y0)
    return None


def summarize(entry: dict, baseline: str = "grpo") -> list[dict]:
    """One row per method: final held-out success (mean, std, per seed), rollouts to reach the baseline's final
    success (ratio to the baseline's own), area under the curve, generation saved, training time per step."""
    rows = []
    methods = entry["methods"]
    base_level = base_need = None
    base_finals = {}
    if baseline in methods:
        bx, by, _, _ = method_curve(methods[baseline]["runs"])
        if by[-1] > by[0]:  # a baseline that did not rise above its start sets no level worth reaching
            base_level = by[-1]
            base_need = rollouts_to_reach(bx, by, base_level)
        base_finals = {seed: run["points"][-1]["heldout_success"] for seed, run in methods[baseline]["runs"].items()}
    for name, method in methods.items():
        runs = method["runs"]
        finals = [run["points"][-1]["heldout_success"] for run in runs.values()]
        paired = [run["points"][-1]["heldout_success"] - base_finals[seed] for seed, run in runs.items()
                  if seed in base_finals]  # fmt: skip
        mean = sum(finals) / len(finals)
        std = math.sqrt(sum((f - mean) ** 2 for f in finals) / (len(finals) - 1)) if len(finals) > 1 else 0.0
        xs, ys, _, _ = method_curve(runs)
        need = rollouts_to_reach(xs, ys, base_level) if base_level is not None else None
        generated = [  # the share of each run's rows that were generated, not replayed
            run["points"][-1]["fresh_rollouts"] / (rows_per_step(run["settings"]) * run["points"][-1]["step"])
            for run in runs.values()
        ]
        saved = 1 - sum(generated) / len(generated)
        # Area under the held-out curve over steps, as a mean success (trapezoids, evaluation points by step).
        points = [run["points"] for run in runs.values()]
        auc = sum(
            sum((p[i]["heldout_success"] + p[i - 1]["heldout_success"]) / 2 * (p[i]["step"] - p[i - 1]["step"])
                for i in range(1, len(p))) / p[-1]["step"]
            for p in points
        ) / len(points)  # fmt: skip
        rows.append({
            "method": name, "seeds": sorted(runs, key=int), "final_mean": mean, "final_std": std,
            "final_per_seed": {seed: run["points"][-1]["heldout_success"] for seed, run in runs.items()},
            "initial_mean": sum(run["points"][0]["heldout_success"] for run in runs.values()) / len(runs),
            "rollouts_to_baseline_final": need,
            "rollout_ratio": (need / base_need) if (need is not None and base_need) else None,
            "auc": auc, "generation_saved": saved,
            "paired_difference": paired_interval(paired),
            "sign_test": sign_test(paired) if paired else None,
            "collapse_rate": sum(collapsed(run["points"]) for run in runs.values()) / len(runs),
            # Share of the groups TRL scored with zero reward spread (`frac_reward_zero_std`), over all steps; None
            # for runs recorded before the series was (it was added at the pre-registered test's second half).
            "zero_std_groups": _mean_of_series(run.get("zero_std_groups") for run in runs.values()),
            "step_s": sum(run["step_s"] for run in runs.values()) / len(runs),
        })  # fmt: skip
    return rows


def _mean_of_series(series) -> float | None:
    values = [v for one in series if one for v in one if v is not None]
    return sum(values) / len(values) if values else None


def markdown_table(name: str, entry: dict, baseline: str = "grpo") -> str:
    rows = summarize(entry, baseline)
    base = next((r for r in rows if r["method"] == baseline), None)
    baseline_flat = base is not None and base["rollouts_to_baseline_final"] is None
    lines = [
        f"### {name}: {entry['summary']}",
        "",
        f"| method | held-out success, final (mean ± std) | per seed | initial | paired Δ vs {baseline} [95% CI] "
        f"| sign test (above/below, p) | fresh rollouts to {baseline}'s final (ratio) | AUC | collapsed "
        "| zero-spread groups | generation saved | s / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_seed = ", ".join(f"{seed}: {value:.3f}" for seed, value in sorted(r["final_per_seed"].items(),
                                                                              key=lambda kv: int(kv[0])))  # fmt: skip
        need = "never" if r["rollouts_to_baseline_final"] is None else f"{r['rollouts_to_baseline_final']:.0f}"
        need = f"n/a: {baseline} ended at its start" if baseline_flat else need
        ratio = "" if r["rollout_ratio"] is None else f" ({r['rollout_ratio']:.2f}x)"
        d = r["paired_difference"]
        delta = "" if d is None or r["method"] == baseline else f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"
        t = r["sign_test"]
        sign = "" if t is None or r["method"] == baseline else f"{t['wins']}/{t['losses']}, p={t['p']:.3g}"
        zero = "" if r["zero_std_groups"] is None else f"{100 * r['zero_std_groups']:.1f}%"
        lines.append(
            f"| {r['method']} | {r['final_mean']:.3f} ± {r['final_std']:.3f} | {per_seed} | {r['initial_mean']:.3f} "
            f"| {delta} | {sign} | {need}{ratio} | {r['auc']:.3f} | {100 * r['collapse_rate']:.0f}% | {zero} "
            f"| {100 * r['generation_saved']:.1f}% | {r['step_s']:.2f} |"
        )
    lines += detail_lines(entry)
    lines += run_lines(entry)
    guidance = guidance_lines(entry)
    if guidance:
        lines += ["", *guidance]
    check = entry.get("trl_check")
    if check:
        lines += ["", f"TRL's own `GRPOTrainer`, seed {check['seed']}: identical to `grpo`: **{check['identical']}** "
                      f"(max loss difference {check['max_loss_diff']:.3g}, max held-out difference "
                      f"{check['max_point_diff']:.3g})."]  # fmt: skip
    return "\n".join(lines)


def detail_lines(entry: dict) -> list[str]:
    """Held-out success by part (`heldout_detail`: problem length, doors, split), mean over each method's seeds, from
    the first point to the last: where a method gains or loses."""
    lines = []
    for name, method in entry["methods"].items():
        runs = [run["points"] for run in method["runs"].values() if run["points"][0].get("heldout_detail")]
        if not runs:
            continue
        cells = ", ".join(
            f"{part} {_mean_part(runs, 0, part):.2f} -> {_mean_part(runs, -1, part):.2f}"
            for part in sorted(runs[0][0]["heldout_detail"])
        )
        lines.append(f"- `{name}` ({len(runs)} seeds): {cells}")
    return ["", "Held-out success by part (mean over seeds, first point -> last):", *lines] if lines else []


def run_lines(entry: dict) -> list[str]:
    """Per method, which seeds did what: those that collapsed; with replay, the first step that replayed a row (and the
    seeds on which none did) and the tasks in the skip set at the end; the seeds whose runs recorded zero-spread groups
    (the table's column is over those)."""

    def seeds(values) -> str:
        return ", ".join(sorted(values, key=int)) or "none"

    lines = []
    for name, method in entry["methods"].items():
        runs = method["runs"]
        cells = [f"collapsed: {seeds(s for s, r in runs.items() if collapsed(r['points']))}"]
        series = {s: r["replay"] for s, r in runs.items() if r["replay"].get("rows_fraction")}
        if series:  # the steps are the optimizer steps logged, 1 the first
            first = {
                s: next((i + 1 for i, v in enumerate(r["rows_fraction"]) if v > 0), None) for s, r in series.items()
            }
            started = [step for step in first.values() if step is not None]
            if started:
                cells.append(f"first replayed at step {min(started)}-{max(started)}")
            cells.append(f"never replayed: {seeds(s for s, step in first.items() if step is None)}")
            ends = [r["skip_set"][-1] for r in series.values() if r.get("skip_set")]
            if ends:
                cells.append(f"skip set at the end {min(ends):.0f}-{max(ends):.0f} tasks")
        recorded = [s for s, r in runs.items() if r.get("zero_std_groups")]
        if recorded and len(recorded) < len(runs):
            cells.append(f"zero-spread groups recorded on seeds {seeds(recorded)}")
        lines.append(f"- `{name}` ({len(runs)} seeds): " + "; ".join(cells))
    return ["", "Runs by seed:", *lines] if lines else []


def _mean_part(runs: list[list[dict]], index: int, part: str) -> float:
    return sum(points[index]["heldout_detail"][part] for points in runs) / len(runs)


def guidance_lines(entry: dict) -> list[str]:
    """What guidance did in each guided method's runs: the share of rows sampled with experience, the success of
    guided and unguided fresh rollouts over the whole run (pooled over steps, weighted alike), the records retrieved
    per guided rollout and the store's final size (means over seeds)."""

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else float("nan")

    lines = []
    for name, method in entry["methods"].items():
        runs = [run["guidance"] for run in method["runs"].values() if "guidance" in run]
        if not runs:
            continue
        per_seed = [(mean(g["guided_fraction"]), mean(g["success_guided"]), mean(g["success_unguided"]),
                     mean(g["records_per_rollout"]), g["store_records"][-1], g["summarizer_failures"][-1])
                    for g in runs]  # fmt: skip
        fraction, guided, unguided, records, store, failures = (mean(column) for column in zip(*per_seed))
        lines.append(
            f"`{name}` ({len(runs)} seeds): {100 * fraction:.1f}% of rows guided; fresh success {guided:.3f} guided "
            f"vs {unguided:.3f} unguided (run means); {records:.2f} records per guided rollout; {store:.0f} records "
            f"in the store at the end; {failures:.0f} summariser failures."
        )
    return lines


def plot(out: Path, name: str, entry: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method_name, method in entry["methods"].items():
        xs, mean, low, high = method_curve(method["runs"])
        seeds = len(method["runs"])
        (line,) = ax.plot(xs, mean, marker="o", markersize=3, label=f"{method_name} ({seeds} seeds)")
        ax.fill_between(xs, low, high, alpha=0.18, color=line.get_color())
    ax.set_xlabel("fresh rollouts consumed")
    ax.set_ylabel(entry.get("measure", "held-out success"), fontsize=8 if len(entry.get("measure", "")) > 40 else 10)
    ax.set_title(f"{name}: mean and min-max over seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    replayed = {
        m: e for m, e in entry["methods"].items() if any(r["replay"]["rows_fraction"] for r in e["runs"].values())
    }
    if replayed:  # what replay did over the run: the pool's size and the replayed share of each step's rows
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        for method_name, method in replayed.items():
            series = [run["replay"] for run in method["runs"].values()]
            n = min(len(s["pool_tasks"]) for s in series)
            steps = list(range(1, n + 1))
            left.plot(steps, [sum(s["pool_tasks"][i] for s in series) / len(series) for i in range(n)],
                      label=method_name)  # fmt: skip
            right.plot(steps, [sum(s["rows_fraction"][i] for s in series) / len(series) for i in range(n)],
                       label=method_name)  # fmt: skip
        left.set(xlabel="optimizer step", ylabel="tasks in the pool (mean over seeds)", title=f"{name}: pool")
        right.set(xlabel="optimizer step", ylabel="replayed fraction of rows", title=f"{name}: replay share")
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}-replay.png", dpi=110)
        plt.close(fig)
    return path


def report(out: Path, baseline: str = "grpo") -> str:
    results = load_results(out)
    parts = []
    for name, entry in results["testbeds"].items():
        if entry["methods"]:
            plot(out, name, entry)
            parts.append(markdown_table(name, entry, baseline))
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------- command line
def parse_args(argv=None):
    testbeds = "\n".join(f"  {name}: {cls.summary}" for name, cls in TESTBEDS.items())
    presets = "\n".join(f"  {name}: {preset or '(config defaults)'}" for name, preset in PRESETS.items())
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"testbeds:\n{testbeds}\n\nmethod presets:\n{presets}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--testbed", choices=sorted(TESTBEDS), help="Testbed to run (see below).")
    parser.add_argument("--methods", default="grpo,exreplay,exreplay-exgrpo", help="Comma-separated presets.")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="Comma-separated seeds.")
    parser.add_argument("--out", required=True, type=Path, help="Folder of results.json and the plots.")
    parser.add_argument("--max-steps", type=int, help="Override the testbed's optimizer steps (smoke runs).")
    parser.add_argument("--set", action="append", metavar="FIELD=JSON",
                        help="Override a training field of the testbed for every method (tuning), e.g. learning_rate=1e-4.")  # fmt: skip
    parser.add_argument("--model", action="append", metavar="FIELD=JSON",
                        help="Override a field of the testbed's tiny model (`trl_exreplay.tiny.build_tiny_model`), e.g. "
                             "hidden_size=256; with `--set use_cpu=false` the runs train on the GPU.")  # fmt: skip
    parser.add_argument("--no-trl-check", dest="trl_check", action="store_false",
                        help="Skip the run of TRL's GRPOTrainer on the first seed.")  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="No progress bars.")
    parser.add_argument("--report", action="store_true", help="Only print the tables and redraw the plots of --out.")
    parser.add_argument("--baseline", default="grpo",
                        help="With --report: the method the paired differences and rollout ratios are taken against.")  # fmt: skip
    options = parser.parse_args(argv)
    if not options.report and options.testbed is None:
        parser.error("--testbed is required unless --report")
    options.methods = [m for m in options.methods.split(",") if m]
    unknown = [m for m in options.methods if m not in PRESETS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}: allowed values are {', '.join(PRESETS)}")
    try:
        options.seeds = [int(s) for s in options.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {options.seeds!r}")
    return options


def main(argv=None) -> dict:
    options = parse_args(argv)
    if options.report:
        print(report(options.out, options.baseline))
        return load_results(options.out)
    testbed = TESTBEDS[options.testbed]()
    for field_value in options.set or []:
        name, _, value = field_value.partition("=")
        testbed.training = {**testbed.training, name: json.loads(value)}
    for field_value in options.model or []:
        name, _, value = field_value.partition("=")
        testbed.model_kwargs = {**testbed.model_kwargs, name: json.loads(value)}
    if options.max_steps is not None:
        testbed.training = {**testbed.training, "max_steps": options.max_steps}
        testbed.eval_every = min(testbed.eval_every, options.max_steps)
    check_same_settings(options.out, testbed)
    results = None
    try:
        for seed in options.seeds:
            initial = testbed.build(seed)
            for method in options.methods:
                run = train_one(testbed, method, seed, initial, progress=options.progress)
                results = record_run(options.out, testbed, method, seed, run)
                if method == "grpo" and options.trl_check and testbed.trl_comparable and seed == options.seeds[0]:
                    theirs = train_one(testbed, method, seed, initial, progress=options.progress, trl=True)
                    check = {"seed": seed, **compare_with_trl(run, theirs), "run": theirs["run"]}
                    results = record_trl_check(options.out, testbed, check)
    finally:
        testbed.close()
    entry = results["testbeds"][testbed.name]
    plot(options.out, testbed.name, entry)
    print(markdown_table(testbed.name, entry))
    return results


if __name__ == "__main__":
    main()
