"""A user's TRL `rollout_func` under replay.

The contract: in a generation step that replays, the `rollout_func` is called with the prompts of the fresh rows only
(a replayed group has `num_generations - offpolicy_trajectories_per_task` of them, not `num_generations`), in the
batch's order, and must return one completion per prompt it is given, as TRL's `GRPOTrainer` expects of it on every
other step. The replayed rows are then put back in place from the pool: their prompt and completion ids, their
recorded log-probs as `logprobs`, and their model-token mask as `env_mask` (environment tokens stay out of the loss).
Other per-row fields the function returns are `None` for replayed rows (their rewards are the recorded ones).
A function that generates `num_generations` completions per unique prompt cannot take that call: its output has the
wrong length, and the error says so.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def replaying_rollout(rollout_func: Callable, trainer) -> Callable:
    """`rollout_func`, asked only for the fresh rows of a replaying step of `trainer` (an `ExReplayGRPOTrainer`)."""

    @functools.wraps(rollout_func)
    def rollout(prompts: list, rollout_trainer) -> dict:
        step = trainer._generation
        replayed = step.take_replay() if step is not None else None
        if replayed is None:
            return rollout_func(prompts, rollout_trainer)
        fresh = [i for i in range(len(prompts)) if i not in replayed]
        asked = [prompts[i] for i in fresh] + [prompts[0]] * trainer._padding_rows(len(fresh))
        output = rollout_func(asked, rollout_trainer) if asked else {key: [] for key in ROLLOUT_KEYS}
        if len(output.get("completion_ids") or []) != len(asked):
            raise ValueError(
                f"rollout_func returned {len(output.get('completion_ids') or [])} completions for {len(asked)} prompts. "
                "With experience replay it is called with the fresh rows' prompts only (fewer than num_generations "
                "per prompt in a replayed group) and must return one completion per prompt it is given; a "
                "rollout_func that generates num_generations completions per unique prompt cannot replay: set "
                "`enable_experience_replay=False`."
            )
        return splice_replayed(output, len(prompts), fresh, replayed, trainer._fit_completion)

    return rollout


def splice_replayed(output: dict, num_rows: int, fresh: list[int], replayed: dict, fit: Callable) -> dict:
    """The rollout output for all `num_rows` rows: the fresh rows' from `output` (their rows `fresh`, in order),
    the replayed rows' from their trajectories (`replayed`: row -> `Trajectory`), `fit` cutting a completion to
    `max_completion_length`. Per-row fields are the lists of `output` as long as it has rows."""
    asked = len(output["completion_ids"])
    per_row = [k for k, v in output.items() if isinstance(v, list) and len(v) == asked]
    merged = {k: v for k, v in output.items() if k not in per_row}
    masked = "env_mask" in output or any(0 in t.completion_mask for t in replayed.values())
    for key in {*per_row, *(["env_mask"] if masked else [])}:
        merged[key] = [None] * num_rows
        for j, row in enumerate(fresh):
            value = output[key][j] if key in output else [1] * len(output["completion_ids"][j])
            merged[key][row] = value
    for row, trajectory in replayed.items():
        completion = fit(trajectory.completion_ids)
        merged["prompt_ids"][row] = list(trajectory.prompt_ids)
        merged["completion_ids"][row] = completion
        if merged.get("logprobs") is not None:
            merged["logprobs"][row] = list(trajectory.logps[: len(completion)])
        if masked:
            merged["env_mask"][row] = list(trajectory.completion_mask[: len(completion)])
    return merged
