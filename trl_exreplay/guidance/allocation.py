"""Which rollouts are guided and which tasks keep the guidance in training: pure functions of the batch's layout and
a seed, as AgentEvolver's `ExperienceManager` allocates them (`allocate_train_mode` and `allocate_add_exp` in
`agentevolver/module/exp_manager/exp_manager.py`, github.com/modelscope/AgentEvolver), so that every process draws the
same allocation for the same global batch and a resumed run draws the same ones again.

* Task level (`train_sample_modes`): `keep_count = int(num_tasks * keep_ratio)` of a batch's tasks keep the
  experience in their training samples, the rest discard it; the list `['keep'] * keep_count + ['discard'] * ...`
  is shuffled. `keep_ratio` is 1 (`guided`), 0 (`plain`) or `guidance_keep_ratio` (`hybrid`).
* Rollout level (`rollout_add_exp`): `off` guides none of a task's G rollouts, `all` every one, `mixed` the
  `round(G * guidance_ratio)` rollouts `i < round(G * ratio)`, in a random order.

`allocate_guidance` applies both to a generation batch of groups (G consecutive rows per task); a replayed row is
never guided (replay has priority: its tokens are a stored episode).

Example:

```python
from trl_exreplay.guidance.allocation import allocate_guidance

allocation = allocate_guidance(4, 2, rollout_mode="mixed", rollout_ratio=0.5, sample_mode="hybrid", keep_ratio=0.5,
                               seed=[0, 7, 0])
assert sum(allocation.guided) == 4                      # round(4 * 0.5) = 2 guided rollouts in each of the 2 groups
assert sorted(allocation.keep) == [False, True]         # int(2 * 0.5) = 1 of the 2 tasks keeps its guidance
assert allocate_guidance(4, 2, "mixed", 0.5, "hybrid", 0.5, seed=[0, 7, 0]) == allocation  # same seed, same draw
```
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

ROLLOUT_MODES = ("off", "mixed", "all")
SAMPLE_MODES = ("guided", "plain", "hybrid")


def keep_ratio_of(sample_mode: str, keep_ratio: float) -> float:
    """The fraction of tasks that keep their guidance in training, for a `guidance_trained_prompt`."""
    return {"guided": 1.0, "plain": 0.0}.get(sample_mode, keep_ratio)


def train_sample_modes(num_tasks: int, sample_mode: str, keep_ratio: float, rng: np.random.Generator) -> list[str]:
    """'keep' or 'discard' for each of `num_tasks` tasks: `int(num_tasks * ratio)` keep, in a shuffled order."""
    keep_count = int(num_tasks * keep_ratio_of(sample_mode, keep_ratio))
    modes = ["keep"] * keep_count + ["discard"] * (num_tasks - keep_count)
    return [modes[i] for i in rng.permutation(num_tasks)]


def guided_count(num_generations: int, rollout_mode: str, rollout_ratio: float) -> int:
    """How many of a task's `num_generations` rollouts are guided under `rollout_mode`."""
    if rollout_mode == "all":
        return num_generations
    if rollout_mode == "mixed":
        return round(num_generations * rollout_ratio)  # Python's round: half to even, as AgentEvolver's rounds
    return 0


def rollout_add_exp(
    num_generations: int, rollout_mode: str, rollout_ratio: float, rng: np.random.Generator
) -> list[bool]:
    """Whether each of a task's rollouts is guided: the first `guided_count` flags, in a random order."""
    count = guided_count(num_generations, rollout_mode, rollout_ratio)
    flags = [i < count for i in range(num_generations)]
    return [flags[i] for i in rng.permutation(num_generations)]


@dataclass(frozen=True)
class GuidanceAllocation:
    """A generation batch's allocation, on global rows (identical on every process)."""

    num_generations: int
    guided: tuple[bool, ...]  # per row: the rollout is sampled with retrieved experience in its prompt
    keep: tuple[bool, ...]  # per group (task): its guided rows train on the guided prompt (else: stripped, off-policy)

    def keeps(self, row: int) -> bool:
        return self.keep[row // self.num_generations]

    def discarded(self, row: int) -> bool:
        """A guided row whose guidance is stripped for training (trained off-policy)."""
        return self.guided[row] and not self.keeps(row)


def allocate_guidance(
    num_generations: int,
    num_groups: int,
    rollout_mode: str,
    rollout_ratio: float,
    sample_mode: str,
    keep_ratio: float,
    seed: Sequence[int],
    replayed_rows: Iterable[int] = (),
) -> GuidanceAllocation:
    """The allocation of a batch of `num_groups` groups of `num_generations` rows, drawn from `seed` (a list of ints:
    the run's seed, the step, the micro-step); `replayed_rows` (global rows) are never guided."""
    rng = np.random.default_rng([*seed, 3])  # its own stream: the replay plan and selection use other tails
    keep = train_sample_modes(num_groups, sample_mode, keep_ratio, rng)
    guided = [
        flag for _ in range(num_groups) for flag in rollout_add_exp(num_generations, rollout_mode, rollout_ratio, rng)
    ]
    for row in replayed_rows:
        guided[row] = False
    return GuidanceAllocation(num_generations, tuple(guided), tuple(mode == "keep" for mode in keep))
