"""Fresh rollouts where they teach: a per-task estimate of success, and the plan that gives a generation batch's
groups to the tasks whose groups are likely to have a reward spread.

A GRPO group whose G rollouts all fail, or all win, has advantages 0: its rollouts give no gradient. Rescue (a stored
success in an all-fail group) helps only tasks solved before, and retirement only solved ones; what is left are tasks
every rollout fails. This module chooses, before generation, which tasks get the batch's groups:

* `SuccessEstimates`: per task, a Beta posterior of one fresh rollout's success probability, from every fresh outcome
  of the run (MoPPS, arXiv 2507.04632, keeps one per prompt), whose evidence decays toward the prior with a half-life
  in optimizer steps, so that what the policy did long ago weighs less. A task never seen has the prior, Beta(1, 1).
* `spread_probability`: the chance that a group of G has both a success and a failure, under the posterior
  (``1 - E[p^G] - E[(1-p)^G]``, in closed form); a task whose all-fail group would be rescued counts its all-fail
  groups as teaching.
* `plan_groups`: given the sampler's groups and more candidate rows drawn from the dataset, which candidate fills
  each group: a share of the sampler's groups kept as drawn (exploration: no task is shut out for good, GRESO's
  re-exploration, arXiv 2506.02177), the rest to the candidates with the highest spread under a Thompson draw of
  each one's success probability, at most `max_groups_per_task` groups a task (Knapsack RL, arXiv 2509.25849, moves
  budget to hard-but-solvable tasks). TRL's batch shape stays: the same number of groups of G.

Pure and seeded, like the replay plan: every rank computes the same plan from the same gathered keys, estimates and
seed, and a resumed run (whose checkpoint holds the estimates) the plan of the run that was not stopped.

Example:

```python
import numpy as np
from trl_exreplay.spread import SuccessEstimates, plan_groups, spread_probability

estimates = SuccessEstimates(half_life=100)
estimates.update([("easy", 8, 8), ("hard", 0, 8), ("mid", 4, 8)], step=0)
alpha, beta = estimates.posterior(["easy", "hard", "mid", "new"], step=1)
spread = spread_probability(alpha, beta, group_size=8)
# the task solved half the time first; an unseen one beats a solved one
assert spread.argmax() == 2 and spread[0] < spread[3]
# two groups drawn by the sampler (of "easy" and "hard"), two more candidate rows: "mid" and "new" take both groups
plan = plan_groups(["easy", "hard", "mid", "new"], alpha, beta, np.zeros(4, bool), num_groups=2, group_size=8,
                   explore=0.0, max_groups_per_task=1, seed=1)
assert plan.chosen == [2, 3] and plan.replaced() == {0: 2, 1: 3}
```
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .pool.store import read_arrow, write_arrow, write_atomic

PRIOR = (1.0, 1.0)  # Beta(1, 1): a task never seen is as likely to succeed as not (MoPPS's prior)
ESTIMATES_FILE = "exreplay_estimates.arrow"
ESTIMATES_SCHEMA = pa.schema(
    [("task", pa.string()), ("alpha", pa.float64()), ("beta", pa.float64()), ("step", pa.int64())]
)


def spread_probability(alpha, beta, group_size: int, rescuable=None) -> np.ndarray:
    """Per task, the probability that a group of `group_size` fresh rollouts has a reward spread (a success and a
    failure) when one rollout succeeds with p ~ Beta(alpha, beta): ``1 - E[p^G] - E[(1-p)^G]``, where
    ``E[p^G] = prod_{i<G} (alpha + i) / (alpha + beta + i)``. Where `rescuable` (a stored success of the task would
    rescue an all-fail group), only an all-win group teaches nothing: ``1 - E[p^G]``."""
    alpha, beta = np.asarray(alpha, dtype=np.float64)[:, None], np.asarray(beta, dtype=np.float64)[:, None]
    i = np.arange(group_size, dtype=np.float64)
    all_win = np.prod((alpha + i) / (alpha + beta + i), axis=1)
    all_fail = np.prod((beta + i) / (alpha + beta + i), axis=1)
    if rescuable is not None:
        all_fail = np.where(np.asarray(rescuable, dtype=bool), 0.0, all_fail)
    return 1.0 - all_win - all_fail


@dataclass(frozen=True)
class GroupPlan:
    """Which candidate fills each group of a generation batch: `chosen[g]` is the candidate index (into the list
    given to `plan_groups`, whose first `num_groups` are the sampler's own groups) of group g, and `predicted[g]` the
    probability that its fresh rollouts have a spread under the estimates (the posterior's, not the Thompson draw's;
    rescue not counted): what the observed spread is compared with."""

    chosen: list[int]
    predicted: list[float]

    def replaced(self) -> dict[int, int]:
        """The groups that take another candidate than their own: group -> candidate index."""
        return {g: c for g, c in enumerate(self.chosen) if c != g}


def plan_groups(
    candidate_keys: Sequence[str],
    alpha: np.ndarray,
    beta: np.ndarray,
    rescuable: np.ndarray,
    *,
    num_groups: int,
    group_size: int,
    explore: float,
    max_groups_per_task: int,
    seed,
) -> GroupPlan:
    """Fill `num_groups` groups from the candidates `candidate_keys` (each one's task; the first `num_groups` are
    the groups the sampler drew, in order, the rest extra dataset rows), whose posteriors are `alpha`, `beta`.

    Each of the sampler's groups is kept as drawn with probability `explore`. The other groups go to the candidates
    with the highest spread probability under one Thompson draw of each candidate's success probability (a draw, not
    the mean: an uncertain task is tried now and then), at most `max_groups_per_task` groups per task (the kept
    groups count); a sampler's group whose own candidate is chosen keeps its row, and the remaining choices fill the
    remaining groups in order. Too few eligible candidates: the sampler's groups left over keep their own rows."""
    rng = np.random.default_rng(seed)
    n = len(candidate_keys)
    if n < num_groups:
        raise ValueError(f"{n} candidates for {num_groups} groups: the sampler's groups come first")
    kept = rng.random(num_groups) < explore
    p = rng.beta(alpha, beta)
    drawn = 1.0 - p**group_size - np.where(rescuable, 0.0, (1.0 - p) ** group_size)
    order = np.lexsort((np.arange(n), -drawn))  # highest drawn spread first; ties by candidate order
    taken: dict[str, int] = {}
    for g in np.flatnonzero(kept):
        taken[candidate_keys[g]] = taken.get(candidate_keys[g], 0) + 1
    open_groups = int(num_groups - kept.sum())
    picks: list[int] = []
    for c in order.tolist():
        if len(picks) == open_groups:
            break
        if c < num_groups and kept[c]:
            continue  # a kept group is in the batch already
        key = candidate_keys[c]
        if taken.get(key, 0) < max_groups_per_task:
            taken[key] = taken.get(key, 0) + 1
            picks.append(c)
    chosen = [g if kept[g] or g in picks else -1 for g in range(num_groups)]
    others = iter(c for c in picks if c >= num_groups)
    chosen = [c if c >= 0 else next(others, g) for g, c in enumerate(chosen)]
    return GroupPlan(chosen, spread_probability(alpha[chosen], beta[chosen], group_size).tolist())


class SuccessEstimates:
    """Per task, a Beta posterior of one fresh rollout's success probability, with evidence that decays.

    A task's pseudo-counts above the prior shrink by half every `half_life` optimizer steps (applied lazily, from
    the step it was last updated), then a group's outcome adds its successes and failures. `update` takes every fresh
    outcome of the run, the same on every rank (they are computed on the gathered batch)."""

    def __init__(self, half_life: float, prior: tuple[float, float] = PRIOR):
        if not half_life > 0:
            raise ValueError(f"half_life is {half_life}; allowed: a number of steps > 0")
        self.half_life, self.prior = float(half_life), prior
        self._index: dict[str, int] = {}
        self._alpha = np.empty(0, dtype=np.float64)
        self._beta = np.empty(0, dtype=np.float64)
        self._step = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._index)

    def _decay(self, rows: np.ndarray, step: int) -> np.ndarray:
        return np.exp2(-np.maximum(step - self._step[rows], 0) / self.half_life)

    def posterior(self, keys: Sequence[str], step: int) -> tuple[np.ndarray, np.ndarray]:
        """Each task's (alpha, beta) at `step`; a task never seen has the prior."""
        alpha = np.full(len(keys), self.prior[0])
        beta = np.full(len(keys), self.prior[1])
        known = [(i, self._index[k]) for i, k in enumerate(keys) if k in self._index]
        if known:
            at, rows = (np.array(x) for x in zip(*known))
            decay = self._decay(rows, step)
            alpha[at] += (self._alpha[rows] - self.prior[0]) * decay
            beta[at] += (self._beta[rows] - self.prior[1]) * decay
        return alpha, beta

    def update(self, outcomes: Iterable[tuple[str, int, int]], step: int) -> None:
        """Add each (task, successes, rollouts) outcome, in order, at optimizer step `step`."""
        for key, successes, trials in outcomes:
            row = self._index.get(key)
            if row is None:
                row = self._append(key, step)
            decay = float(self._decay(np.array([row]), step)[0])
            self._alpha[row] = self.prior[0] + (self._alpha[row] - self.prior[0]) * decay + successes
            self._beta[row] = self.prior[1] + (self._beta[row] - self.prior[1]) * decay + (trials - successes)
            self._step[row] = step

    def _append(self, key: str, step: int) -> int:
        row = len(self._index)
        if row == len(self._alpha):  # grow by doubling: O(1) amortised per new task
            size = max(16, 2 * row)
            self._alpha, self._beta = np.resize(self._alpha, size), np.resize(self._beta, size)
            self._step = np.resize(self._step, size)
        self._index[key] = row
        self._alpha[row], self._beta[row], self._step[row] = self.prior[0], self.prior[1], step
        return row

    # ----------------------------------------------------------------------------------------- checkpoints
    def table(self) -> pa.Table:
        n = len(self._index)
        return pa.table(
            {"task": list(self._index), "alpha": self._alpha[:n], "beta": self._beta[:n], "step": self._step[:n]},
            schema=ESTIMATES_SCHEMA,
        )

    def save(self, folder: str) -> None:
        """Write the estimates to `folder` (a checkpoint) as an Arrow file, whole or not at all."""
        write_atomic(os.path.join(folder, ESTIMATES_FILE), lambda tmp: write_arrow(tmp, self.table()))

    def load(self, folder: str) -> bool:
        """Replace the estimates with those saved in `folder`; False (unchanged) when it holds none. Raises
        `ValueError` naming the file and field on content no save writes: another schema, a null, a repeated task, a
        non-finite or negative count or step."""
        path = os.path.join(folder, ESTIMATES_FILE)
        if not os.path.isfile(path):
            return False
        try:
            table = read_arrow(path)
        except (OSError, ValueError, pa.ArrowException) as error:
            raise ValueError(f"{path}: not an Arrow stream file of estimates ({error})") from None
        if table.schema != ESTIMATES_SCHEMA:
            raise ValueError(f"{path}: schema {table.schema}; allowed: {ESTIMATES_SCHEMA}")
        if any(column.null_count for column in table.columns):
            raise ValueError(f"{path}: null values; every column is required")
        columns = table.to_pydict()
        if len(set(columns["task"])) != len(columns["task"]):
            raise ValueError(f"{path}: `task` lists a task twice")
        for name in ("alpha", "beta", "step"):
            values = np.asarray(columns[name], dtype=np.float64)
            if not np.isfinite(values).all() or (values < 0).any():
                raise ValueError(f"{path}: `{name}` holds a non-finite or negative value; allowed: finite, >= 0")
        self.restore(columns)
        return True

    def columns(self) -> dict[str, list]:
        """The estimates as plain columns (task, alpha, beta, step): what a checkpoint holds, and what rank 0 sends
        the other ranks on resume."""
        return self.table().to_pydict()

    def restore(self, columns: dict[str, list]) -> None:
        """Take the estimates of `columns` (from `columns()`)."""
        self._index = {k: i for i, k in enumerate(columns["task"])}
        self._alpha = np.asarray(columns["alpha"], dtype=np.float64)
        self._beta = np.asarray(columns["beta"], dtype=np.float64)
        self._step = np.asarray(columns["step"], dtype=np.int64)
