"""`AlfWorldArguments`: the options of the ALFWorld recipe (`recipes/alfworld.py`) beside TRL's training and model
options, and the check that ties the reward penalty to the success threshold."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..envs.settings import MultiTurnSettings

PROMPT_STYLES = ("plain", "react", "none")
ENV_BACKENDS = ("processes", "ray")


@dataclass
class AlfWorldArguments(MultiTurnSettings):
    """The ALFWorld recipe's options that are not training (`ExReplayGRPOConfig`) or model (`trl.ModelConfig`) options:
    the episodes (`MultiTurnSettings`, which it extends: the recipe gives it to the trainer as `multi_turn`), the
    games, the evaluation, the environment, the tiny model built when no `model_name_or_path` is given, the warm start
    and the pool's upload. Misspelt objects, bad evaluation settings and penalties fail at parse time.

    Example:

    ```python
    from trl import ModelConfig, TrlParser

    from trl_exreplay import ExReplayGRPOConfig
    from trl_exreplay.alfworld.arguments import AlfWorldArguments

    parser = TrlParser((AlfWorldArguments, ExReplayGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--output_dir", "out", "--use_cpu", "true", "--target_objects", "book"]
    )
    assert script_args.target_objects == ["Book"]
    ```
    """

    data_dir: str = field(
        default="data/alfworld",
        metadata={
            "help": "Folder holding json_2.1.1/<split>/ (official ALFWorld data, or where games are generated)."
        },
    )
    generate_missing_games: bool = field(
        default=True,
        metadata={"help": "Generate a split offline (verified on the engine) when data_dir has no games for it."},
    )
    num_train_games: int = field(default=60, metadata={"help": "Train games to generate when generating."})
    num_eval_games: int = field(default=20, metadata={"help": "Games per evaluation split to generate."})
    game_seed: int = field(default=0, metadata={"help": "Seed of the game generator."})
    task_types: list[str] | None = field(
        default=None,
        metadata={"help": "ALFWorld task types (names or ids 1-6) to generate and train on; all if None."},
    )
    scenes: list[int] | None = field(
        default=None,
        metadata={
            "help": "Floor plans of generated train and valid_seen games (a subset of ALFWorld's train floor "
            "plans); None: all. valid_unseen always uses its own unseen floor plans."
        },
    )
    target_objects: list[str] | None = field(
        default=None,
        metadata={
            "help": "Objects the tasks ask for (ALFRED types such as Book, CD); games of other objects are "
            "neither generated nor loaded. None: any."
        },
    )
    verify_train_games: bool = field(
        default=True,
        metadata={
            "help": "Play each generated train game's walkthrough on the engine before use (evaluation games "
            "are always verified; the warm start's expert plays every train game anyway)."
        },
    )
    train_split: str = field(default="train", metadata={"help": "Split whose games are the training tasks."})
    rl_train_games: int | None = field(
        default=None,
        metadata={
            "help": "RL plays only this many of the train games, drawn by `seed` (the warm start still learns "
            "from all of them): a small model trained from scratch learns the games it plays often, "
            "not new ones. None: every train game."
        },
    )
    eval_splits: list[str] = field(
        default_factory=lambda: ["valid_seen", "valid_unseen"],
        metadata={"help": "Splits evaluated before and after RL (greedy, one episode per game)."},
    )
    max_eval_games: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many games of each split (None: all)."}
    )
    eval_sampled_episodes: int = field(
        default=0,
        metadata={
            "help": "Also evaluate by sampling, as RL plays: this many episodes per game at eval_temperature "
            "(with the training top_k/top_p/min_p); 0: greedy only."
        },
    )
    eval_temperature: float | None = field(
        default=None, metadata={"help": "Sampling temperature of the sampled evaluation; None: `temperature`."}
    )
    eval_train_episodes: int = field(
        default=0,
        metadata={
            "help": "Also evaluate the train games RL plays (at most max_eval_games of them), before and after "
            "RL: this many sampled episodes per game at eval_temperature, as RL plays them. Not "
            "held-out: it shows what RL did to its own games. 0: off."
        },
    )
    show_admissible: bool = field(
        default=False, metadata={"help": "Append the admissible actions to every observation."}
    )
    restate_goal: bool = field(
        default=False, metadata={"help": "Start every observation after the first with the task (helps small models)."}
    )
    invalid_action_penalty: float = field(
        default=0.0,
        metadata={
            "help": "Subtracted from the reward for each action the engine refuses ('Nothing happens.'); a won "
            "episode must still reach `replay_success_threshold`, so set that to at most 1 - max_turns * penalty."
        },
    )
    prompt_style: str = field(
        default="plain",
        metadata={"help": "System prompt: 'plain' (answer with an action), 'react' (Think:/Action:) or 'none'."},
    )
    env_backend: str = field(
        default="processes",
        metadata={
            "help": "Where the environments run: 'processes' (`EnvProcessPool`, worker processes of each rank) or "
            "'ray' (`RayEnvPool`, Ray actors: a local Ray instance, or the cluster at RAY_ADDRESS; needs "
            "`pip install trl-exreplay[ray]`)."
        },
    )
    env_processes: int | None = field(
        default=None,
        metadata={
            "help": "Environment workers per rank (processes, or Ray actors with env_backend 'ray'; the engine is "
            "CPU-bound); None: this machine's CPUs / ranks, or with Ray the cluster's CPUs / ranks."
        },
    )
    env_ray_cpus_per_worker: float = field(
        default=1.0, metadata={"help": "With env_backend 'ray': CPUs Ray reserves for each actor (its num_cpus)."}
    )
    tiny_hidden_size: int = field(default=128, metadata={"help": "Tiny model (no model_name_or_path): hidden size."})
    tiny_num_layers: int = field(default=4, metadata={"help": "Tiny model: transformer layers."})
    tiny_num_heads: int = field(default=4, metadata={"help": "Tiny model: attention heads."})
    tiny_entity_tokens: bool = field(
        default=False,
        metadata={"help": "Tiny model: one token per object or receptacle name ('book 2'), not one per word."},
    )
    warm_start: bool = field(
        default=True, metadata={"help": "SFT on the searching expert's episodes of the train games before RL."}
    )
    warm_start_epochs: float = field(default=3.0, metadata={"help": "Warm start: SFT epochs."})
    warm_start_learning_rate: float = field(default=3e-3, metadata={"help": "Warm start: SFT learning rate."})
    warm_start_batch_size: int = field(default=8, metadata={"help": "Warm start: SFT batch size per device."})
    warm_start_max_episodes: int | None = field(
        default=None, metadata={"help": "Warm start: use at most this many expert episodes (None: all)."}
    )
    push_pool_to_hub: bool = field(
        default=False, metadata={"help": "Also upload the final experience pool as a dataset (with --push_to_hub)."}
    )
    hub_pool_id: str | None = field(
        default=None, metadata={"help": "Dataset repo for the pool; default '<hub_model_id>-pool'."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.target_objects:  # a misspelt object fails here, not after minutes of game generation
            from .generate import normalize_target_objects

            self.target_objects = list(normalize_target_objects(self.target_objects))
        if self.eval_sampled_episodes < 0:
            raise ValueError(
                f"Invalid value {self.eval_sampled_episodes} for `eval_sampled_episodes`: allowed "
                "values are 0 (greedy only) or a positive number of episodes per game."
            )
        if self.eval_train_episodes < 0:
            raise ValueError(
                f"Invalid value {self.eval_train_episodes} for `eval_train_episodes`: allowed values "
                "are 0 (off) or a positive number of episodes per game."
            )
        if self.rl_train_games is not None and self.rl_train_games < 1:
            raise ValueError(
                f"Invalid value {self.rl_train_games} for `rl_train_games`: allowed values are None "
                "(every train game) or a positive number of games."
            )
        if self.eval_temperature is not None and not self.eval_temperature > 0:
            raise ValueError(
                f"Invalid value {self.eval_temperature} for `eval_temperature`: allowed values are "
                "positive numbers, or None for the training `temperature`."
            )
        from .textenv import check_invalid_action_penalty

        check_invalid_action_penalty(self.invalid_action_penalty)  # here, not first in the env's worker processes
        if self.env_backend not in ENV_BACKENDS:
            raise ValueError(
                f"Invalid value {self.env_backend!r} for `env_backend`: allowed values are "
                f"{', '.join(map(repr, ENV_BACKENDS))}."
            )
        if not self.env_ray_cpus_per_worker > 0:
            raise ValueError(
                f"Invalid value {self.env_ray_cpus_per_worker} for `env_ray_cpus_per_worker`: allowed "
                "values are positive numbers."
            )
        if self.prompt_style not in PROMPT_STYLES:
            raise ValueError(
                f"Invalid value {self.prompt_style!r} for `prompt_style`: allowed values are "
                f"{', '.join(map(repr, PROMPT_STYLES))}."
            )


PROMPT_STYLES = ("plain", "react", "none")
ENV_BACKENDS = ("processes", "ray")


def check_reward_settings(script_args: AlfWorldArguments, training_args) -> None:
    """With `invalid_action_penalty` P a won episode's reward stays above 1 - max_turns * P and a lost one's is at most
    0: `replay_success_threshold`, what counts as a win for the pool, the metrics and the evaluation, must lie
    between."""
    penalty, max_turns = script_args.invalid_action_penalty, script_args.max_turns
    if not penalty:
        return
    if penalty * max_turns >= 1:
        raise ValueError(
            f"Invalid value {penalty} for `invalid_action_penalty` with max_turns={max_turns}: a won "
            f"episode's reward could fall to 0 or below; allowed values are in "
            f"[0, {1 / max_turns:g})."
        )
    lowest_win = 1.0 - max_turns * penalty
    if not 0.0 < training_args.replay_success_threshold <= lowest_win:
        raise ValueError(
            f"Invalid value {training_args.replay_success_threshold} for `replay_success_threshold` with "
            f"invalid_action_penalty={penalty} and max_turns={max_turns}: a won episode's reward stays "
            f"above {lowest_win:g} and a lost one's is at most 0, so allowed values are in (0, "
            f"{lowest_win:g}]."
        )
