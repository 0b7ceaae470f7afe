"""The ExGRPO / AgentEvolver replay rules as pure functions: what a task's outcome does, what is kept, what can be
replayed and which trajectories are.

ExGRPO's code (arXiv 2510.02245; github.com/ElliottYan/LUFFY, folder ExGRPO, under `exgrpo/verl/verl/mix_src/`) has
the skip set (`mix_trainer_experience.py`: a question every rollout solved joins `skip_uid_set`;
`cleanup_experience_buckets` in `experience/experience_trainer_ops.py` drops its stored successes), the success bounds
and the buckets (`collect_experience_entries`, same file; its upper bound is inclusive, ours exclusive: its 7 of 8 is
our 8) and the entropy ranking (`select_best_experiences` in `experience/experience_helpers.py`). The per-task
capacity, its eviction and the `"best"` store mode are this library's design (ExGRPO keeps every distinct success).
`ExperiencePool` applies the rules to its index. Each function takes plain numbers and sequences and returns a
decision, so it can be tested by hand
(`tests/unit/test_pool_rules.py`), as `loss.py` and `planner.py` are.

* **Skip set and buckets** (`is_solved`, `stores_successes`): a task's difficulty is its number of successes among
  its fresh rollouts of one step. A task every fresh rollout solved enters the skip set (and leaves its bucket and
  the store); any other task lives in the bucket of its latest difficulty, and its successful trajectories are
  stored only when ``lbound < successes < rbound``.
* **Which success is stored** (`best_index`, for ``replay_store_mode="best"``): the lowest-entropy one (``argmin``),
  the highest (``argmax``) or a random one.
* **Eviction** (`eviction`): a task holds at most ``replay_max_trajectories_per_task``. At capacity, a trajectory older
  than ``replay_max_policy_age`` policy versions goes first; else ``argmin`` replaces the highest-entropy one if the
  new one's entropy is lower, ``argmax`` the lowest if higher, and ``random`` drops the oldest (FIFO).
* **What can be replayed** (`replayable`): a task in a bucket, outside the skip set, whose dataset row is known and
  that holds at least ``k`` trajectories young enough (``replay_max_policy_age``); the planner draws the step's
  replayed tasks among them (`planner.plan_replay`, by bucket weights).
* **Selection** (`select`, one task's order: `selection_order`): which of each replayed task's trajectories are
  replayed: the lowest entropies (``argmin``; ExGRPO's ``select_best_experiences``), the highest (``argmax``) or a
  random permutation; ties go to the lowest trajectory id (the oldest). The entropies are those saved with the
  trajectories, or the current policy's (``replay_select_by_current_entropy``). The pool's ``select`` and the
  trainer's `selection.select_trajectories` both decide through it.

Example:

```python
from trl_exreplay.pool.rules import eviction, is_solved, select, stores_successes

assert is_solved(successes=8, num_fresh=8) and not is_solved(successes=0, num_fresh=0)
assert stores_successes(successes=3, lbound=0, rbound=8) and not stores_successes(0, lbound=0, rbound=8)
# a full task (entropies 0.9, 0.2) offered one of entropy 0.5: argmin evicts the 0.9 one (slot 0)
assert eviction([0.9, 0.2], [4, 5], [1, 1], 0.5, 2, mode="argmin") == ("replace", 0)
# task "a" holds entropies 0.9, 0.2, 0.5 (ids 4, 5, 6): argmin replays positions 1 and 2; "b" (0.3, 0.1) 1 and 0
assert select(
    {"a": ([0.9, 0.2, 0.5], [4, 5, 6]), "b": ([0.3, 0.1], [7, 8])}, 2, "argmin"
) == {"a": [1, 2], "b": [1, 0]}
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["best_index", "eviction", "is_solved", "replayable", "select", "selection_order", "stores_successes"]


def is_solved(successes: int, num_fresh: int) -> bool:
    """Whether a task enters the skip set: every one of its fresh rollouts (at least one) succeeded."""
    return num_fresh > 0 and successes == num_fresh


def stores_successes(successes: int, lbound: int, rbound: int) -> bool:
    """Whether a bucketed task's successful trajectories are stored: ``lbound < successes < rbound``."""
    return lbound < successes < rbound


def best_index(entropies: Sequence[float], mode: str, rng: np.random.Generator) -> int:
    """Position of the one success ``replay_store_mode="best"`` stores: lowest entropy (``argmin``, first on ties),
    highest (``argmax``), or drawn by `rng` (``random``)."""
    if mode == "argmin":
        return min(range(len(entropies)), key=lambda i: entropies[i])
    if mode == "argmax":
        return max(range(len(entropies)), key=lambda i: entropies[i])
    return int(rng.integers(len(entropies)))


def eviction(
    entropies: Sequence[float],
    traj_ids: Sequence[int],
    versions: Sequence[int],
    new_entropy: float,
    new_version: int,
    mode: str,
    max_policy_age: int | None = None,
) -> tuple[str, int]:
    """What a task at capacity does with a new trajectory, given its stored ones (in store order).

    Returns ``("shift", i)``: remove the stored one at `i` and append the new one (the store keeps its order);
    ``("replace", i)``: put the new one in place of the one at `i`; ``("refuse", -1)``: keep the store as it is.
    """
    n = len(entropies)
    if max_policy_age is not None:
        # Trajectories too old to replay would otherwise hold their slots forever: they go first, oldest first.
        stale = [i for i in range(n) if new_version - versions[i] > max_policy_age]
        if stale:
            return "shift", min(stale, key=lambda i: (versions[i], traj_ids[i]))
    if mode == "argmin":
        worst = max(range(n), key=lambda i: (entropies[i], traj_ids[i]))
        return ("replace", worst) if new_entropy < entropies[worst] else ("refuse", -1)
    if mode == "argmax":
        worst = min(range(n), key=lambda i: (entropies[i], -traj_ids[i]))
        return ("replace", worst) if new_entropy > entropies[worst] else ("refuse", -1)
    return "shift", 0  # random: FIFO


def replayable(
    difficulty: np.ndarray,
    in_skip_set: np.ndarray,
    has_row: np.ndarray,
    num_selectable: np.ndarray,
    min_trajectories: int,
) -> np.ndarray:
    """Mask of the tasks (one entry each in every array) that can be replayed now: in a bucket (`difficulty` >= 0),
    outside the skip set, with a known dataset row, and at least `min_trajectories` trajectories `select` may return
    (`num_selectable`: those young enough)."""
    return (difficulty >= 0) & ~in_skip_set & has_row & (num_selectable >= min_trajectories)


def select(
    candidates: Mapping[str, tuple[Sequence[float], Sequence[int]]],
    num: int,
    mode: str,
    rng: np.random.Generator | None = None,
) -> dict[str, list[int]]:
    """Which trajectories each replayed task replays: ``task -> (entropies, trajectory ids)`` of its candidates in
    store order, to ``task -> positions`` of its `num` chosen ones, in the order they take the group's replayed rows
    (`selection_order`, the tasks in turn, drawing from the one `rng` in that order under ``random``)."""
    return {task: selection_order(entropies, ids, num, mode, rng) for task, (entropies, ids) in candidates.items()}


def selection_order(
    entropies: Sequence[float],
    traj_ids: Sequence[int],
    num: int,
    mode: str,
    rng: np.random.Generator | None = None,
) -> list[int]:
    """Positions of the `num` candidates `mode` replays, in order: lowest entropies first (``argmin``), highest
    first (``argmax``), ties to the lowest trajectory id; or the first `num` of a permutation drawn by `rng`
    (``random``, which needs one)."""
    if num > len(entropies):
        raise ValueError(f"Cannot select {num} trajectories out of {len(entropies)} candidates.")
    order = list(range(len(entropies)))
    if mode == "argmin":
        order.sort(key=lambda i: (entropies[i], traj_ids[i]))
    elif mode == "argmax":
        order.sort(key=lambda i: (-entropies[i], traj_ids[i]))
    else:
        if rng is None:
            raise ValueError("selection_order: mode 'random' needs an `rng`.")
        order = [int(i) for i in rng.permutation(len(entropies))]
    return order[:num]
