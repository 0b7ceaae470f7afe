"""Which groups of a generation batch become replay tasks, and which of their rows are replayed.

Pure and seeded: every process calls `plan_replay` with the same global group keys, the same pool and the same seed,
so all processes agree on the plan without talking to each other.

Layout (TRL's `RepeatSampler`): the global generation batch has `num_groups * G` rows; group `g` holds rows
`[g*G, (g+1)*G)`. A replay group keeps its G rows; its last `k` rows are replayed trajectories, the first `G - k` are
generated fresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NORMAL_BUCKET_STD = 0.25  # std of the Gaussian over bucket accuracy (successes / G) for "normal" weighting


@dataclass(frozen=True)
class ReplayPlan:
    """`replay_groups` maps a group index of the global batch to the pool task it replays."""

    num_generations: int
    num_replayed: int  # k
    replay_groups: dict[int, str]

    @property
    def num_tasks(self) -> int:
        return len(self.replay_groups)

    def replayed_rows(self) -> list[int]:
        """Global row indices of replayed rows, ascending."""
        g, k = self.num_generations, self.num_replayed
        return [group * g + j for group in sorted(self.replay_groups) for j in range(g - k, g)]

    def is_replayed(self, row: int) -> bool:
        group, position = divmod(row, self.num_generations)
        return group in self.replay_groups and position >= self.num_generations - self.num_replayed

    def task_of_row(self, row: int, group_keys: Sequence[str]) -> str:
        group = row // self.num_generations
        return self.replay_groups.get(group, group_keys[group])


def bucket_weights(difficulties: Sequence[int], num_generations: int, weighting: str) -> np.ndarray:
    """Draw weight of each task given its bucket; buckets share their weight equally among their tasks."""
    difficulties = np.asarray(difficulties, dtype=np.float64)
    if weighting == "uniform":
        return np.ones_like(difficulties)
    if weighting == "normal":
        accuracy = difficulties / num_generations
        per_bucket = np.exp(-0.5 * ((accuracy - 0.5) / NORMAL_BUCKET_STD) ** 2)
    elif weighting == "linear":
        per_bucket = (num_generations - difficulties).clip(min=1.0)
    else:
        raise ValueError(f"Unknown replay_bucket_weighting {weighting!r}: allowed 'uniform', 'normal', 'linear'.")
    _, inverse, counts = np.unique(difficulties, return_inverse=True, return_counts=True)
    return per_bucket / counts[inverse]


def plan_replay(
    group_keys: Sequence[str],
    replayable: Sequence[tuple[str, int]],
    *,
    exp_ratio: float,
    num_generations: int,
    num_replayed: int,
    weighting: str = "uniform",
    seed: int | Sequence[int] = 0,
) -> ReplayPlan:
    """Choose the replay groups of one generation batch.

    Args:
        group_keys: task id of each group of the global batch, in order.
        replayable: (task id, difficulty) of the pool tasks that can be replayed now.
        exp_ratio: fraction of groups to turn into replay tasks (`int(num_groups * exp_ratio)`, fewer if the pool is
            small).
        num_generations, num_replayed: G and k.
        weighting: how tasks are drawn over difficulty buckets (see `bucket_weights`).
        seed: seed of this draw (the trainer uses `(args.seed, global_step)`).

    A drawn task already present in the batch replays in (the first) group that holds it, so replay never puts a task
    in two groups of a batch; the other drawn tasks replace random groups whose task was not drawn (copies of drawn
    tasks only when no such group is left).
    """
    num_groups = len(group_keys)
    target = min(int(num_groups * exp_ratio), len(replayable))
    if target <= 0:
        return ReplayPlan(num_generations, num_replayed, {})
    rng = np.random.default_rng(seed)
    weights = bucket_weights([d for _, d in replayable], num_generations, weighting)
    chosen = rng.choice(len(replayable), size=target, replace=False, p=weights / weights.sum())
    drawn = [replayable[i][0] for i in chosen]

    first_group: dict[str, int] = {}
    for group, key in enumerate(group_keys):
        first_group.setdefault(key, group)
    replay_groups: dict[int, str] = {}
    to_place = []
    for task_id in drawn:
        if task_id in first_group:
            replay_groups[first_group[task_id]] = task_id
        else:
            to_place.append(task_id)
    # Prefer groups whose task was not drawn; a second copy of a drawn task (a dataset that repeats tasks) is used
    # only when nothing else is left, so the plan still reaches its target.
    drawn_set = set(drawn)
    preferred = [g for g in range(num_groups) if g not in replay_groups and group_keys[g] not in drawn_set]
    fallback = [g for g in range(num_groups) if g not in replay_groups and group_keys[g] in drawn_set]
    free = [preferred[i] for i in rng.permutation(len(preferred))] + [
        fallback[i] for i in rng.permutation(len(fallback))
    ]
    for task_id, group in zip(to_place, free):
        replay_groups[group] = task_id
    return ReplayPlan(num_generations, num_replayed, dict(sorted(replay_groups.items())))
