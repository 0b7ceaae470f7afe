"""`ExReplayGRPOConfig`: TRL's `GRPOConfig` plus the experience-replay fields."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

from trl import GRPOConfig

from . import compat  # noqa: F401 - refuses a TRL outside the supported range
from .guidance.allocation import ROLLOUT_MODES, SAMPLE_MODES
from .guidance.reme import MAX_TIMEOUT
from .pool.check import SELECT_MODES, STORE_MODES  # one list of each, shared with saved pools' checks
from .untrusted_text import SPECIAL_TOKEN_MODES

logger = logging.getLogger(__name__)

SHAPING_MODES = ("clip", "exgrpo")
BUCKET_WEIGHTINGS = ("uniform", "normal", "linear")


@dataclass
class ExReplayGRPOConfig(GRPOConfig):
    r"""
    Configuration for [`ExReplayGRPOTrainer`]: every [`trl.GRPOConfig`] field plus the experience-replay fields below
    (ExGRPO, arXiv 2510.02245; AgentEvolver). With `enable_experience_replay=False` the trainer is `GRPOTrainer`.

    How replay works, in the terms of these fields: after each generation step, a task's difficulty is its number of
    successes (total reward >= `replay_success_threshold`) among its fresh rollouts. Tasks solved by every fresh rollout go to
    a skip set and leave the pool; successful rollouts of tasks with `replay_store_lbound < successes <
    replay_store_rbound` enter the pool (at most `replay_max_trajectories_per_task` per task). From `replay_start_ratio` of
    training on, a share `replay_ratio` of the task groups is drawn from the pool (`replay_ratio * groups` a generation
    batch, rounded down or up so that the share holds over the run): each gets
    `num_generations - replay_trajectories_per_group` fresh rollouts plus `replay_trajectories_per_group`
    replayed trajectories in the same GRPO group. Replayed tokens are trained with their recorded log-probs as the
    behaviour policy.

    Example:

    ```python
    import torch

    from trl_exreplay import ExReplayGRPOConfig

    config = ExReplayGRPOConfig(
        output_dir="out",
        use_cpu=not torch.cuda.is_available(),  # TRL's default bf16 needs a GPU
        num_generations=8,
        gradient_accumulation_steps=4,  # 4 groups of 8 per generation batch, on-policy: replay_ratio 0.5 replays 2
        replay_ratio=0.5,
        replay_start_ratio=0.35,
        replay_trajectories_per_group=1,
        replay_shaping="exgrpo",
    )
    ```
    """

    enable_experience_replay: bool = field(
        default=True,
        metadata={"help": "Turn experience replay on. When False the trainer behaves exactly as `GRPOTrainer`."},
    )
    replay_ratio: float = field(
        default=0.5,
        metadata={
            "help": "Long-run share of task groups drawn from the replay pool once replay has started (batch size "
            "unchanged). Generation batch n (counted over the run) replays floor(r*g*(n+1)) - floor(r*g*n) of its g "
            "groups: r*g in every batch when that is a whole number, else alternately fewer and more, so that a batch "
            "of one group at 0.5 replays every second batch. In [0, 1]."
        },
    )
    replay_profile: str | None = field(
        default=None,
        metadata={
            "help": "The recipe that gives the fields left unset (None) their values: None, the library's defaults "
            "(the value after 'None:' in each field's help: every group teaching, i.e. all-fail groups rescued and "
            "solved questions retired with revisits), or 'exgrpo', ExGRPO's published code (replay_start='solved', "
            "replay_retire_solved without revisits, replay_count_replayed_successes, replay_unclipped_fresh, "
            "replay_bucket_weighting='normal', replay_shaping='exgrpo', no rescue); see Profiles below. A field you set "
            "wins."
        },
    )
    replay_start: str | None = field(
        default=None,
        metadata={
            "help": "When replay starts: 'steps' (at replay_start_ratio of max_steps; the pool fills from the first "
            "step) or 'solved' (ExGRPO: replay and the pool's collection start at the "
            "first generation batch whose fresh rollouts succeed more often than replay_start_solved_fraction, "
            "and stay on). None: the profile's; 'steps' without one."
        },
    )
    replay_start_ratio: float = field(
        default=0.35,
        metadata={
            "help": "replay_start='steps': fraction of total training steps after which replay starts; before it the "
            "pool only fills. In [0, 1]."
        },
    )
    replay_start_solved_fraction: float = field(
        default=0.35,
        metadata={
            "help": "replay_start='solved': replay starts once a generation batch's fresh rollouts succeed (total "
            "reward >= replay_success_threshold) strictly more often than this. In [0, 1)."
        },
    )
    replay_retire_solved: bool | None = field(
        default=None,
        metadata={
            "help": "Retired questions leave the fresh stream (ExGRPO): from the next generation batch on, a "
            "skip-set task (solved by every fresh rollout) gets no fresh rollout again: its groups take other dataset "
            "rows, so every batch keeps its size. A map-style dataset only (an iterable one trains without it, "
            "with a warning). None: the profile's; True without one."
        },
    )
    replay_revisit_ratio: float | None = field(
        default=None,
        metadata={
            "help": "With replay_retire_solved: the share of a retired question's draws let through as revisits (drawn "
            "per group from the step's seed, the same on every rank); a revisit that any fresh rollout fails puts the "
            "question back in the fresh stream, so a solved question that is forgotten is trained again. 0: retired "
            "questions never return (ExGRPO). In [0, 1]. None: the profile's; 0.5 without one (0 when retirement is off)."
        },
    )
    replay_rescue: int | None = field(
        default=None,
        metadata={
            "help": "Rescue (AR3PO's response reuse): after scoring, a fresh group whose rollouts all failed, of a task "
            "the pool holds this many successes of, gets that many of its failed rollouts replaced by them (chosen by "
            "replay_select_mode on their saved entropies), trained as replayed rows, so that the group has a reward "
            "spread to learn from; from the first step the pool holds one, whatever replay_start. With rescue on, a "
            "task solved by every fresh rollout keeps this many of its best successes (it is not replayed while "
            "solved), so that a forgotten task can be rescued. A rescued row's reference log-probs would be those of "
            "the failed rollout, so with beta != 0 rescue is off (one warning). 0: off; below num_generations. None: "
            "the profile's; 1 without one."
        },
    )
    replay_count_replayed_successes: bool | None = field(
        default=None,
        metadata={
            "help": "A replayed task's difficulty counts its replayed trajectories' successes with its fresh ones "
            "((s + k) of num_generations, as ExGRPO); False: its fresh rollouts' alone (s of num_generations - k). "
            "None: the profile's; False without one."
        },
    )
    replay_unclipped_fresh: bool | None = field(
        default=None,
        metadata={
            "help": "Once replay has started, train fresh tokens without the PPO clip (TRL's epsilon and "
            "epsilon_high ignored; ExGRPO's loss_remove_clip). Changes anything only where the ratio can leave 1: "
            "num_iterations > 1, or steps_per_generation > gradient_accumulation_steps. None: the profile's; False "
            "without one."
        },
    )
    replay_trajectories_per_group: int = field(
        default=1,
        metadata={
            "help": "k: replayed trajectories per replay task; the task's group gets num_generations - k fresh "
            "rollouts. 1 <= k < num_generations."
        },
    )
    replay_max_trajectories_per_task: int = field(
        default=5,
        metadata={
            "help": "Capacity of the pool per task; beyond it a trajectory is evicted (see replay_select_mode)."
        },
    )
    replay_store_lbound: int = field(
        default=0,
        metadata={
            "help": "A task's successes s must satisfy replay_store_lbound < s < replay_store_rbound to enter the pool."
        },
    )
    replay_store_rbound: int | None = field(
        default=None,
        metadata={"help": "Upper (exclusive) bound on successes for entering the pool. None means num_generations."},
    )
    replay_success_threshold: float = field(
        default=1.0,
        metadata={"help": "A rollout is a success when its total (weighted) reward is >= this value."},
    )
    replay_select_mode: str = field(
        default="argmin",
        metadata={
            "help": "Which stored trajectory to replay, and which to evict at capacity: 'argmin' (lowest entropy), "
            "'argmax' (highest entropy) or 'random' (random replay, FIFO eviction)."
        },
    )
    replay_select_by_current_entropy: bool = field(
        default=True,
        metadata={
            "help": "Rank candidate trajectories by their entropy under the current policy (one extra no-grad "
            "forward over the candidates, sharded over processes) instead of the entropy saved when stored."
        },
    )
    replay_importance_sampling: bool = field(
        default=True,
        metadata={
            "help": "Use the recorded behaviour log-probs as the old log-probs of replayed tokens (importance "
            "sampling). When False, the current log-probs are used (ratio 1, plain policy gradient on replay)."
        },
    )
    replay_clip_high: float = field(
        default=1.0,
        metadata={"help": "Upper clip of the replayed tokens' ratio: clamp(ratio, 1 - epsilon_low, 1 + this). >= 0."},
    )
    replay_dual_clip_c: float = field(
        default=3.0,
        metadata={"help": "Dual-clip constant c bounding the replayed tokens' loss for negative advantages. >= 1."},
    )
    replay_shaping: str | None = field(
        default=None,
        metadata={
            "help": "Objective on replayed tokens: 'clip' (dual-clip PPO with replay_clip_high and replay_dual_clip_c) "
            "or 'exgrpo' (-A * w / (w + replay_shaping_beta), w the importance ratio, no clip). None: the profile's; "
            "'clip' without one."
        },
    )
    replay_shaping_beta: float = field(
        default=0.1,
        metadata={"help": "beta of the 'exgrpo' shaping w / (w + beta). > 0."},
    )
    replay_bucket_weighting: str | None = field(
        default=None,
        metadata={
            "help": "How replay tasks are drawn over difficulty buckets: 'uniform' (every pool task alike), "
            "'normal' (bucket of k successes weighted exp(-(k - num_generations/2)^2 / 2), ExGRPO's Gaussian), 'linear' (bucket "
            "weight grows linearly as tasks get harder, i.e. fewer successes). None: the profile's; 'uniform' without "
            "one."
        },
    )
    replay_max_policy_age: int | None = field(
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
    replay_store_mode: str = field(
        default="all",
        metadata={
            "help": "'all': store every success of a qualifying task; 'best': only its best one by entropy "
            "(per replay_select_mode)."
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
    env_special_tokens: str = field(
        default="remove",
        metadata={
            "help": "Multi-turn: what an observation's spellings of the tokenizer's special or added tokens (`<eos>`, "
            "a role marker) become before it is tokenized, on every backend: 'remove' them (counted in "
            "env/special_tokens_removed), 'refuse' the episode (a counted environment fault: env/errors), or 'keep' "
            "them (a trusted environment that needs them). An environment's text is untrusted: a spelled token "
            "would put a chat turn or an end of sequence it wrote into every rollout and every replayed trajectory."
        },
    )
    tool_special_tokens: str = field(
        default="keep",
        metadata={
            "help": "TRL's tool loop (`tools`, `environment_factory`): 'remove' the spellings of the tokenizer's "
            "special or added tokens from tool results and from `reset()` observations before TRL tokenizes them "
            "(counted in env/special_tokens_removed), or 'keep' them as TRL does (the default: the trainer stays "
            "GRPOTrainer exactly). Turn it on when tools or environments return text from elsewhere (web pages, "
            "files, other people's games)."
        },
    )
    replay_resume_without_pool: bool = field(
        default=False,
        metadata={
            "help": "Resume from a checkpoint that holds no saved experience pool (`exreplay_pool/`) with an empty pool "
            "on purpose. Otherwise such a resume still starts empty but warns loudly: the checkpoint was expected to "
            "hold the pool the run had built."
        },
    )
    replay_scratch_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder where the live pool writes its shards (rank 0 alone holds them, in a subfolder of its own "
            "removed at the end; one a killed run left is removed by the next run that uses the folder). None: "
            "`output_dir/_exreplay_pool_work`. Point it at a local disk of each machine when `output_dir` is on a "
            "network filesystem; checkpoint saves hard-link the shards when both folders are on one filesystem and "
            "copy them otherwise."
        },
    )
    system_prompt_column: str = field(
        default="system_prompt",
        metadata={"help": "Multi-turn: dataset column with an optional system prompt for the episode."},
    )

    # ---- experience-guided rollouts (AgentEvolver's Self-Navigating, arXiv 2511.10395; modelscope/AgentEvolver,
    # docs/guidelines/exp_manager.md): off unless a rollout mode guides
    guidance_train: str = field(
        default="off",
        metadata={
            "help": "Experience in training rollouts: 'off' (none: the feature is off), 'mixed' (round(num_generations "
            "* guidance_ratio) of each task's rollouts get retrieved experience in their first user message) or "
            "'all' (every fresh rollout). Replayed rows are never guided."
        },
    )
    guidance_eval: str = field(
        default="off",
        metadata={"help": "Experience in evaluation rollouts: 'off', 'mixed' or 'all', as guidance_train."},
    )
    guidance_ratio: float = field(
        default=0.0,
        metadata={
            "help": "Fraction of a task's rollouts guided under 'mixed': round(num_generations * guidance_ratio) of "
            "them. In [0, 1]; with a 'mixed' mode it must guide at least one rollout."
        },
    )
    guidance_trained_prompt: str = field(
        default="plain",
        metadata={
            "help": "What a guided rollout trains on: 'guided' (its guided prompt, on-policy), 'plain' (the "
            "prompt without the experience, token-exact; its tokens are trained off-policy against the log-probs "
            "recorded under guidance, as replayed tokens are) or 'hybrid' (int(tasks * guidance_keep_ratio) of a "
            "batch's tasks keep, the others discard)."
        },
    )
    guidance_keep_ratio: float = field(
        default=1.0,
        metadata={"help": "Fraction of a batch's tasks that keep their guidance under 'hybrid'. In [0, 1]."},
    )
    guidance_template: str = field(
        default="\n\nSome Related Experience to help you to complete the task:<EXP>{}</EXP>\n\n",
        metadata={
            "help": "Text put before the first user message of a guided rollout; its one `{}` receives the retrieved "
            "experience (records joined by newlines). Must contain `{}` exactly once."
        },
    )
    guidance_top_k: int = field(
        default=3,
        metadata={"help": "Experience records retrieved per guided rollout at most. >= 1."},
    )
    guidance_max_tokens: int = field(
        default=512,
        metadata={
            "help": "Tokens of retrieved experience put in one prompt at most (the records joined, before the template); "
            "the rest is cut (counted in guide/experience_truncated). It is cut further where the guided prompt would "
            "leave less than max_completion_length tokens of the model's context (guide/experience_cut_to_context; "
            "a row with no room for any is left unguided, guide/unguided_for_context). Retrieved text is untrusted: "
            "any spelling of a special or added token in it is removed (counted in guide/special_tokens_removed). "
            ">= 1."
        },
    )
    guidance_update_freq: int = field(
        default=0,
        metadata={
            "help": "Every this many optimizer steps, the successful fresh rollouts gathered since the last update are "
            "summarised into experience in a background thread (never blocking a step). 0: never (the store holds "
            "what guidance_init_from_pool or a resumed checkpoint gave it). >= 0."
        },
    )
    guidance_init_from_pool: bool = field(
        default=False,
        metadata={
            "help": "Before the first step, summarise the successful trajectories of the experience pool the trainer "
            "starts with (a given `experience_pool`), so that the first guided rollouts have experience to retrieve."
        },
    )
    guidance_provider: str = field(
        default="offline",
        metadata={
            "help": "Where experience is summarised and retrieved: 'offline' (in-process: records made from successful "
            "rollouts' actions, BM25 retrieval over task texts, saved with every checkpoint) or 'reme' (a ReMe "
            "service at guidance_base_url). A provider object passed to the trainer as `experience_provider` wins."
        },
    )
    guidance_base_url: str | None = field(
        default=None,
        metadata={"help": "The ReMe service's URL, e.g. http://127.0.0.1:8001 (guidance_provider='reme')."},
    )
    guidance_timeout: float = field(
        default=10.0,
        metadata={
            "help": "Seconds a ReMe request may take in all (connect, send, the whole reply); a retrieval past it "
            "leaves its rollout unguided (counted in guide/retrieve_failures). In (0, 86400]."
        },
    )
    guidance_workspace_id: str = field(
        default="default",
        metadata={"help": "The ReMe workspace that holds this run's experience (guidance_provider='reme')."},
    )

    def __post_init__(self):
        current = {name: getattr(self, name) for name in PROFILE_FIELDS}
        for name, value in profile_values(self.replay_profile, current).items():
            setattr(self, name, value)  # read back as it trains, not None
        super().__post_init__()
        validate_replay_options(replay_options(self), self.num_generations)


# The fields whose value, left None, comes from `replay_profile`: the library's defaults (no profile), and
# ExGRPO's published recipe (its code, ElliottYan/LUFFY, folder ExGRPO), where it differs; docs/config.md tabulates both.
# ExGRPO's pool bounds (lbound < s <= rbound with 0 and G-1) are ours with the default replay_store_rbound (s < G), and
# it too selects the lowest entropy under the current policy, replays half the questions, k = 1, beta 0.1.
# The defaults make every group teach (rescue, retirement with revisits at 0.5): the pre-registered test of issue 55
# made them the defaults by its decision rule (docs/results.md, "Every group teaches: the results"). The defaults
# before it (the `exreplay` arm of every earlier test) are replay_rescue=0, replay_retire_solved=False.
PROFILE_FIELDS: dict[str, Any] = {
    "replay_start": "steps",
    "replay_retire_solved": True,
    "replay_revisit_ratio": 0.5,  # chosen on tuning seeds 50-54 (docs/results.md)
    "replay_rescue": 1,
    "replay_count_replayed_successes": False,
    "replay_unclipped_fresh": False,
    "replay_bucket_weighting": "uniform",
    "replay_shaping": "clip",
}
REPLAY_PROFILES: dict[str, dict[str, Any]] = {
    "exgrpo": {
        "replay_start": "solved",
        "replay_retire_solved": True,
        "replay_revisit_ratio": 0.0,  # a retired question is never drawn again
        "replay_rescue": 0,
        "replay_count_replayed_successes": True,
        "replay_unclipped_fresh": True,
        "replay_bucket_weighting": "normal",
        "replay_shaping": "exgrpo",
    },
}


def profile_values(profile: str | None, values: dict[str, Any]) -> dict[str, Any]:
    """`values` of the `PROFILE_FIELDS`, each one left None given `profile`'s value (the library's defaults without a
    profile). An unknown profile is left to `validate_replay_options`."""
    recipe = REPLAY_PROFILES.get(profile, {})
    resolved = {name: recipe.get(name, design) if values.get(name) is None else values[name]
                for name, design in PROFILE_FIELDS.items()}  # fmt: skip
    if values.get("replay_revisit_ratio") is None and not resolved["replay_retire_solved"]:
        resolved["replay_revisit_ratio"] = 0.0  # a profile's revisits go with its retirement, which you turned off
    return resolved


REPLAY_STARTS = ("steps", "solved")
# TRL's tool loop has no episode a spelled token could refuse (a tool result is not an environment fault there).
TOOL_SPECIAL_TOKEN_MODES = ("keep", "remove")
EXPERIENCE_PROVIDERS = ("offline", "reme")


def replay_options(args: Any) -> dict[str, Any]:
    """The replay fields of `args`; a plain `GRPOConfig` gets the defaults of `ExReplayGRPOConfig`."""
    options = {}
    for f in fields(ExReplayGRPOConfig):
        if f.name in _REPLAY_FIELD_NAMES:
            options[f.name] = getattr(args, f.name, f.default)
    options.update(profile_values(options["replay_profile"], options))
    return options


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a config


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(condition: bool, name: str, value: Any, allowed: str) -> None:
    if not condition:
        raise ValueError(f"Invalid value {value!r} for `{name}`: allowed values are {allowed}.")


def validate_replay_options(options: dict[str, Any], num_generations: int | None) -> None:
    """Raise `ValueError` naming the field, its value and its allowed values for the first invalid replay option."""
    o = options
    for name in (
        "enable_experience_replay",
        "replay_select_by_current_entropy",
        "replay_importance_sampling",
        "replay_resume_without_pool",
        "replay_retire_solved",
        "replay_count_replayed_successes",
        "replay_unclipped_fresh",
    ):
        _check(isinstance(o[name], bool), name, o[name], "True or False (a bool, not a string)")
    revisit = o["replay_revisit_ratio"]
    _check(_is_number(revisit) and 0.0 <= revisit <= 1.0, "replay_revisit_ratio", revisit, "numbers in [0, 1]")
    if revisit > 0 and not o["replay_retire_solved"]:
        raise ValueError(
            f"Invalid value {revisit!r} for `replay_revisit_ratio`: it revisits retired questions, and "
            "replay_retire_solved=False retires none; allowed: 0, or set replay_retire_solved=True."
        )
    rescue = o["replay_rescue"]
    upper = "num_generations - 1" if num_generations is None else f"num_generations - 1 = {num_generations - 1}"
    _check(_is_int(rescue) and 0 <= rescue and (num_generations is None or rescue < num_generations), "replay_rescue",
           rescue, f"integers 0 .. {upper}")  # fmt: skip
    profile = o["replay_profile"]
    _check(profile is None or profile in REPLAY_PROFILES, "replay_profile", profile,
           "None, " + ", ".join(map(repr, REPLAY_PROFILES)))  # fmt: skip
    _check(o["replay_start"] in REPLAY_STARTS, "replay_start", o["replay_start"], ", ".join(map(repr, REPLAY_STARTS)))
    solved = o["replay_start_solved_fraction"]
    _check(_is_number(solved) and 0.0 <= solved < 1.0, "replay_start_solved_fraction", solved, "numbers in [0, 1)")
    scratch = o.get("replay_scratch_dir")
    _check(scratch is None or (isinstance(scratch, str) and scratch.strip() != ""), "replay_scratch_dir", scratch,
           "None or a folder's path")  # fmt: skip
    for name in ("replay_ratio", "replay_start_ratio"):
        value = o[name]
        _check(
            _is_number(value) and 0.0 <= value <= 1.0,
            name,
            value,
            "numbers in [0, 1]",
        )
    k = o["replay_trajectories_per_group"]
    upper = f"num_generations - 1 = {num_generations - 1}" if num_generations else "num_generations - 1"
    _check(_is_int(k) and k >= 1, "replay_trajectories_per_group", k, f"integers 1 .. {upper}")
    if num_generations is not None:
        _check(k < num_generations, "replay_trajectories_per_group", k, f"integers 1 .. {upper}")
    cap = o["replay_max_trajectories_per_task"]
    _check(
        _is_int(cap) and cap >= k,
        "replay_max_trajectories_per_task",
        cap,
        f"integers >= replay_trajectories_per_group ({k})",
    )
    lbound = o["replay_store_lbound"]
    _check(_is_int(lbound) and lbound >= 0, "replay_store_lbound", lbound, "integers >= 0")
    rbound = o["replay_store_rbound"]
    effective_rbound = num_generations if rbound is None else rbound
    if rbound is not None:
        _check(
            _is_int(rbound) and rbound >= 1, "replay_store_rbound", rbound, "None or an integer > replay_store_lbound"
        )
    if effective_rbound is not None:
        _check(
            lbound < effective_rbound,
            "replay_store_lbound",
            lbound,
            f"integers below replay_store_rbound ({effective_rbound}; lbound < successes < rbound must be satisfiable)",
        )
        # A task's trajectories are stored when lbound < s < rbound, s its successes among its fresh rollouts;
        # s = 0 stores nothing and s = num_generations sends the task to the skip set, so 1 <= s <= G - 1.
        lowest = max(lbound + 1, 1)
        highest = effective_rbound - 1 if num_generations is None else min(effective_rbound, num_generations) - 1
        if lowest > highest:
            name, value = ("replay_store_rbound", rbound) if rbound is not None else ("replay_store_lbound", lbound)
            raise ValueError(
                f"Invalid value {value!r} for `{name}`: no task can enter the pool, since its successes s must satisfy "
                f"replay_store_lbound ({lbound}) < s < replay_store_rbound ({effective_rbound}) and 1 <= s <= "
                f"num_generations - 1; allowed values make that range non-empty (replay_store_rbound >= "
                f"replay_store_lbound + 2, replay_store_lbound <= num_generations - 2)."
            )
    threshold = o["replay_success_threshold"]
    _check(
        _is_number(threshold) and math.isfinite(threshold),
        "replay_success_threshold",
        threshold,
        "finite numbers",
    )
    _check(
        o["replay_select_mode"] in SELECT_MODES, "replay_select_mode", o["replay_select_mode"], _names(SELECT_MODES)
    )
    _check(o["replay_shaping"] in SHAPING_MODES, "replay_shaping", o["replay_shaping"], _names(SHAPING_MODES))
    _check(
        o["replay_bucket_weighting"] in BUCKET_WEIGHTINGS,
        "replay_bucket_weighting",
        o["replay_bucket_weighting"],
        _names(BUCKET_WEIGHTINGS),
    )
    _check(o["replay_store_mode"] in STORE_MODES, "replay_store_mode", o["replay_store_mode"], _names(STORE_MODES))
    _check(o["replay_clip_high"] >= 0, "replay_clip_high", o["replay_clip_high"], "numbers >= 0")
    _check(o["replay_dual_clip_c"] >= 1, "replay_dual_clip_c", o["replay_dual_clip_c"], "numbers >= 1")
    _check(o["replay_shaping_beta"] > 0, "replay_shaping_beta", o["replay_shaping_beta"], "numbers > 0")
    age = o["replay_max_policy_age"]
    _check(age is None or (_is_int(age) and age >= 0), "replay_max_policy_age", age, "None or integers >= 0")
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
    # .get: options made by hand before these fields existed take the defaults
    env_tokens = o.get("env_special_tokens", "remove")
    _check(env_tokens in SPECIAL_TOKEN_MODES, "env_special_tokens", env_tokens, _names(SPECIAL_TOKEN_MODES))
    tool_tokens = o.get("tool_special_tokens", "keep")
    allowed = _names(TOOL_SPECIAL_TOKEN_MODES)
    _check(tool_tokens in TOOL_SPECIAL_TOKEN_MODES, "tool_special_tokens", tool_tokens, allowed)
    validate_guidance_options(o, num_generations)


def validate_guidance_options(o: dict[str, Any], num_generations: int | None) -> None:
    """The experience-guided rollouts' fields (AgentEvolver's Self-Navigating); errors name the field and its allowed
    values. A field missing from `o` (options made by hand, before these fields existed) takes its default."""
    o = {**{f.name: f.default for f in fields(ExReplayGRPOConfig) if f.name in _GUIDANCE_FIELDS}, **o}
    for name in ("guidance_train", "guidance_eval"):
        _check(o[name] in ROLLOUT_MODES, name, o[name], _names(ROLLOUT_MODES))
    mode = o["guidance_trained_prompt"]
    _check(mode in SAMPLE_MODES, "guidance_trained_prompt", mode, _names(SAMPLE_MODES))
    for name in ("guidance_ratio", "guidance_keep_ratio"):
        value = o[name]
        _check(
            _is_number(value) and 0.0 <= value <= 1.0,
            name,
            value,
            "numbers in [0, 1]",
        )
    mixed = [name for name in ("guidance_train", "guidance_eval") if o[name] == "mixed"]
    if mixed and num_generations and round(num_generations * o["guidance_ratio"]) == 0:
        raise ValueError(
            f"Invalid value {o['guidance_ratio']!r} for `guidance_ratio`: with {mixed[0]}='mixed', "
            f"round(num_generations * guidance_ratio) = round({num_generations} * {o['guidance_ratio']}) = 0 "
            "rollouts would be guided; allowed values guide at least one (guidance_ratio > "
            f"{0.5 / num_generations:g}, since round() halves to even), or set {mixed[0]}='off'."
        )
    template = o["guidance_template"]
    _check(
        isinstance(template, str) and template.count("{}") == 1,
        "guidance_template",
        template,
        "strings that contain `{}` exactly once (where the retrieved experience goes)",
    )
    k = o["guidance_top_k"]
    _check(_is_int(k) and k >= 1, "guidance_top_k", k, "integers >= 1")
    budget = o["guidance_max_tokens"]
    _check(_is_int(budget) and budget >= 1, "guidance_max_tokens", budget, "integers >= 1")
    freq = o["guidance_update_freq"]
    _check(_is_int(freq) and freq >= 0, "guidance_update_freq", freq, "integers >= 0 (0: no updates)")
    init = o["guidance_init_from_pool"]
    _check(isinstance(init, bool), "guidance_init_from_pool", init, "True or False (a bool, not a string)")
    provider = o["guidance_provider"]
    _check(provider in EXPERIENCE_PROVIDERS, "guidance_provider", provider, _names(EXPERIENCE_PROVIDERS))
    url = o["guidance_base_url"]
    _check(
        url is None or (isinstance(url, str) and url.split("://", 1)[0] in ("http", "https") and "://" in url),
        "guidance_base_url",
        url,
        "None or an http:// or https:// URL",
    )
    guided = o["guidance_train"] != "off" or o["guidance_eval"] != "off"
    if guided and provider == "reme" and url is None:
        raise ValueError(
            "Invalid value None for `guidance_base_url`: guidance_provider='reme' needs the ReMe service's URL "
            "(allowed values: an http:// or https:// URL, e.g. http://127.0.0.1:8001)."
        )
    timeout = o["guidance_timeout"]
    _check(
        _is_number(timeout) and 0 < timeout <= MAX_TIMEOUT,
        "guidance_timeout",
        timeout,
        f"numbers of seconds in (0, {MAX_TIMEOUT:g}]",
    )
    workspace = o["guidance_workspace_id"]
    _check(isinstance(workspace, str) and workspace != "", "guidance_workspace_id", workspace, "non-empty strings")


def _names(values: tuple[str, ...]) -> str:
    return ", ".join(repr(v) for v in values)


_GUIDANCE_FIELDS = frozenset(
    ["guidance_train", "guidance_eval", "guidance_ratio", "guidance_trained_prompt",
     "guidance_keep_ratio", "guidance_template", "guidance_top_k", "guidance_max_tokens",
     "guidance_update_freq",
     "guidance_init_from_pool", "guidance_provider", "guidance_base_url", "guidance_timeout",
     "guidance_workspace_id"]
)  # fmt: skip
_REPLAY_FIELD_NAMES = frozenset(
    name for name in ExReplayGRPOConfig.__dataclass_fields__ if name not in GRPOConfig.__dataclass_fields__
)
