"""Which groups of a generation batch become replay tasks, and which of their rows are replayed.

Pure and seeded: every process calls `plan_replay` with the same global group keys, the same pool and the same seed,
so all processes agree on the plan without talking to each other. The replay tasks are drawn from the pool's
difficulty buckets (`TaskBuckets`) at a cost that does not grow with the pool (`draw_replay_tasks`), or from a list.

Layout (TRL's `RepeatSampler`): the global generation batch has `num_groups * G` rows; group `g` holds rows
`[g*G, (g+1)*G)`. A replay group keeps its G rows; its last `k` rows are replayed trajectories, the first `G - k` are
generated fresh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .pool.index import TaskBuckets

NORMAL_BUCKET_STD = 1.0  # "normal" weighting: std, in successes, of ExGRPO's Gaussian around G / 2 successes


def replay_groups_due(replay_ratio: float, num_groups: int, batch_index: int) -> int:
    """How many of the `num_groups` groups of generation batch `batch_index` (0, 1, ... over the whole run) replay a
    pool task, so that `replay_ratio` is the long-run share of replayed groups:
    ``floor(r*g*(n+1)) - floor(r*g*n)``.

    When ``r*g`` is a whole number every batch replays exactly ``r*g`` groups; otherwise batches alternate between
    ``floor(r*g)`` and ``ceil(r*g)``, so a batch of one group at ``r = 0.5`` replays on every second batch (the odd
    ones). A pure function of the global batch index: every rank gets the same count, and a resumed run the count of
    the uninterrupted one. The ratio is read as the decimal it was written as (0.3 is 3/10), so float rounding never
    moves a whole ``r*g`` by one.

    Example:

    ```pycon
    >>> [replay_groups_due(0.5, 1, n) for n in range(6)]
    [0, 1, 0, 1, 0, 1]
    >>> [replay_groups_due(0.5, 4, n) for n in range(3)]
    [2, 2, 2]
    >>> [replay_groups_due(0.3, 2, n) for n in range(5)]  # 0.6 groups a batch: 3 in 5 batches
    [0, 1, 0, 1, 1]

    ```
    """
    share = Fraction(repr(float(replay_ratio))) * num_groups
    return math.floor(share * (batch_index + 1)) - math.floor(share * batch_index)


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

    def fresh_rows_per_rank(self, total_rows: int, rows_per_rank: int) -> list[int]:
        """How many rows each rank generates (its rows that are not replayed)."""
        return [
            sum(not self.is_replayed(r) for r in range(start, start + rows_per_rank))
            for start in range(0, total_rows, rows_per_rank)
        ]

    def rank_rows(self, offset: int, num_rows: int, group_keys: Sequence[str], selected: dict) -> tuple[dict, dict]:
        """A rank's rows `offset .. offset + num_rows - 1` under the plan: {local row: the pool task whose dataset row
        replaces the row's own} (a replayed group's rows, where the group's task is another), and {local row: the
        trajectory it replays} from `selected` (task -> its chosen trajectories, in the order they take the group's
        last `num_replayed` rows)."""
        swapped, replayed = {}, {}
        for i in range(num_rows):
            group, position = divmod(offset + i, self.num_generations)
            task_id = self.replay_groups.get(group)
            if task_id is not None and task_id != group_keys[group]:
                swapped[i] = task_id
            if self.is_replayed(offset + i):
                replayed[i] = selected[task_id][position - (self.num_generations - self.num_replayed)]
        return swapped, replayed


def _bucket_mass(difficulties: np.ndarray, num_generations: int, weighting: str) -> np.ndarray | None:
    """Weight of each bucket (of `difficulties`), shared by the bucket's tasks; None for "uniform" (a task weighs 1,
    whatever its bucket)."""
    if weighting == "uniform":
        return None
    if weighting == "normal":  # ExGRPO's exp(-(k - G/2)^2 / 2), k the bucket's successes
        # Outcomes are counted per group (k <= G), but a pool saved before that, or filled by hand, can hold k above G:
        # it weighs as k = G does (exp of -k^2/2 far out would underflow to 0, and a draw over zeros is NaN).
        successes = difficulties.clip(0, num_generations)
        return np.exp(-0.5 * ((successes - num_generations / 2) / NORMAL_BUCKET_STD) ** 2)
    if weighting == "linear":
        return (num_generations - difficulties).clip(min=1.0)
    raise ValueError(f"Unknown replay_bucket_weighting {weighting!r}: allowed 'uniform', 'normal', 'linear'.")


def bucket_weights(difficulties: Sequence[int], num_generations: int, weighting: str) -> np.ndarray:
    """Draw weight of each task given its bucket; buckets share their weight equally among their tasks."""
    difficulties = np.asarray(difficulties, dtype=np.float64)
    per_bucket = _bucket_mass(difficulties, num_generations, weighting)
    if per_bucket is None:
        return np.ones_like(difficulties)
    _, inverse, counts = np.unique(difficulties, return_inverse=True, return_counts=True)
    return per_bucket / counts[inverse]


EXACT_DRAW_TASKS = 1024  # buckets holding at most this many tasks (or 16 per task to draw) are drawn from exactly
_DRAW_ROUNDS = 4  # rounds of rejection sampling before an exact draw finishes the job
_BUCKET_TRIES = 4  # draws within a bucket per round, 4 candidates each, before the bucket is scanned


def draw_replay_tasks(
    buckets: TaskBuckets,
    num: int,
    *,
    num_generations: int,
    weighting: str,
    rng: np.random.Generator,
    exact_below: int | None = None,
) -> list[int]:
    """Draw `num` distinct replayable tasks (ids), each draw weighted by `bucket_weights` over the replayable tasks
    (fewer when fewer are replayable); cost O(num), not O(tasks), while a fair share of the buckets' tasks can be
    replayed (else a few O(bucket) scans, or one O(tasks) pass to finish: still the same law).

    The law is that of ``rng.choice(replayable, num, replace=False, p=bucket_weights(...))``: successive draws, each
    among the tasks not drawn yet, with the weights of the whole replayable set. Buckets of at most `exact_below`
    tasks in all (default `EXACT_DRAW_TASKS`, at least 16 per task to draw) are drawn exactly so, over
    `buckets.listing()` (the very draw of `plan_replay` over that list). Larger ones by rejection, in rounds of
    independent draws whose repeats are dropped (the same law): a draw picks a bucket (``"uniform"``: in proportion
    to its size, ``"normal"``/``"linear"``: to its weight), then a task of it uniformly; a task that cannot be
    replayed is drawn again (``"uniform"``: bucket included; else within its bucket, whose weight is shared by its
    replayable tasks only). A bucket that keeps failing is scanned once: then drawn from among its replayable tasks
    (``"uniform"``: weighing their number), or dropped if it has none. What rounds leave undrawn is finished exactly,
    over the listing.
    """
    if num <= 0:
        return []
    members = {d: m for d, m in sorted(buckets.members.items()) if len(m)}
    total = sum(len(m) for m in members.values())
    limit = EXACT_DRAW_TASKS if exact_below is None else exact_below
    if total <= max(limit, 16 * num):
        return _draw_listed(buckets, num, num_generations, weighting, rng, [])
    order = list(members)  # difficulties, ascending
    mass = _bucket_mass(np.asarray(order, dtype=np.float64), num_generations, weighting)
    shared = mass is not None
    scanned: dict[int, np.ndarray] = {}  # difficulty -> its replayable tasks, once a bucket was scanned
    chosen: list[int] = []
    seen: set[int] = set()
    for _ in range(_DRAW_ROUNDS):
        need = num - len(chosen)
        live = [i for i, d in enumerate(order) if d not in scanned or len(scanned[d])]
        if need <= 0 or not live:
            break
        if shared:
            weights = mass[live]
        else:  # a task weighs 1: a bucket weighs its size (its replayable tasks once scanned)
            weights = np.array([len(scanned.get(order[i], members[order[i]])) for i in live], np.float64)
        slots = rng.choice(len(live), size=2 * need + 8, p=weights / weights.sum())
        picks = np.full(len(slots), -1, np.int64)
        for slot in np.unique(slots).tolist():
            where = np.nonzero(slots == slot)[0]
            difficulty = order[live[slot]]
            picks[where] = _from_bucket(buckets, members[difficulty], difficulty, len(where), shared, scanned, rng)
        for task in picks.tolist():
            if task >= 0 and task not in seen and len(chosen) < num:
                seen.add(task)
                chosen.append(task)
    if len(chosen) < num:
        chosen += _draw_listed(buckets, num - len(chosen), num_generations, weighting, rng, chosen)
    return chosen


def _from_bucket(buckets, members, difficulty, count, shared, scanned, rng) -> np.ndarray:
    """`count` replayable tasks of one bucket, each uniform among its replayable tasks (-1: rejected, for
    "uniform", or none replayable)."""
    known = scanned.get(difficulty)
    if known is not None:
        out = np.full(count, -1, np.int64)
        if len(known):
            out[:] = known[rng.integers(len(known), size=count)]
        return out
    if not shared:  # a rejected draw is drawn again from scratch (its bucket included): uniform over all tasks
        drawn = np.asarray(members[rng.integers(len(members), size=count)], np.int64)
        ok = buckets.replayable(drawn)
        if count >= 16 and 4 * int(ok.sum()) < count:  # mostly not replayable: scanned for the next rounds
            scanned[difficulty] = np.asarray(members, np.int64)[buckets.replayable(np.asarray(members))]
        return np.where(ok, drawn, -1)
    out = np.full(count, -1, np.int64)
    todo = np.arange(count)
    for _ in range(_BUCKET_TRIES):
        drawn = np.asarray(members[rng.integers(len(members), size=(len(todo), 4))], np.int64)
        ok = buckets.replayable(drawn.ravel()).reshape(drawn.shape)
        hit = ok.any(axis=1)
        out[todo[hit]] = drawn[hit, ok[hit].argmax(axis=1)]  # the first replayable of each slot's candidates
        todo = todo[~hit]
        if len(todo) == 0:
            return out
    # Few of this bucket are replayable: scan it once (O(bucket)) and draw among those.
    known = scanned[difficulty] = np.asarray(members, np.int64)[buckets.replayable(np.asarray(members))]
    if len(known):
        out[todo] = known[rng.integers(len(known), size=len(todo))]
    return out


def _draw_listed(buckets, num, num_generations, weighting, rng, taken: list[int]) -> list[int]:
    """Draw `num` of the listed replayable tasks not in `taken`, weights over the whole list (exact)."""
    ids, difficulties = buckets.listing()
    if len(taken):
        rest = ~np.isin(ids, np.asarray(taken, np.int64))
    else:
        rest = np.ones(len(ids), bool)
    target = min(num, int(rest.sum()))
    if target <= 0:
        return []
    weights = bucket_weights(difficulties, num_generations, weighting)[rest]
    chosen = rng.choice(len(weights), size=target, replace=False, p=weights / weights.sum())
    return np.asarray(ids)[rest][chosen].tolist()


def plan_replay(
    group_keys: Sequence[str],
    replayable: Sequence[tuple[str, int]] | TaskBuckets,
    *,
    num_tasks: int,
    num_generations: int,
    num_replayed: int,
    weighting: str = "uniform",
    seed: int | Sequence[int] = 0,
) -> ReplayPlan:
    """The replay groups of one generation batch: the pool tasks drawn to replay (among those `pool.rules.replayable`
    lets in, by bucket weight), and the group each replays in.

    Args:
        group_keys: task id of each group of the global batch, in order.
        replayable: (task id, difficulty) of the pool tasks that can be replayed now, or the pool's `TaskBuckets`
            (``ExperiencePool.replay_buckets``: the draw then costs O(groups), whatever the pool's size).
        num_tasks: how many groups to turn into replay tasks (the trainer's `replay_groups_due`; fewer if the pool
            holds fewer replayable tasks, at most every group).
        num_generations: G, the rollouts of a group.
        num_replayed: k, the replayed rollouts of a replayed group.
        weighting: how tasks are drawn over difficulty buckets (see `bucket_weights` and `draw_replay_tasks`).
        seed: seed of this draw (the trainer uses `(args.seed, global_step)`).

    A drawn task already present in the batch replays in (the first) group that holds it, so replay never puts a task
    in two groups of a batch; the other drawn tasks replace random groups whose task was not drawn (copies of drawn
    tasks only when no such group is left).
    """
    num_groups = len(group_keys)
    wanted = min(num_tasks, num_groups)
    if wanted <= 0:
        return ReplayPlan(num_generations, num_replayed, {})
    buckets = replayable if isinstance(replayable, TaskBuckets) else TaskBuckets.from_pairs(replayable)
    rng = np.random.default_rng(seed)
    chosen = draw_replay_tasks(buckets, wanted, num_generations=num_generations, weighting=weighting, rng=rng)
    if not chosen:
        return ReplayPlan(num_generations, num_replayed, {})
    drawn = buckets.names(chosen)

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


def plan_rescue(
    row_success: Sequence[bool | None],
    group_keys: Sequence[str],
    num_generations: int,
    num_rescued: int,
    has_successes: Sequence[bool],
    skip_groups: Sequence[int] = (),
) -> dict[int, str]:
    """The groups rescued after scoring (AR3PO's response reuse): group -> task, for each group whose fresh rows all
    failed (`row_success` per global row: True, False, or None for a row that does not count: replayed, or with no
    reward; at least one False, no True), whose task `has_successes` (the pool holds `num_rescued` of its successes),
    and that is not in `skip_groups` (replay groups, groups with guided rows). Its last `num_rescued` rows take the
    stored successes: the layout of a replay group, so the same tensors mark them. 0 rescues nothing.

    Example:

    ```pycon
    >>> # groups of 4: all failed (task a, stored); mixed (b); all failed (c, nothing stored); all failed, replayed (a)
    >>> plan_rescue([False] * 4 + [True, False, False, False] + [False] * 4 + [False, False, False, None],
    ...             ["a", "b", "c", "a"], 4, 1, [True, True, False, True], skip_groups=[3])
    {0: 'a'}

    ```
    """
    if num_rescued == 0:
        return {}
    skipped = set(skip_groups)
    rescued = {}
    for group, task in enumerate(group_keys):
        rows = row_success[group * num_generations : (group + 1) * num_generations]
        if group in skipped or not has_successes[group] or True in rows or False not in rows:
            continue
        rescued[group] = task
    return rescued
