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

The methods of a seed run back to back in one process (their order turning by one each seed), so that their training
seconds were spent under the same machine load; each run records that load (`run.load`: the 1-minute load average
before and after it), the cores it was allowed, and the commit of the harness and of the `trl_exreplay` it imported.
For time-axis figures run one call at a time, pinned to a core nothing else uses (`taskset -c 1 ...`); per-seed calls
made apart (other cores, other machines) are merged with `--merge DIR... --out DIR`.

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
                             "buckets": [{successes: tasks} per step],                 # empty without replay
                             "rescued_groups": [...], ...},  # TEACH_SERIES, in runs that log them (`teach`)
                  "guidance": {"guided_fraction": [float per step], "success_guided": [float | null], ...},
                                                 # GUIDE_SERIES, only in experience-guided runs
                  "wall_s": float, "step_s": float,   # training time (evaluation excluded), per optimizer step
                  "losses": [float per step], "settings": {every config field this run set},
                  "zero_std_groups": [float per step],  # after rescued and replayed rows are in the groups:
                                 # replay/zero_std_trained (TRL's frac_reward_zero_std before the library kept TRL's
                                 # meaning, and in runs without replay; absent in older runs)
                  "zero_std_fresh": [float | null per step],  # the share of groups whose fresh rollouts alone
                                 # have no reward spread (TRL's frac_reward_zero_std since the library keeps TRL's
                                 # meaning; replay/zero_std_fresh before; null without replay; absent in older runs)
                  "split": {"all_fail_fresh": [...], "all_win_fresh": [...]},  # the fresh groups whose rollouts all
                                 # failed / all won, per step (replay runs since issue 69; absent otherwise)
                  "run": {"command": str, "commit": str, "versions": {...}, "machine": {...}, "date": str,
                          "library": {"path": str, "commit": str}, "load": {"before": float, "after": float}}
                                 # library and load: absent in runs recorded before them
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
rollouts and, beside it, against training seconds: the mean over seeds and the min-max band, one line per method.

The report (`--report`) reads every figure per seed, each method against the baseline's run on the same seed: the
normalised area under held-out success over fresh rollouts (and over training seconds) up to the fewest any method
consumed on that seed, the fresh rollouts to the seed's baseline final and to the testbed's `target_levels` (median and
geometric mean of the ratios, with the seeds that never reach a target and those where it is not above the start),
final success (also on the seeds where neither run collapsed) and collapses (exact McNemar). The ratio read off curves
averaged over seeds is printed only as an appendix that shows how fragile it is (`--mean-curve`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
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
# The library's defaults before every group taught (issue 55): no rescue, no retired questions (and no spread plan,
# issue 69). `exreplay` and its variants are the arms of the earlier tests, run before the switch with `{}` for these,
# so they set them here; `teach` and its variants were run with `{}` from issue 55 to issue 69.
REPLAY_ONLY = {"replay_rescue": 0, "replay_retire_solved": False, "replay_spread_plan": False}  # replay alone
TEACH = {"replay_spread_plan": False, "replay_retire_solved": True}  # rescue, retired questions revisited at 0.5
PRESETS: dict[str, dict] = {
    "grpo": {"enable_experience_replay": False},
    "exreplay": REPLAY_ONLY,
    "exreplay-exgrpo": {**REPLAY_ONLY, "replay_shaping": "exgrpo"},  # the shaping alone (before replay_profile)
    # ExGRPO's published recipe (replay_profile, docs/config.md "Profiles"), and the same without retired questions
    "exgrpo": {"replay_profile": "exgrpo"},
    "exgrpo-noretire": {"replay_profile": "exgrpo", "replay_retire_solved": False},
    # Every group teaches, the defaults of issue 55 to issue 69: rescue of all-fail groups, retired questions revisited
    # (run as `{}` before the spread plan became the default, and before that as `replay_profile="teach"`).
    "teach": TEACH,
    # Its pre-registered test's grid on the tuning seeds (50-54), which chose revisits at 0.5 (the grid's and the report
    # runs' `teach-revisit50`, today's `teach`): revisits at 0.25 (the grid's `teach`), rescue alone
    "teach-revisit25": {**TEACH, "replay_revisit_ratio": 0.25},
    "teach-rescue-only": {**TEACH, "replay_retire_solved": False},
    # Rollouts where they teach (issue 69): `teach` with the spread plan (`replay_spread_plan`), and the grid of its
    # pre-registered test's tuning seeds (60-64): more exploration, two groups a task, the plan instead of retirement
    # (docs/results.md, "Rollouts where they teach"). The last, chosen by the grid and made the default by the report
    # runs, is today's defaults; the others were run as `teach`'s `{}` with the plan's fields.
    "spread": {**TEACH, "replay_spread_plan": True},
    "spread-explore25": {**TEACH, "replay_spread_plan": True, "replay_spread_explore": 0.25},
    "spread-cap2": {**TEACH, "replay_spread_plan": True, "replay_spread_max_groups": 2},
    "spread-noretire": {"replay_spread_plan": True, "replay_retire_solved": False},
    # Candidates tried on the tuning seeds (0-4); see docs/results.md for what they showed.
    "exreplay-k4": {**REPLAY_ONLY, "replay_trajectories_per_group": 4},  # half of a replayed task's group is replayed
    "exreplay-early": {**REPLAY_ONLY, "replay_start_ratio": 0.1},
    "exreplay-k4-early-r75": {
        **REPLAY_ONLY,
        "replay_trajectories_per_group": 4,
        "replay_start_ratio": 0.1,
        "replay_ratio": 0.75,
    },
    "exreplay-normal": {
        **REPLAY_ONLY,
        "replay_bucket_weighting": "normal",
    },  # ExGRPO's Gaussian over buckets (medium tasks)
    "exreplay-linear": {
        **REPLAY_ONLY,
        "replay_bucket_weighting": "linear",
    },  # harder tasks (fewer successes) drawn more
    "exreplay-random": {
        **REPLAY_ONLY,
        "replay_select_mode": "random",
    },  # random replay, FIFO eviction (not lowest entropy)
    "exreplay-tight-clip": {
        **REPLAY_ONLY,
        "replay_clip_high": 0.2,
    },  # replayed ratios clipped as fresh ones are (1 + 0.2)
    "exreplay-saved-entropy": {
        **REPLAY_ONLY,
        "replay_select_by_current_entropy": False,
    },  # rank by stored entropy: no extra forward
    # Experience-guided rollouts, as AgentEvolver's recommended configuration sets them (docs/guidelines/exp_manager.md
    # in github.com/modelscope/AgentEvolver): half of each task's rollouts get retrieved experience, every training
    # sample has it stripped (trained off-policy); the offline provider summarises each step's successes (AgentEvolver's
    # `updated_freq: 0` relies on a prebuilt store, which these runs lack).
    "exreplay-guided": {**REPLAY_ONLY, **GUIDED},
    "grpo-guided": {"enable_experience_replay": False, **GUIDED},  # guidance alone: its effect without replay
    # The same, with the testbed's experience (`Testbed.experience_settings` and `.experience_provider()`): e.g. the
    # environment's own summariser hook and a template the tiny model's vocabulary can spell.
    "exreplay-guided-env": {**REPLAY_ONLY, **GUIDED, "experience_from_testbed": True},
    "grpo-guided-env": {"enable_experience_replay": False, **GUIDED, "experience_from_testbed": True},
    # Tried on the tuning seeds: guided rows trained on their guided prompt (on-policy), so the policy learns to read it.
    "exreplay-guided-env-keep": {
        **REPLAY_ONLY,
        **GUIDED,
        "guidance_trained_prompt": "guided",
        "experience_from_testbed": True,
    },
}
COMMON = dict(use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True)


def rows_per_step(settings: dict) -> int:
    """Completions (episodes) per optimizer step of a one-process run: its batch times its accumulation steps."""
    return settings["per_device_train_batch_size"] * settings.get("gradient_accumulation_steps", 1)


REPLAY_SERIES = ("rows_fraction", "pool_tasks", "pool_trajectories", "skip_set", "importance_ratio_mean", "policy_age")
# What every group teaching (the defaults) logs (rescue, retired questions and their revisits), per step, in runs that log them
# (None where a step does not: `returned_tasks` only in steps with a revisit).
SPLIT_SERIES = ("all_fail_fresh", "all_win_fresh")  # per step: the fresh groups whose rollouts all failed, all won
TEACH_SERIES = ("rescued_groups", "zero_std_rescued", "retired_tasks", "revisited_groups", "returned_tasks")
# The spread plan's (`replay_spread_plan`), per step: the groups it redirected, and the predicted and observed share of
# its planned fresh groups with spread (its calibration; None in a step without planned outcomes). Recorded since
# issue 69's report runs.
SPREAD_SERIES = ("spread_replanned_groups", "spread_predicted_fresh", "spread_observed_fresh")
# The `guide/` metrics of experience-guided runs, per step (None where a step has no value, e.g. no guided row).
GUIDE_SERIES = ("guided_fraction", "discarded_fraction", "records_per_rollout", "success_guided", "success_unguided",
                "store_records", "summarizer_backlog", "summarizer_failures", "retrieve_failures")  # fmt: skip


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def git_commit(folder: Path) -> str:
    """The commit checked out where `folder` lies, "+dirty" when tracked files differ from it; "unknown" outside git."""
    try:

        def git(*args):
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=folder, check=True).stdout

        commit = git("rev-parse", "HEAD").strip()
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_record(load: dict | None = None) -> dict:
    """Where and how a run was made: the command, the harness's commit and the imported library's (a run from one
    worktree may import `trl_exreplay` installed from another), versions, machine, and the machine's load around it."""
    import trl_exreplay

    library = Path(trl_exreplay.__file__).resolve().parent
    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(Path(__file__).resolve().parent),
        "library": {"path": str(library), "commit": git_commit(library)},
        "load": load or {},
        "versions": {name: version(name) for name in ("trl", "transformers", "torch", "accelerate", "datasets")},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "gpu": _gpu_name(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cores_allowed": len(os.sched_getaffinity(0)),  # 1 when pinned (taskset), as the time-axis runs are
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
        self.points, self.losses, self.zero_std_groups, self.zero_std_fresh = [], [], [], []
        self.split = {name: [] for name in SPLIT_SERIES}
        self.pending_split: dict[str, float] = {}
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
        # TRL's frac_reward_zero_std is the fresh rollouts' share (the library keeps TRL's meaning); the share after
        # rescued and replayed rows are in the groups is replay/zero_std_trained (runs with replay)
        trained = logs.get("replay/zero_std_trained")
        self.zero_std_groups.append(logs.get("frac_reward_zero_std") if trained is None else trained)
        self.zero_std_fresh.append(logs.get("frac_reward_zero_std") if "replay/rows_fraction" in logs else None)
        probed, self.pending_split = self.pending_split, {}  # runs without replay: `_split_probe`'s
        for name in SPLIT_SERIES:  # the fresh groups that teach nothing, by cause
            self.split[name].append(logs.get(f"replay/{name}", probed.get(name)))
        train_success = logs.get("replay/fresh_reward", logs.get("env/success_rate", logs.get("reward")))
        if "replay/rows_fraction" in logs:
            for name in REPLAY_SERIES:
                self.replay[name].append(logs.get(f"replay/{name}"))
            # Tasks per difficulty bucket (successes among a task's latest fresh rollouts), stored or not.
            buckets = {k.removeprefix("replay/bucket_"): v for k, v in logs.items() if k.startswith("replay/bucket_")}
            self.replay.setdefault("buckets", []).append(buckets)
            if any(f"replay/{name}" in logs for name in TEACH_SERIES):
                for name in TEACH_SERIES:
                    self.replay.setdefault(name, []).append(logs.get(f"replay/{name}"))
            if "replay/spread_replanned_groups" in logs:
                for name in SPREAD_SERIES:
                    self.replay.setdefault(name, []).append(logs.get(f"replay/{name}"))
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


def _split_probe(trainer_cls, recorder, group_size: int):
    """`trainer_cls` that records, for a run without replay (whose trainer logs no replay/* metric, as GRPOTrainer),
    the share of each generation batch's groups whose rollouts all failed or all won: the same split replay runs log
    as replay/all_fail_fresh and replay/all_win_fresh, from the gathered rewards (every row is fresh there). It reads
    what TRL computed and changes nothing."""

    class SplitProbe(trainer_cls):
        def _calculate_rewards(self, *args, **kwargs):
            rewards = super()._calculate_rewards(*args, **kwargs)
            weights = self.reward_weights.to(rewards.device)
            threshold = getattr(self.args, "replay_success_threshold", 1.0)
            won = ((rewards * weights).nansum(dim=1) >= threshold).view(-1, group_size)
            recorder.pending_split = {"all_fail_fresh": (~won).all(dim=1).float().mean().item(),
                                      "all_win_fresh": won.all(dim=1).float().mean().item()}  # fmt: skip
            return rewards

    return SplitProbe


def train_one(testbed, method: str, seed: int, initial: tuple, *, progress: bool = True, trl: bool = False) -> dict:
    """Train `method` on `testbed` from `initial` = (model, tokenizer) (copied) and return its run record."""
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer, GuidanceSettings, MultiTurnSettings

    load_before = os.getloadavg()[0]  # the machine's 1-minute load: runs compare on time only under similar loads
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
        # the optional parts' settings go to the trainer with the part, the rest to the config
        episodes = {k: v for k, v in settings.items() if k in MultiTurnSettings.__dataclass_fields__}
        guidance = {k: v for k, v in settings.items() if k in GuidanceSettings.__dataclass_fields__}
        kwargs = {}
        if not trl:
            config = {k: v for k, v in settings.items() if k not in episodes and k not in guidance}
            args = ExReplayGRPOConfig(output_dir=output_dir, **config)
            trainer_cls = ExReplayGRPOTrainer
            kwargs.update({"guidance": GuidanceSettings(**guidance)} if guidance else {})
        text_env_factory = testbed.text_env_factory()
        if text_env_factory is not None:
            kwargs.update(text_env_factory=text_env_factory, multi_turn=MultiTurnSettings(**episodes))
        provider = testbed.experience_provider() if from_testbed else None
        if provider is not None:
            kwargs["experience_provider"] = provider
        if not trl and settings.get("enable_experience_replay") is False:
            trainer_cls = _split_probe(trainer_cls, recorder, settings["num_generations"])
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
        "zero_std_fresh": recorder.zero_std_fresh,
        **({"split": recorder.split} if any(v is not None for vs in recorder.split.values() for v in vs) else {}),
        "replay": recorder.replay,
        **({"guidance": recorder.guidance} if recorder.guidance["guided_fraction"] else {}),
        "wall_s": round(wall, 3),
        "step_s": round(wall / max_steps, 4),
        "settings": {k: v for k, v in settings.items() if k not in COMMON},  # what this run trained with
        "run": run_record({"before": load_before, "after": os.getloadavg()[0]}),
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

OPTIONAL_SERIES = ("zero_std_groups", "zero_std_fresh")


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
                for key in OPTIONAL_SERIES:  # absent in runs recorded before the series was
                    if key in run:
                        need(run[key], list, f"{where}.{key}")
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
    lock, and the file is replaced atomically (`write_atomic`, the package's one atomic writer), so a killed run leaves
    the old file or the new.
    """
    import fcntl

    from trl_exreplay.pool.store import write_atomic

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load_results(out)
        change(results)
        write_atomic(str(out / "results.json"), write)
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


def merge_results(sources: list[Path], out: Path) -> dict:
    """Merge the runs of the results folders `sources` (e.g. one per seed, made on several machines or cores) into
    `out/results.json`. Refused, before anything is written: a testbed whose settings (training fields, model,
    evaluation) differ between two folders, a method whose preset differs, and one (testbed, method, seed) recorded
    twice with different runs; the same run found twice is kept once."""
    incoming = [(source, load_results(source)) for source in sources]

    def change(results):
        for source, other in incoming:
            for name, theirs in other["testbeds"].items():
                ours = results["testbeds"].get(name)
                if ours is None:
                    results["testbeds"][name] = copy.deepcopy(theirs)
                    continue
                for key in ("training", "model", "eval_every", "rows_per_step"):
                    if ours.get(key) != theirs.get(key):
                        raise ValueError(f"{source}: testbed {name}'s {key} {theirs.get(key)} differs from "
                                         f"{ours.get(key)} in the runs merged before it; merge it into another --out")  # fmt: skip
                if "trl_check" in theirs:
                    ours.setdefault("trl_check", theirs["trl_check"])
                for method, method_entry in theirs["methods"].items():
                    mine = ours["methods"].setdefault(method, {"preset": method_entry["preset"], "runs": {}})
                    if mine["preset"] != method_entry["preset"]:
                        raise ValueError(f"{source}: {name} method {method}'s preset {method_entry['preset']} differs "
                                         f"from {mine['preset']} in the runs merged before it")  # fmt: skip
                    for seed, run in method_entry["runs"].items():
                        if mine["runs"].get(seed, run) != run:
                            raise ValueError(f"{source}: {name} {method} seed {seed} is recorded twice, with "
                                             "different runs; merge only one of them")  # fmt: skip
                        mine["runs"][seed] = run

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
# Every figure of the tables is computed per seed, each method against the baseline's run on the same seed; the curves
# averaged over seeds (`method_curve`) only draw the plots and the appendix that shows why no figure is read off them.
AXES = {"rollouts": "fresh_rollouts", "time": "wall_s"}  # the x-axes of the area under the curve
# bfa2444 counts a difficulty bucket above G as G in the "normal" (ExGRPO's Gaussian) bucket weighting. The commits of
# committed runs made before it, whose "normal"-weighted runs with buckets above G ran the case that fix changes:
BUCKET_CLIP = "bfa2444"
BEFORE_BUCKET_CLIP = ("74660d4", "bca855d")


def method_curve(runs: dict) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per evaluation point (over seeds): mean fresh rollouts, mean, min and max held-out success (plots only)."""
    return _mean_curve(runs, "fresh_rollouts")


def _mean_curve(runs: dict, axis: str) -> tuple[list[float], list[float], list[float], list[float]]:
    series = [run["points"] for run in runs.values()]
    n = min(len(points) for points in series)
    xs = [sum(points[i][axis] for points in series) / len(series) for i in range(n)]
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


def paired(differences: list[float]) -> dict | None:
    """The paired statistics of per-seed differences: mean and 95% t interval, median, exact sign test."""
    if not differences:
        return None
    return {"interval": paired_interval(differences), "median": statistics.median(differences),
            "sign": sign_test(differences), "seeds": len(differences)}  # fmt: skip


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


def seed_curve(run: dict, axis: str = "fresh_rollouts") -> tuple[list[float], list[float]]:
    """One run's held-out curve: x (`fresh_rollouts`, or `wall_s`: training seconds) and success at each point."""
    return [p[axis] for p in run["points"]], [p["heldout_success"] for p in run["points"]]


def value_at(xs: list[float], ys: list[float], x: float) -> float:
    """The curve at `x`: linear between its points, its first value before them and its last after them."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = xs[i - 1], xs[i]
            return ys[i] if x1 == x0 else ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)
    return ys[-1]


def normalised_auc(xs: list[float], ys: list[float], end: float) -> float:
    """The trapezoid integral of the curve from 0 to `end` (interpolated there), divided by `end`: its mean success
    over [0, end]."""
    knots = [(0.0, value_at(xs, ys, 0.0))] + [(x, y) for x, y in zip(xs, ys) if 0 < x < end]
    knots.append((end, value_at(xs, ys, end)))
    return sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(knots, knots[1:])) / end


def seed_aucs(methods: dict, axis: str) -> dict[str, dict[str, float]]:
    """Per method and seed, the normalised area under held-out success over `axis` ("fresh_rollouts" or "wall_s") up
    to R, the smallest last x that any method of the comparison (every method of `methods` that ran the seed)
    reached on that seed: every method of a seed is read over the same range."""
    ends: dict[str, float] = {}
    for method in methods.values():
        for seed, run in method["runs"].items():
            last = run["points"][-1][axis]
            ends[seed] = min(ends.get(seed, last), last)
    return {
        name: {seed: normalised_auc(*seed_curve(run, axis), ends[seed])
               for seed, run in method["runs"].items() if ends[seed] > 0}
        for name, method in methods.items()
    }  # fmt: skip


def to_baseline_final(run: dict, base_run: dict, axis: str = "fresh_rollouts") -> dict:
    """Fresh rollouts (or, with `axis="wall_s"`, training seconds) `run` needs to reach the same seed's baseline final
    (`base_run`'s last held-out success), and its ratio to what the baseline needed to first reach it. Not scoreable
    when that target is at or below the seed's initial success (its step-0 point: every method of a seed starts from
    the same model)."""
    target = base_run["points"][-1]["heldout_success"]
    if target <= base_run["points"][0]["heldout_success"]:
        return {"target": target, "status": "not scoreable"}
    base_need = rollouts_to_reach(*seed_curve(base_run, axis), target)
    need = rollouts_to_reach(*seed_curve(run, axis), target)
    if need is None:
        return {"target": target, "status": "never", "baseline_need": base_need}
    return {"target": target, "status": "reached", "need": need, "baseline_need": base_need,
            "ratio": need / base_need}  # fmt: skip


def median_counting_never(final: dict[str, dict]) -> float | None:
    """The median ratio to the baseline's final over every scoreable seed, a seed that never reached it counted as
    never (infinite: the median is infinite when half the seeds or more never do); None without a scoreable seed.
    The median over the seeds that reached it alone leaves out the seeds where a method did worst."""
    ratios = [
        f["ratio"] if f["status"] == "reached" else math.inf for f in final.values() if f["status"] != "not scoreable"
    ]
    return statistics.median(ratios) if ratios else None


def interval_side(differences: list[float]) -> str:
    """Where the 95% t interval of the mean difference lies: "above 0", "below 0" or "contains 0"."""
    interval = paired_interval(differences)
    if interval is None:
        return "contains 0"
    return "above 0" if interval["low"] > 0 else "below 0" if interval["high"] < 0 else "contains 0"


def leave_one_out(differences: dict[str, float]) -> dict:
    """How fragile a paired interval's verdict is: its side of 0 on every seed, and the seeds whose removal alone (one
    at a time) moves it to another side."""
    side = interval_side(list(differences.values()))
    flips = [seed for seed in differences
             if interval_side([d for s, d in differences.items() if s != seed]) != side]  # fmt: skip
    return {"side": side, "flips": sorted(flips, key=int), "seeds": len(differences)}


def ratio_summary(ratios: list[float]) -> dict | None:
    """Median and geometric mean of per-seed ratios (None without any)."""
    if not ratios:
        return None
    geometric = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return {"median": statistics.median(ratios), "geometric_mean": geometric, "seeds": len(ratios)}


def to_level(runs: dict, base_runs: dict, level: float) -> dict:
    """Fresh rollouts to a fixed held-out success `level`, per seed (None: never reached; seeds whose initial success
    is already at or above it are not scoreable); the median over the scoreable seeds with "never" counted as
    infinite (infinite when at least half never reach it), and the ratio to the baseline's need on the seeds where
    both reach it."""
    need, ratios, not_scoreable = {}, [], []
    for seed, run in runs.items():
        if run["points"][0]["heldout_success"] >= level:
            not_scoreable.append(seed)
            continue
        need[seed] = rollouts_to_reach(*seed_curve(run), level)
        base = base_runs.get(seed)
        base_need = rollouts_to_reach(*seed_curve(base), level) if base is not None else None
        if need[seed] is not None and base_need:
            ratios.append(need[seed] / base_need)
    reached = [v for v in need.values() if v is not None]
    median = statistics.median([math.inf if v is None else v for v in need.values()]) if need else None
    return {"level": level, "need": need, "median": median, "never": len(need) - len(reached),
            "not_scoreable": len(not_scoreable), "ratio": ratio_summary(ratios)}  # fmt: skip


def calibration(runs: dict) -> dict | None:
    """The spread plan's calibration over a method's runs: the mean predicted and observed share of its planned fresh
    groups with spread, over every step that recorded both (None where no run recorded the plan's series)."""
    pairs = [(p, o) for run in runs.values()
             for p, o in zip(run["replay"].get("spread_predicted_fresh", []), run["replay"].get("spread_observed_fresh", []))
             if p is not None and o is not None]  # fmt: skip
    if not pairs:
        return None
    return {"predicted": sum(p for p, _ in pairs) / len(pairs), "observed": sum(o for _, o in pairs) / len(pairs),
            "steps": len(pairs)}  # fmt: skip


def _mean_of_series(series) -> float | None:
    values = [v for one in series if one for v in one if v is not None]
    return sum(values) / len(values) if values else None


def replays(run: dict) -> bool:
    return run["settings"].get("enable_experience_replay", True) is not False


def normal_weighting(settings: dict) -> bool:
    """Whether a run drew pool tasks by ExGRPO's Gaussian over buckets (`"normal"`; the `exgrpo` profile's)."""
    weighting = settings.get("replay_bucket_weighting")
    return weighting == "normal" or (weighting is None and settings.get("replay_profile") == "exgrpo")


def buckets_above_g(run: dict) -> int:
    """Steps whose recorded difficulty buckets hold a task with more successes than the run's G rollouts a group."""
    g = run["settings"].get("num_generations", 8)
    return sum(any(int(k) > g and v for k, v in b.items()) for b in run["replay"].get("buckets", []))


def summarize(entry: dict, baseline: str = "grpo", levels: tuple[float, ...] = ()) -> list[dict]:
    """One row per method, every comparison per seed against the baseline's run on the same seed: final held-out
    success (and its paired difference, also on the seeds where neither run collapsed), collapses (exact McNemar
    test), the normalised area under the curve over fresh rollouts and over training time, the fresh rollouts to the
    same seed's baseline final and to each of `levels`, zero-spread groups (after replayed rows are inserted, and among
    fresh rollouts only), generation saved, training time per step."""
    methods = entry["methods"]
    base_runs = methods[baseline]["runs"] if baseline in methods else {}
    aucs = {axis: seed_aucs(methods, key) for axis, key in AXES.items()}
    rows = []
    for name, method in methods.items():
        runs = method["runs"]
        seeds = sorted(runs, key=int)
        shared = [s for s in seeds if s in base_runs]
        finals = {s: runs[s]["points"][-1]["heldout_success"] for s in seeds}
        base_finals = {s: base_runs[s]["points"][-1]["heldout_success"] for s in shared}
        mean = sum(finals.values()) / len(finals)
        std = math.sqrt(sum((f - mean) ** 2 for f in finals.values()) / (len(finals) - 1)) if len(finals) > 1 else 0.0
        fell = {s: collapsed(runs[s]["points"]) for s in seeds}
        base_fell = {s: collapsed(base_runs[s]["points"]) for s in shared}
        steady = [s for s in shared if not fell[s] and not base_fell[s]]
        auc = {}
        for axis in AXES:
            mine, theirs = aucs[axis][name], aucs[axis].get(baseline, {})
            differences = {s: mine[s] - theirs[s] for s in shared if s in mine and s in theirs}
            auc[axis] = {"per_seed": mine, "mean": sum(mine.values()) / len(mine) if mine else None,
                         "paired": paired(list(differences.values())), "leave_one_out": leave_one_out(differences)}  # fmt: skip
        final = {s: to_baseline_final(runs[s], base_runs[s]) for s in shared}
        final_time = {s: to_baseline_final(runs[s], base_runs[s], "wall_s") for s in shared}
        generated = [  # the share of each run's rows that were generated, not replayed
            run["points"][-1]["fresh_rollouts"] / (rows_per_step(run["settings"]) * run["points"][-1]["step"])
            for run in runs.values()
        ]
        after = _mean_of_series(run.get("zero_std_groups") for run in runs.values())
        if not any(replays(run) for run in runs.values()):
            fresh, fresh_source = after, "every group fresh"  # no replayed row: the two shares are one
        else:
            fresh = _mean_of_series(run.get("zero_std_fresh") for run in runs.values())
            fresh_source = "recorded" if fresh is not None else "not recorded"
        early = {s: buckets_above_g(runs[s]) for s in seeds
                 if normal_weighting(runs[s]["settings"]) and runs[s]["run"]["commit"][:7] in BEFORE_BUCKET_CLIP}  # fmt: skip
        rows.append({
            "method": name, "seeds": seeds, "final_mean": mean, "final_std": std, "final_per_seed": finals,
            "initial_mean": sum(run["points"][0]["heldout_success"] for run in runs.values()) / len(runs),
            "initial_per_seed": {s: runs[s]["points"][0]["heldout_success"] for s in seeds},
            "final": paired([finals[s] - base_finals[s] for s in shared]),
            "final_steady": paired([finals[s] - base_finals[s] for s in steady]),
            "auc_steady": paired([auc["rollouts"]["per_seed"][s] - aucs["rollouts"][baseline][s] for s in steady
                                  if s in auc["rollouts"]["per_seed"] and s in aucs["rollouts"].get(baseline, {})]),
            # kept under their former names: the results line's test and older readers use them
            "paired_difference": paired_interval([finals[s] - base_finals[s] for s in shared]),
            "sign_test": sign_test([finals[s] - base_finals[s] for s in shared]) if shared else None,
            "collapsed": sum(fell.values()), "collapse_rate": sum(fell.values()) / len(runs),
            "collapsed_shared": sum(fell[s] for s in shared), "baseline_collapsed_shared": sum(base_fell.values()),
            # exact McNemar: the seeds where only one of the pair collapsed (wins: only the baseline did)
            "collapse_test": sign_test([int(base_fell[s]) - int(fell[s]) for s in shared]) if shared else None,
            "auc": auc,
            "to_final": {
                "per_seed": final,
                "ratio": ratio_summary([f["ratio"] for f in final.values() if f["status"] == "reached"]),
                "median_counting_never": median_counting_never(final),
                "never": sum(f["status"] == "never" for f in final.values()),
                "not_scoreable": sum(f["status"] == "not scoreable" for f in final.values()),
            },
            "to_final_time": {
                "median_counting_never": median_counting_never(final_time),
                "never": sum(f["status"] == "never" for f in final_time.values()),
                "reached": sum(f["status"] == "reached" for f in final_time.values()),
            },
            "levels": [to_level(runs, base_runs, level) for level in levels],
            "calibration": calibration(runs),
            "zero_std_groups": after, "zero_std_fresh": fresh, "zero_std_fresh_source": fresh_source,
            "split": {name: _mean_of_series(run.get("split", {}).get(name) for run in runs.values())
                      for name in SPLIT_SERIES},
            "generation_saved": 1 - sum(generated) / len(generated),
            "step_s": sum(run["step_s"] for run in runs.values()) / len(runs),
            "step_ratios": [runs[s]["step_s"] / base_runs[s]["step_s"] for s in shared if base_runs[s]["step_s"] > 0],
            "before_bucket_clip": early,
        })  # fmt: skip
    return rows


def mean_curve_ratio(entry: dict, baseline: str, level: float) -> dict[str, float | None]:
    """Appendix only, not an endpoint: the rollouts at which each method's MEAN curve (averaged over seeds at each
    evaluation point) first reaches `level`, as a ratio to the baseline's mean curve (None: never)."""
    needs = {}
    for name, method in entry["methods"].items():
        xs, ys, _, _ = method_curve(method["runs"])
        needs[name] = rollouts_to_reach(xs, ys, level)
    base = needs.get(baseline)
    return {name: (need / base if need is not None and base else None) for name, need in needs.items()}


def mean_curve_lines(entry: dict, baseline: str, levels: list[str]) -> list[str]:
    """The appendix table of the mean-curve ratio at several levels ("final": the baseline's mean final)."""
    xs, ys, _, _ = method_curve(entry["methods"][baseline]["runs"])
    values = [ys[-1] if level == "final" else float(level) for level in levels]
    names = list(entry["methods"])
    lines = ["", f"Appendix, not an endpoint: fresh rollouts at which the mean curve over seeds first reaches a level, "
             f"as a ratio to {baseline}'s mean curve (the figure the tables used to give, at {baseline}'s mean final; "
             "read per seed above):", "",
             "| level | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for level, value in zip(levels, values):
        ratios = mean_curve_ratio(entry, baseline, value)
        cells = " | ".join("never" if ratios[n] is None else f"{ratios[n]:.2f}x" for n in names)
        label = f"{value:.4f} ({baseline}'s mean final)" if level == "final" else f"{value:.3f}"
        lines.append(f"| {label} | {cells} |")
    return lines


def method_label(name: str, entry_name: str, entry: dict) -> str:
    """A method named by what it ran: on a testbed whose own training fields set replay settings (a recipe's YAML),
    a replay method runs those (with its preset's fields on top), not the library's defaults."""
    method = entry["methods"][name]
    if not replay_fields(entry) or not any(replays(run) for run in method["runs"].values()):
        return name
    what = getattr(TESTBEDS.get(entry_name), "replay_settings", None) or "the testbed's replay settings"
    return f"{name} ({what})" if not method.get("preset") else f"{name} (over {what})"


# The replay fields' names before they were all `replay_*` (runs recorded then keep them).
FORMER_REPLAY_FIELDS = ("exp_", "off_policy", "offpolicy_", "max_trajectories_per_task", "use_current_policy_entropy")


def replay_fields(entry: dict) -> dict:
    """The replay settings the testbed's own training fields set (beside `enable_experience_replay`)."""
    return {k: v for k, v in entry.get("training", {}).items() if k.startswith(("replay_", *FORMER_REPLAY_FIELDS))}


def _cell_name(label: str) -> str:
    """`method` (what it ran): the method's key in code, its label beside."""
    key, _, rest = label.partition(" ")
    return f"`{key}` {rest}" if rest else f"`{key}`"


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def _p(p: float) -> str:
    return f"{p:.2g}"


def _paired_cell(stats: dict | None) -> str:
    if stats is None or stats["interval"] is None:
        return ""
    d, t = stats["interval"], stats["sign"]
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]; {t['wins']}/{t['losses']}, p = {_p(t['p'])}"


def _ratio_cell(summary: dict | None) -> str:
    return "no seed" if summary is None else f"{summary['median']:.2f}x ({summary['geometric_mean']:.2f}x)"


def _times(value: float | None) -> str:
    return "no seed" if value is None else "never" if math.isinf(value) else f"{value:.2f}x"


def _rollouts(value: float | None) -> str:
    return "never" if value is None or math.isinf(value) else f"{value:,.0f}"


def markdown_table(name: str, entry: dict, baseline: str = "grpo") -> str:
    levels = tuple(getattr(TESTBEDS.get(name), "target_levels", ()))
    rows = summarize(entry, baseline, levels)
    label = {r["method"]: method_label(r["method"], name, entry) for r in rows}
    mark = {r["method"]: " †" if r["before_bucket_clip"] else "" for r in rows}
    b = f"`{baseline}`"
    lines = [
        f"### {name}: {entry['summary']}",
        "",
        f"| method | final (mean ± std) | initial | Δ final vs {b} [95% CI]; sign test | AUC, fresh rollouts "
        f"| Δ AUC vs {b} [95% CI]; sign test | AUC, training time | Δ AUC (time) vs {b} [95% CI]; sign test "
        f"| collapsed (McNemar p vs {b}) | generation saved | s / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        other = r["method"] != baseline
        rollouts, time_ = r["auc"]["rollouts"], r["auc"]["time"]
        test = r["collapse_test"]
        mcnemar = f" (p = {_p(test['p'])})" if other and test is not None else ""
        lines.append(
            f"| {_cell_name(label[r['method']])}{mark[r['method']]} | {r['final_mean']:.3f} ± {r['final_std']:.3f} "
            f"| {r['initial_mean']:.3f} | {_paired_cell(r['final']) if other else ''} | {rollouts['mean']:.3f} "
            f"| {_paired_cell(rollouts['paired']) if other else ''} | {time_['mean']:.3f} "
            f"| {_paired_cell(time_['paired']) if other else ''} | {r['collapsed']} of {len(r['seeds'])}{mcnemar} "
            f"| {100 * r['generation_saved']:.1f}% | {r['step_s']:.2f} |"
        )
    lines += [
        "",
        f"(Per seed, against {b}'s run on the same seed. AUC: held-out success integrated over fresh rollouts (or "
        "training seconds) from 0 to the fewest any method consumed on that seed, divided by it; sign test: seeds "
        "above/below, exact two-sided p; collapsed: ended below half its own best; McNemar: exact, on the seeds where "
        "only one of the two collapsed.)",
        "",
        f"| method | rollouts to {b}'s final on the same seed: median ratio (geometric mean) | reached / never / not "
        "scoreable | median ratio, never counted as never |" + "".join(f" to {level:.2f}: median rollouts; never / not scoreable "
                                  f"| to {level:.2f}: ratio vs {b}, median (geometric mean); seeds |"
                                  for level in levels),
        "|---|---|---|---|" + "---|---|" * len(levels),
    ]  # fmt: skip
    for r in rows:
        f = r["to_final"]
        cells = [_ratio_cell(f["ratio"]), f"{f['ratio']['seeds'] if f['ratio'] else 0} / {f['never']} / "
                 f"{f['not_scoreable']}", _times(f["median_counting_never"])]  # fmt: skip
        for level in r["levels"]:
            cells += [f"{_rollouts(level['median'])}; {level['never']} / {level['not_scoreable']}",
                      f"{_ratio_cell(level['ratio'])}; {level['ratio']['seeds'] if level['ratio'] else 0}"]  # fmt: skip
        lines.append(f"| {_cell_name(label[r['method']])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"(Ratio: the fresh rollouts a method needs to first reach the target on a seed (linear between evaluation "
        f"points) over those {b} needs on that seed, summarised over the seeds where it reached it; never: seeds "
        "where it did not; not scoreable: seeds where the target is at or below the initial success; never counted "
        "as never: the median over every scoreable seed, a seed that never reached it counted as infinite. A median "
        'is "never" when half the seeds or more never reach the target.)',
    ]
    lines += collapse_lines(rows, baseline)
    lines += leave_one_out_lines(rows, baseline)
    lines += step_time_lines(rows, baseline)
    lines += zero_spread_lines(rows, label)
    lines += per_seed_lines(rows, baseline)
    lines += label_lines(name, entry, rows, label)
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


def collapse_lines(rows: list[dict], baseline: str) -> list[str]:
    """Per method, the final difference and the AUC difference (fresh rollouts) to the baseline on every seed and on
    the seeds where neither run collapsed, and the collapses of each on the seeds they share (exact McNemar test)."""
    lines = []
    for r in rows:
        if r["method"] == baseline or r["final"] is None:
            continue
        everything, steady, test = r["final"], r["final_steady"], r["collapse_test"]
        auc, auc_steady = r["auc"]["rollouts"]["paired"], r["auc_steady"]
        n = everything["seeds"]
        cell = (f"- `{r['method']}` - `{baseline}`: final {_paired_cell(everything)}, median {everything['median']:+.3f}; "
                f"AUC {_paired_cell(auc)}, median {auc['median']:+.3f} ({n} seeds); ")  # fmt: skip
        if r["collapsed_shared"] == r["baseline_collapsed_shared"] == 0:
            lines.append(cell + "no run of either collapsed")
            continue
        if steady is None or steady["interval"] is None:
            cell += f"{0 if steady is None else 1} seed where neither collapsed; "
        else:
            cell += (f"on the {steady['seeds']} seeds where neither collapsed: final {_paired_cell(steady)}, median "
                     f"{steady['median']:+.3f}; AUC {_paired_cell(auc_steady)}, median {auc_steady['median']:+.3f}; ")  # fmt: skip
        cell += (f"collapsed: `{r['method']}` {r['collapsed_shared']} of {n}, `{baseline}` "
                 f"{r['baseline_collapsed_shared']} of {n}, exact McNemar p = {_p(test['p'])} ({_seeds(test['wins'])} "
                 f"where only `{baseline}` collapsed, {test['losses']} where only `{r['method']}` did)")  # fmt: skip
        lines.append(cell)
    return ["", "Final success and AUC by collapse (per seed):", *lines] if lines else []


def leave_one_out_lines(rows: list[dict], baseline: str) -> list[str]:
    """Per method, how many single seeds, dropped alone, move the AUC difference's 95% interval (fresh rollouts, and
    training time) to another side of 0: a verdict that one seed can flip is a fragile one."""
    lines = []
    for r in rows:
        if r["method"] == baseline or r["auc"]["rollouts"]["paired"] is None:
            continue
        cells = []
        for axis, label in (("rollouts", "fresh rollouts"), ("time", "training time")):
            loo = r["auc"][axis]["leave_one_out"]
            dropped = f" ({', '.join(loo['flips'])})" if loo["flips"] else ""
            cells.append(f"over {label}, {loo['side']} on {loo['seeds']} seeds; dropping one seed moves it on "
                         f"{len(loo['flips'])} of {loo['seeds']}{dropped}")  # fmt: skip
        lines.append(f"- `{r['method']}` - `{baseline}`: " + "; ".join(cells))
    return ["", "AUC difference's 95% interval, leaving one seed out:", *lines] if lines else []


def step_time_lines(rows: list[dict], baseline: str) -> list[str]:
    """Per method, its seconds per step over the baseline's on the same seed: the median and range over seeds. Read
    only where the runs of a seed shared one machine load (the harness runs a seed's methods back to back)."""
    lines = [f"- `{r['method']}`: median {statistics.median(r['step_ratios']):.2f} (range {min(r['step_ratios']):.2f}-"
             f"{max(r['step_ratios']):.2f}, {len(r['step_ratios'])} seeds)"
             for r in rows if r["method"] != baseline and r["step_ratios"]]  # fmt: skip
    if not lines:
        return []
    to_final = [f"- `{r['method']}`: {_times(r['to_final_time']['median_counting_never'])} "
                f"({r['to_final_time']['reached']} reached, {r['to_final_time']['never']} never)"
                for r in rows if r["method"] != baseline]  # fmt: skip
    return ["", f"Seconds per step over `{baseline}`'s on the same seed:", *lines, "",
            f"Training seconds to `{baseline}`'s final on the same seed over `{baseline}`'s, median counting a seed "
            "that never reaches it as never:", *to_final]  # fmt: skip


def zero_spread_lines(rows: list[dict], label: dict) -> list[str]:
    """Zero-spread groups: after rescued and replayed rows are in the groups, among the fresh rollouts alone, and the
    fresh groups by cause (every rollout failed, or won; recorded by replay runs since issue 69)."""
    if all(r["zero_std_groups"] is None and r["zero_std_fresh"] is None for r in rows):
        return ["", "Zero-spread groups: not recorded by these runs."]
    lines = ["", "| method | zero-spread groups, after rescued and replayed rows are inserted "
             "| zero-spread groups, fresh rollouts only | of the fresh groups: all failed / all won |",
             "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        after = "not recorded" if r["zero_std_groups"] is None else f"{100 * r['zero_std_groups']:.1f}%"
        fresh = {"every group fresh": f"{after} (every group fresh)", "not recorded": "not recorded"}.get(
            r["zero_std_fresh_source"], f"{100 * (r['zero_std_fresh'] or 0):.1f}%"
        )
        fail, win = (r["split"][name] for name in SPLIT_SERIES)
        split = "not recorded" if fail is None or win is None else f"{100 * fail:.1f}% / {100 * win:.1f}%"
        lines.append(f"| {_cell_name(label[r['method']])} | {after} | {fresh} | {split} |")
    calibrated = [f"- `{r['method']}`: predicted {100 * c['predicted']:.1f}%, observed {100 * c['observed']:.1f}% "
                  f"({c['steps']} steps)" for r in rows if (c := r["calibration"])]  # fmt: skip
    if calibrated:
        lines += [
            "",
            "The spread plan's calibration: its planned fresh groups with spread, mean over steps:",
            *calibrated,
        ]
    return lines


def per_seed_lines(rows: list[dict], baseline: str) -> list[str]:
    """Every seed: the initial success, and per method the final, the AUC over fresh rollouts and the rollouts to the
    baseline's final (the baseline's own need in rollouts; the others' as a ratio to it)."""
    base = next((r for r in rows if r["method"] == baseline), None)
    if base is None:
        return []
    names = [r["method"] for r in rows]
    lines = ["", f"Per seed: final / AUC over fresh rollouts / rollouts to `{baseline}`'s final on the seed ("
             f"`{baseline}`: its own need; the others: ratio to it; n/s: not scoreable):", "",
             "| seed | initial | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|---|" + "---|" * len(names)]  # fmt: skip
    for seed in base["seeds"]:
        cells = []
        for r in rows:
            if seed not in r["final_per_seed"]:
                cells.append("")
                continue
            f = r["to_final"]["per_seed"].get(seed, {})
            if f.get("status") == "not scoreable":
                need = "n/s"
            elif f.get("status") == "never":
                need = "never"
            elif r["method"] == baseline:
                need = _rollouts(f["baseline_need"])
            else:
                need = f"{f['ratio']:.2f}x"
            auc = r["auc"]["rollouts"]["per_seed"].get(seed)
            cells.append(f"{r['final_per_seed'][seed]:.3f} / {auc:.3f} / {need}")
        initial = base["initial_per_seed"][seed]  # the step-0 point: the same model for every method
        lines.append(f"| {seed} | {initial:.3f} | " + " | ".join(cells) + " |")
    return lines


def label_lines(name: str, entry: dict, rows: list[dict], label: dict) -> list[str]:
    """What the labels stand for: the replay settings a testbed's own training fields set, and the runs made before
    the bucket clip (with how many of their steps held buckets above G)."""
    lines = []
    fields = replay_fields(entry)
    relabelled = [r["method"] for r in rows if label[r["method"]] != r["method"]]
    if fields and relabelled:
        what = getattr(TESTBEDS.get(name), "replay_settings", None) or "the testbed's replay settings"
        settings = ", ".join(f"{k}={v}" for k, v in fields.items())
        lines.append(f"- {what}: the testbed's training fields set {settings}; every replay method here runs over "
                     f"them ({', '.join(f'`{m}`' for m in relabelled)}), so none of them is the library's defaults.")  # fmt: skip
    for r in rows:
        early = r["before_bucket_clip"]
        if not early:
            continue
        steps = ", ".join(f"{seed}: {n}" for seed, n in sorted(early.items(), key=lambda kv: int(kv[0])))
        lines.append(f"- † `{r['method']}`: {len(early)} of its {len(r['seeds'])} runs were made before {BUCKET_CLIP}, "
                     "which counts a bucket above G as G in ExGRPO's Gaussian bucket weighting (`\"normal\"`, which "
                     "it uses); steps whose buckets held a count above G, per seed: " + steps + ".")  # fmt: skip
    return ["", *lines] if lines else []


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
        commits: dict[str, list[str]] = {}
        for s, r in runs.items():
            if "run" in r:
                commits.setdefault(r["run"]["commit"][:7], []).append(s)
        if commits:
            cells.append("made at " + ", ".join(f"{c} ({seed_ranges(ss)})" for c, ss in commits.items()))
        recorded = [s for s, r in runs.items() if r.get("zero_std_groups")]
        if recorded and len(recorded) < len(runs):
            cells.append(f"zero-spread groups recorded on seeds {seed_ranges(recorded)}")
        fresh = [s for s, r in runs.items() if any(v is not None for v in r.get("zero_std_fresh") or [])]
        if fresh and len(fresh) < len(runs):
            cells.append(f"fresh zero-spread groups recorded on seeds {seed_ranges(fresh)}")
        lines.append(f"- `{name}` ({len(runs)} seeds): " + "; ".join(cells))
    return ["", "Runs by seed:", *lines] if lines else []


def seed_ranges(seeds) -> str:
    """Seeds as runs of consecutive numbers: "200-204, 207"."""
    numbers, parts = sorted(int(s) for s in seeds), []
    for n in numbers:
        if parts and n == parts[-1][1] + 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


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

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for method_name, method in entry["methods"].items():
        seeds = len(method["runs"])
        for ax, axis in zip(axes, AXES.values()):
            xs, mean, low, high = _mean_curve(method["runs"], axis)
            (line,) = ax.plot(xs, mean, marker="o", markersize=3,
                              label=f"{method_label(method_name, name, entry)} ({seeds} seeds)")  # fmt: skip
            ax.fill_between(xs, low, high, alpha=0.18, color=line.get_color())
    axes[0].set_xlabel("fresh rollouts consumed")
    axes[1].set_xlabel("training seconds (evaluation excluded; this machine, these runs)")
    measure = entry.get("measure", "held-out success")
    axes[0].set_ylabel("\n".join(textwrap.wrap(measure, 50)), fontsize=8 if len(measure) > 40 else 10)
    fig.suptitle(f"{name}: mean and min-max over seeds (the tables' figures are per seed)", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
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
            label = method_label(method_name, name, entry)
            left.plot(steps, [sum(s["pool_tasks"][i] for s in series) / len(series) for i in range(n)], label=label)
            right.plot(steps, [sum(s["rows_fraction"][i] for s in series) / len(series) for i in range(n)],
                       label=label)  # fmt: skip
        left.set(xlabel="optimizer step", ylabel="tasks in the pool (mean over seeds)", title=f"{name}: pool")
        right.set(xlabel="optimizer step", ylabel="replayed fraction of rows", title=f"{name}: replay share")
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}-replay.png", dpi=110)
        plt.close(fig)
    return path


def report(out: Path, baseline: str = "grpo", mean_curve: list[str] | None = None) -> str:
    results = load_results(out)
    parts = []
    for name, entry in results["testbeds"].items():
        if entry["methods"]:
            plot(out, name, entry)
            table = markdown_table(name, entry, baseline)
            if mean_curve and baseline in entry["methods"]:
                table += "\n" + "\n".join(mean_curve_lines(entry, baseline, mean_curve))
            parts.append(table)
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
                        help="Override a field of the testbed's tiny model (`trl_exreplay.demo.tiny.build_tiny_model`), e.g. "
                             "hidden_size=256; with `--set use_cpu=false` the runs train on the GPU.")  # fmt: skip
    parser.add_argument("--no-trl-check", dest="trl_check", action="store_false",
                        help="Skip the run of TRL's GRPOTrainer on the first seed.")  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="No progress bars.")
    parser.add_argument("--report", action="store_true", help="Only print the tables and redraw the plots of --out.")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                        help="Merge the runs of these results folders into --out (refusing runs that disagree), then "
                             "redraw its plots.")  # fmt: skip
    parser.add_argument("--baseline", default="grpo",
                        help="With --report: the method the paired differences and rollout ratios are taken against.")  # fmt: skip
    parser.add_argument("--mean-curve", metavar="LEVELS",
                        help="With --report: also print the appendix of the ratio read off the curves averaged over "
                             "seeds, at these comma-separated levels ('final': the baseline's mean final), to show how "
                             "fragile it is. Not an endpoint: the tables' figures are per seed.")  # fmt: skip
    options = parser.parse_args(argv)
    if not options.report and not options.merge and options.testbed is None:
        parser.error("--testbed is required unless --report or --merge")
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
    if options.merge:
        merge_results(options.merge, options.out)
    if options.report or options.merge:
        levels = [level for level in (options.mean_curve or "").split(",") if level]
        print(report(options.out, options.baseline, levels))
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
        for k, seed in enumerate(options.seeds):
            initial = testbed.build(seed)
            # The methods of a seed run back to back in this process, so that their training seconds compare (the
            # same machine load); their order turns by one each seed, so that no method always runs first.
            turn = k % len(options.methods)
            for method in options.methods[turn:] + options.methods[:turn]:
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
