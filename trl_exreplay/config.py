"""`ExReplayGRPOConfig`: TRL's `GRPOConfig` plus the experience-replay fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from . import compat  # noqa: F401 - refuses a TRL outside the supported range
from .pool.check import SELECT_MODES, STORE_MODES  # one list of each, shared with saved pools' checks

SHAPING_MODES = ("clip", "exgrpo")
BUCKET_WEIGHTINGS = ("uniform", "normal", "linear")


@dataclass
class ExReplayGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`ExReplayGRPOTrainer`]: every [`trl.GRPOConfig`] field plus the experience-replay fields below
    (ExGRPO, arXiv 2510.02245; AgentEvolver). With `enable_experience_replay=False` the trainer is `GRPOTrainer`.

    How replay works, in the terms of these fields: after each generation step, a task's difficulty is its number of
    successes (total reward >= `success_threshold`) among its fresh rollouts. Tasks solved by every fresh rollout go to
    a skip set and leave the pool; successful rollouts of tasks with `experience_lbound < successes <
    experience_rbound` enter the pool (at most `max_trajectories_per_task` per task). From `replay_start_ratio` of
    training on, `int(exp_ratio * tasks_per_batch)` groups of each generation batch are pool tasks: each gets
    `num_generations - offpolicy_trajectories_per_task` fresh rollouts plus `offpolicy_trajectories_per_task`
    replayed trajectories in the same GRPO group. Replayed tokens are trained with their recorded log-probs as the
    behaviour policy.

    Example:

    ```python
    from trl_exreplay import ExReplayGRPOConfig

    config = ExReplayGRPOConfig(
        output_dir="out",
        num_generations=8,
        exp_ratio=0.5,
        replay_start_ratio=0.35,
        offpolicy_trajectories_per_task=1,
        off_policy_shaping="exgrpo",
    )
    ```
    """

    enable_experience_replay: bool = field(
        default=True,
        metadata={"help": "Turn experience replay on. When False the trainer behaves exactly as `GRPOTrainer`."},
    )
    exp_ratio: float = field(
        default=0.5,
        metadata={
            "help": "Fraction of the tasks of each generation batch drawn from the replay pool once replay has "
            "started (batch size unchanged): int(exp_ratio * groups) of its groups. In [0, 1]; a value > 0 that "
            "replays no group at the configured batch is refused (the error gives the smallest that replays one)."
        },
    )
    replay_start_ratio: float = field(
        default=0.35,
        metadata={
            "help": "Fraction of total training steps after which replay starts; before it the pool only fills. "
            "In [0, 1]."
        },
    )
    offpolicy_trajectories_per_task: int = field(
        default=1,
        metadata={
            "help": "k: replayed trajectories per replay task; the task's group gets num_generations - k fresh "
            "rollouts. 1 <= k < num_generations."
        },
    )
    max_trajectories_per_task: int = field(
        default=5,
        metadata={"help": "Capacity of the pool per task; beyond it a trajectory is evicted (see exp_select_mode)."},
    )
    experience_lbound: int = field(
        default=0,
        metadata={
            "help": "A task's successes s must satisfy experience_lbound < s < experience_rbound to enter the pool."
        },
    )
    experience_rbound: int | None = field(
        default=None,
        metadata={"help": "Upper (exclusive) bound on successes for entering the pool. None means num_generations."},
    )
    success_threshold: float = field(
        default=1.0,
        metadata={"help": "A rollout is a success when its total (weighted) reward is >= this value."},
    )
    exp_select_mode: str = field(
        default="argmin",
        metadata={
            "help": "Which stored trajectory to replay, and which to evict at capacity: 'argmin' (lowest entropy), "
            "'argmax' (highest entropy) or 'random' (random replay, FIFO eviction)."
        },
    )
    use_current_policy_entropy: bool = field(
        default=True,
        metadata={
            "help": "Rank candidate trajectories by their entropy under the current policy (one extra no-grad "
            "forward over the candidates, sharded over processes) instead of the entropy saved when stored."
        },
    )
    exp_is_correct: bool = field(
        default=True,
        metadata={
            "help": "Use the recorded behaviour log-probs as the old log-probs of replayed tokens (importance "
            "sampling). When False, the current log-probs are used (ratio 1, plain policy gradient on replay)."
        },
    )
    off_cliprange_high: float = field(
        default=1.0,
        metadata={"help": "Upper clip of the replayed tokens' ratio: clamp(ratio, 1 - epsilon_low, 1 + this). >= 0."},
    )
    off_clip_ratio_c: float = field(
        default=3.0,
        metadata={"help": "Dual-clip constant c bounding the replayed tokens' loss for negative advantages. >= 1."},
    )
    off_policy_shaping: str = field(
        default="clip",
        metadata={
            "help": "Objective on replayed tokens: 'clip' (dual-clip PPO with off_cliprange_high and off_clip_ratio_c) "
            "or 'exgrpo' (-A * w / (w + off_policy_shaping_beta), w the importance ratio, no clip)."
        },
    )
    off_policy_shaping_beta: float = field(
        default=0.1,
        metadata={"help": "beta of the 'exgrpo' shaping w / (w + beta). > 0."},
    )
    replay_bucket_weighting: str = field(
        default="uniform",
        metadata={
            "help": "How replay tasks are drawn over difficulty buckets: 'uniform' (every pool task alike), "
            "'normal' (buckets weighted by a Gaussian around num_generations / 2, as ExGRPO), 'linear' (bucket "
            "weight grows linearly as tasks get harder, i.e. fewer successes)."
        },
    )
    max_policy_age: int | None = field(
        default=None,
        metadata={"help": "Replay only trajectories generated at most this many optimizer steps ago. None: no limit."},
    )
    replay_window: int | None = field(
        default=None,
        metadata={
            "help": "Replay only among the N most recently stored trajectories of the pool (RLinf's sample window; "
            "evicted ones still count in the N). None: the whole pool."
        },
    )
    task_id_column: str = field(
        default="task_id",
        metadata={
            "help": "Dataset column that identifies a task. Rows without it are keyed by a stable hash of the prompt."
        },
    )
    pool_store_mode: str = field(
        default="all",
        metadata={
            "help": "'all': store every success of a qualifying task; 'best': only its best one by entropy "
            "(per exp_select_mode)."
        },
    )

    # ---- multi-turn rollouts (used when the trainer gets an `text_env_factory`)
    max_turns: int = field(
        default=10,
        metadata={"help": "Multi-turn: model turns per episode at most (the episode then ends unsuccessful)."},
    )
    max_tokens_per_turn: int | None = field(
        default=None,
        metadata={"help": "Multi-turn: tokens of one model turn at most. None: max_completion_length."},
    )
    env_step_timeout: float | None = field(
        default=60.0,
        metadata={
            "help": "Multi-turn: seconds an environment reset or step may take; a slower one ends its episode as a "
            "failure (counted in env/errors). None: no limit."
        },
    )
    env_workers: int = field(
        default=16,
        metadata={
            "help": "Multi-turn: environment calls running at once (threads), so a slow one does not serialise."
        },
    )
    resume_without_pool: bool = field(
        default=False,
        metadata={
            "help": "Resume from a checkpoint that holds no saved experience pool (`exreplay_pool/`) with an empty pool "
            "on purpose. Otherwise such a resume still starts empty but warns loudly: the checkpoint was expected to "
            "hold the pool the run had built."
        },
    )
    system_prompt_column: str = field(
        default="system_prompt",
        metadata={"help": "Multi-turn: dataset column with an optional system prompt for the episode."},
    )

    def __post_init__(self):
        super().__post_init__()
        validate_replay_options(replay_options(self), self.num_generations)


def replay_options(args: Any) -> dict[str, Any]:
    """The replay fields of `args`; a plain `GRPOConfig` gets the defaults of `ExReplayGRPOConfig`."""
    options = {}
    for f in fields(ExReplayGRPOConfig):
        if f.name in _REPLAY_FIELD_NAMES:
            options[f.name] = getattr(args, f.name, f.default)
    return options


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a config


def _check(condition: bool, name: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ValueError(f"Invalid value {value!r} for `{name}`: allowed values are {allowed}.")


def validate_replay_options(
    options: dict[str, Any], num_generations: int | None, generation_batch_size: int | None = None
) -> None:
    """Raise `ValueError` naming the field, its value and its allowed values for the first invalid replay option.

    Given `num_generations` and the global `generation_batch_size`, also refuses an `exp_ratio` that would replay no
    task of a generation batch (``int(exp_ratio * groups) == 0`` with ``exp_ratio > 0``).
    """
    o = options
    for name in ("enable_experience_replay", "use_current_policy_entropy", "exp_is_correct", "resume_without_pool"):
        _check(isinstance(o[name], bool), name, o[name], "True or False (a bool, not a string)")
    for name in ("exp_ratio", "replay_start_ratio"):
        value = o[name]
        _check(
            isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0,
            name,
            value,
            "numbers in [0, 1]",
        )
    groups = generation_batch_size // num_generations if generation_batch_size and num_generations else None
    ratio = o["exp_ratio"]
    if o["enable_experience_replay"] and groups and ratio > 0 and int(ratio * groups) == 0:
        raise ValueError(
            f"Invalid value {ratio!r} for `exp_ratio`: a generation batch holds {groups} task group(s) "
            f"(generation_batch_size {generation_batch_size} / num_generations {num_generations}), and "
            f"int(exp_ratio * {groups}) = 0, so no task would ever be replayed. The smallest exp_ratio that replays one "
            f"is {1 / groups:g}; or give each generation batch more groups (steps_per_generation, "
            "per_device_train_batch_size or more processes), or set exp_ratio=0 to fill the pool without replaying."
        )
    k = o["offpolicy_trajectories_per_task"]
    upper = f"num_generations - 1 = {num_generations - 1}" if num_generations else "num_generations - 1"
    _check(_is_int(k) and k >= 1, "offpolicy_trajectories_per_task", k, f"integers 1 .. {upper}")
    if num_generations is not None:
        _check(k < num_generations, "offpolicy_trajectories_per_task", k, f"integers 1 .. {upper}")
    cap = o["max_trajectories_per_task"]
    _check(
        _is_int(cap) and cap >= k,
        "max_trajectories_per_task",
        cap,
        f"integers >= offpolicy_trajectories_per_task ({k})",
    )
    lbound = o["experience_lbound"]
    _check(_is_int(lbound) and lbound >= 0, "experience_lbound", lbound, "integers >= 0")
    rbound = o["experience_rbound"]
    effective_rbound = num_generations if rbound is None else rbound
    if rbound is not None:
        _check(_is_int(rbound) and rbound >= 1, "experience_rbound", rbound, "None or an integer > experience_lbound")
    if effective_rbound is not None:
        _check(
            lbound < effective_rbound,
            "experience_lbound",
            lbound,
            f"integers below experience_rbound ({effective_rbound}; lbound < successes < rbound must be satisfiable)",
        )
        # A task's trajectories are stored when lbound < s < rbound, s its successes among its fresh rollouts;
        # s = 0 stores nothing and s = num_generations sends the task to the skip set, so 1 <= s <= G - 1.
        lowest = max(lbound + 1, 1)
        highest = effective_rbound - 1 if num_generations is None else min(effective_rbound, num_generations) - 1
        if lowest > highest:
            name, value = ("experience_rbound", rbound) if rbound is not None else ("experience_lbound", lbound)
            raise ValueError(
                f"Invalid value {value!r} for `{name}`: no task can enter the pool, since its successes s must satisfy "
                f"experience_lbound ({lbound}) < s < experience_rbound ({effective_rbound}) and 1 <= s <= "
                f"num_generations - 1; allowed values make that range non-empty (experience_rbound >= "
                f"experience_lbound + 2, experience_lbound <= num_generations - 2)."
            )
    threshold = o["success_threshold"]
    _check(
        isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and math.isfinite(threshold),
        "success_threshold",
        threshold,
        "finite numbers",
    )
    _check(o["exp_select_mode"] in SELECT_MODES, "exp_select_mode", o["exp_select_mode"], _names(SELECT_MODES))
    _check(
        o["off_policy_shaping"] in SHAPING_MODES, "off_policy_shaping", o["off_policy_shaping"], _names(SHAPING_MODES)
    )
    _check(
        o["replay_bucket_weighting"] in BUCKET_WEIGHTINGS,
        "replay_bucket_weighting",
        o["replay_bucket_weighting"],
        _names(BUCKET_WEIGHTINGS),
    )
    _check(o["pool_store_mode"] in STORE_MODES, "pool_store_mode", o["pool_store_mode"], _names(STORE_MODES))
    _check(o["off_cliprange_high"] >= 0, "off_cliprange_high", o["off_cliprange_high"], "numbers >= 0")
    _check(o["off_clip_ratio_c"] >= 1, "off_clip_ratio_c", o["off_clip_ratio_c"], "numbers >= 1")
    _check(o["off_policy_shaping_beta"] > 0, "off_policy_shaping_beta", o["off_policy_shaping_beta"], "numbers > 0")
    age = o["max_policy_age"]
    _check(age is None or (_is_int(age) and age >= 0), "max_policy_age", age, "None or integers >= 0")
    window = o["replay_window"]
    _check(
        window is None or (_is_int(window) and window >= 1),
        "replay_window",
        window,
        "None or integers >= 1",
    )
    column = o["task_id_column"]
    _check(isinstance(column, str) and column != "", "task_id_column", column, "a non-empty column name")
    _check(_is_int(o["max_turns"]) and o["max_turns"] >= 1, "max_turns", o["max_turns"], "integers >= 1")
    per_turn = o["max_tokens_per_turn"]
    _check(per_turn is None or (_is_int(per_turn) and per_turn >= 1), "max_tokens_per_turn", per_turn,
           "None or integers >= 1")  # fmt: skip
    timeout = o["env_step_timeout"]
    _check(timeout is None or timeout > 0, "env_step_timeout", timeout, "None or numbers > 0")
    workers = o["env_workers"]
    _check(_is_int(workers) and workers >= 1, "env_workers", workers, "integers >= 1")


def _names(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values)


_REPLAY_FIELD_NAMES = frozenset(
    name for name in ExReplayGRPOConfig.__dataclass_fields__ if name not in GRPOConfig.__dataclass_fields__
)
