"""A user's TRL `rollout_func` under replay.

The contract: in a generation step that replays, the `rollout_func` is called with the prompts of the fresh rows only
(a replayed group has `num_generations - replay_trajectories_per_group` of them, not `num_generations`), in the batch's
order, and must return one completion per prompt it is given, as TRL's `GRPOTrainer` expects of it on every other step.
The replayed rows are then put back in place from the pool: their prompt and completion ids, no sampler log-probs
(`None`: they were not sampled now; the loss uses their recorded ones), and their model-token mask as `env_mask`
(environment tokens stay out of the loss). Other per-row fields the function returns take, for a replayed row, the
first returned row's value, so that reward functions reading them run (the row's reward is the recorded one). A
function that generates `num_generations` completions per unique prompt cannot take that call: its output has the wrong
length, and the error says so.
"""

from __future__ import annotations

from collections.abc import Callable

from .trl_seam import ROLLOUT_KEYS


def fresh_rows_rollout(
    rollout_func: Callable, prompts: list, rollout_trainer, replayed: dict, num_padding: int, fit: Callable
) -> dict:
    """`rollout_func`'s output for all rows of `prompts` in a step that replays: the function is asked for the fresh
    rows only (and `num_padding` copies of the first prompt, generated and discarded so that every rank makes the same
    calls), with TRL's second argument `rollout_trainer` passed through untouched (TRL's contract with it); the
    replayed rows (`replayed`: row -> `Trajectory`) are put back in place (`splice_replayed`, `fit` cutting a
    completion to `max_completion_length`)."""
    fresh = [i for i in range(len(prompts)) if i not in replayed]
    asked = [prompts[i] for i in fresh] + [prompts[0]] * num_padding
    output = rollout_func(asked, rollout_trainer) if asked else {key: [] for key in ROLLOUT_KEYS}
    if len(output.get("completion_ids") or []) != len(asked):
        raise ValueError(
            f"rollout_func returned {len(output.get('completion_ids') or [])} completions for {len(asked)} prompts. "
            "With experience replay it is called with the fresh rows' prompts only (fewer than num_generations "
            "per prompt in a replayed group) and must return one completion per prompt it is given; a "
            "rollout_func that generates num_generations completions per unique prompt cannot replay: set "
            "`enable_experience_replay=False`."
        )
    return splice_replayed(output, len(prompts), fresh, replayed, fit)


def splice_replayed(output: dict, num_rows: int, fresh: list[int], replayed: dict, fit: Callable) -> dict:
    """The rollout output for all `num_rows` rows: the fresh rows' from `output` (their rows `fresh`, in order),
    the replayed rows' from their trajectories (`replayed`: row -> `Trajectory`), `fit` cutting a completion to
    `max_completion_length`. The required keys are per row; another field is per row when it is a list with a value
    per row of `output`. A replayed row's value of such a field is the first returned row's: it was not generated now,
    and the reward functions that read the field score it for nothing (its reward is the recorded one), but they
    must not fail on it."""
    asked = len(output["completion_ids"])
    for key in ROLLOUT_KEYS:
        if output.get(key) is not None and len(output[key]) != asked:
            raise ValueError(f"rollout_func returned {len(output[key])} {key} for {asked} completions.")
    per_row = [k for k, v in output.items() if k in ROLLOUT_KEYS and v is not None]
    per_row += [k for k, v in output.items() if k not in ROLLOUT_KEYS and isinstance(v, list) and len(v) == asked]
    merged = {k: v for k, v in output.items() if k not in per_row}
    masked = "env_mask" in output or any(0 in t.completion_mask for t in replayed.values())
    for key in {*per_row, *(["env_mask"] if masked else [])}:
        merged[key] = [None] * num_rows
        for j, row in enumerate(fresh):
            value = output[key][j] if key in output else [1] * len(output["completion_ids"][j])
            merged[key][row] = list(value) if key in ROLLOUT_KEYS or key == "env_mask" else value
    extra = [k for k in per_row if k not in ROLLOUT_KEYS and k != "env_mask"]
    for row, trajectory in replayed.items():
        completion = fit(trajectory.completion_ids)
        merged["prompt_ids"][row] = list(trajectory.prompt_ids)
        merged["completion_ids"][row] = completion
        if merged.get("logprobs") is not None:  # not sampled now: no sampler log-probs (TRL reads None as NaN)
            merged["logprobs"][row] = [None] * len(completion)
        if masked:
            merged["env_mask"][row] = list(trajectory.completion_mask[: len(completion)])
        for key in extra:
            merged[key][row] = output[key][0] if asked else None
    return merged
