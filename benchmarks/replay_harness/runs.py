"""Training runs: one method on one seed of a testbed (`train_one`), measured on held-out problems every `eval_every`
steps by a callback (`_Recorder`) that counts the fresh rollouts consumed, and the record of where and how the run was
made (`run_record`); and the check that TRL's own `GRPOTrainer` gives the `grpo` run (`compare_with_trl`)."""

from __future__ import annotations

import copy
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

from .presets import PRESETS
from .results_file import GUIDE_SERIES, REPLAY_SERIES, SPLIT_SERIES, SPREAD_SERIES, TEACH_SERIES, rows_per_step

# Every run's settings beside the testbed's and the method's (left out of the settings a run records).
COMMON = dict(use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True)


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
