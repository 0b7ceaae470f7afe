"""`PoolIndex`: what an `ExperiencePool` keeps in RAM, as NumPy arrays, and its state for a save (`to_state` /
`from_state`); `TaskBuckets`: the view of its buckets that replay draws from.

Per task (dense index ``t``): its bucket (difficulty, -1: none), order stamps (bucket, skip set, store; -1: not in
that set), whether its dataset row is known, and the keys of its stored trajectories in store order (`slots`, `count`).
Per trajectory key: its task, entropy, policy version and id. Tasks that hold trajectories also sit in one
array per bucket (`members`), kept as tasks move (O(1) each: a leaving task's place takes its array's last one), so
that a replay draw costs O(batch), not O(tasks). The index knows nothing of files: the pool keeps each key's row in its
log (`store.Log`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .rules import replayable

__all__ = ["COUNTERS", "PoolIndex", "TaskBuckets", "grow"]

COUNTERS = ("next_traj_id", "num_outcomes", "stamp")
# Per-task arrays with their fill for a new task.
_TASK_ARRAYS = (
    ("difficulty", np.int32, -1),
    ("difficulty_order", np.int64, -1),
    ("skip_order", np.int64, -1),
    ("store_order", np.int64, -1),
    ("has_row", np.bool_, False),  # a dataset row is known (the pool that holds rows keeps it)
    ("count", np.int32, 0),
    ("bucket_at", np.int32, -1),
    ("bucket_pos", np.int32, -1),
)
_KEY_ARRAYS = (
    ("key_task", np.int32),
    ("key_entropy", np.float32),
    ("key_version", np.int64),
    ("key_traj_id", np.int64),
)
# What a save records per task (besides its trajectories' keys), in the tasks table's column order.
STATE_COLUMNS = ("difficulty", "difficulty_order", "bucket_pos", "skip_order", "store_order")
# The slots a task has at first (its capacity if lower); `append_slot` doubles them when a task needs more. Not the
# capacity itself: a pool's settings (a saved one's are untrusted) would then size a tasks x capacity matrix.
_FIRST_WIDTH = 8


def grow(array: np.ndarray, size: int, fill) -> np.ndarray:
    """`array` in a larger buffer of `size` (None `fill`: the new entries are set when first used)."""
    grown = np.empty(size, dtype=array.dtype)  # untouched capacity costs address space, not memory
    grown[: len(array)] = array
    if fill is not None:
        grown[len(array) :] = fill
    return grown


@dataclass(frozen=True)
class TaskBuckets:
    """Tasks by difficulty bucket, to draw replay tasks from without listing the replayable ones first.

    Tasks are integer ids (a `PoolIndex`'s task indices; `from_pairs`: positions in a list).

    Attributes:
        members: difficulty -> ids of the bucket's tasks (replayable now or not), in a fixed order.
        replayable: ``ids -> bool mask``: which of `ids` can be replayed now (cheap for a few ids).
        listing: ``() -> (ids, difficulties)`` of every replayable task, in a fixed order: an O(tasks) pass, used
            only when the buckets are small, or to finish a draw that rejection sampling cannot.
        names: ``ids -> task ids``.
    """

    members: Mapping[int, np.ndarray]
    replayable: Callable[[np.ndarray], np.ndarray]
    listing: Callable[[], tuple[np.ndarray, np.ndarray]]
    names: Callable[[Sequence[int]], list[str]]

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[str, int]]) -> TaskBuckets:
        """Buckets of a list of (task id, difficulty), every one of them replayable."""
        difficulties = np.asarray([d for _, d in pairs], dtype=np.int64)
        ids = np.arange(len(pairs), dtype=np.int64)
        return cls(
            members={int(d): ids[difficulties == d] for d in np.unique(difficulties).tolist()},
            replayable=lambda chosen: np.ones(len(chosen), bool),
            listing=lambda: (ids, difficulties),
            names=lambda chosen: [pairs[i][0] for i in chosen],
        )


@dataclass
class PoolIndex:
    """The pool's index (see the module docstring); `capacity` is the trajectories a task may hold."""

    capacity: int
    next_traj_id: int = 0
    num_outcomes: int = 0
    stamp: int = 0  # order of bucket entries, skip set entries and stores (dict insertion order, as numbers)
    task_ids: list[str] = field(default_factory=list)
    task_index: dict[str, int] = field(default_factory=dict)
    num_stored_tasks: int = 0
    num_live: int = 0
    members: dict[int, np.ndarray] = field(default_factory=dict)  # difficulty -> task indices (first `bucket_len`)
    bucket_len: dict[int, int] = field(default_factory=dict)
    num_keys: int = 0  # trajectory keys handed out (a key indexes the key arrays and the pool's trajectory log)
    free_keys: list[int] = field(default_factory=list)  # the keys of removed trajectories, handed out again first

    def __post_init__(self):
        for name, dtype, _ in _TASK_ARRAYS:
            setattr(self, name, np.empty(0, dtype))
        for name, dtype in _KEY_ARRAYS:
            setattr(self, name, np.empty(0, dtype))
        self.slots = np.full((0, max(1, min(self.capacity, _FIRST_WIDTH))), -1, np.int32)  # keys, in store order

    # ------------------------------------------------------------------------------------------------- growth
    def next_stamp(self) -> int:
        self.stamp += 1
        return self.stamp

    def task(self, task_id: str) -> int:
        """The index of `task_id`, added now if new."""
        index = self.task_index.get(task_id)
        if index is None:
            index = len(self.task_ids)
            self.ensure_tasks(index + 1)
            self.task_ids.append(task_id)
            self.task_index[task_id] = index
        return index

    def ensure_tasks(self, size: int) -> None:
        if size <= len(self.difficulty):
            return
        grown = max(256, 2 * len(self.difficulty), size)
        for name, _, fill in _TASK_ARRAYS:
            setattr(self, name, grow(getattr(self, name), grown, fill))
        slots = np.full((grown, self.slots.shape[1]), -1, np.int32)
        slots[: len(self.slots)] = self.slots
        self.slots = slots

    def ensure_keys(self, size: int) -> None:
        if size > len(self.key_task):
            grown = max(1024, 2 * len(self.key_task), size)
            for name, _ in _KEY_ARRAYS:
                setattr(self, name, grow(getattr(self, name), grown, None))  # written when a key is used

    def new_key(self) -> int:
        if self.free_keys:
            return self.free_keys.pop()
        self.num_keys += 1
        self.ensure_keys(self.num_keys)
        return self.num_keys - 1

    def set_key(self, key: int, task: int, entropy: float, version: int, traj_id: int) -> None:
        self.ensure_keys(key + 1)
        self.key_task[key], self.key_entropy[key], self.key_version[key] = task, entropy, version
        self.key_traj_id[key] = traj_id

    # ------------------------------------------------------------------------------------------------ buckets
    def set_difficulty(self, t: int, difficulty: int) -> None:
        """Move task `t` to the bucket of `difficulty` (-1: to none)."""
        self.difficulty[t] = difficulty
        self.place_in_bucket(t)

    def place_in_bucket(self, t: int) -> None:
        """Put task `t` in the array of its bucket if it holds trajectories, else in none (after either changed)."""
        want = int(self.difficulty[t]) if self.count[t] > 0 else -1
        have = int(self.bucket_at[t])
        if want == have:
            return
        if have >= 0:
            place, last = int(self.bucket_pos[t]), self.bucket_len[have] - 1
            members = self.members[have]
            moved = int(members[last])
            members[place] = moved
            self.bucket_pos[moved] = place
            self.bucket_len[have] = last
        self.bucket_at[t] = want
        self.bucket_pos[t] = -1
        if want >= 0:
            n = self.bucket_len.get(want, 0)
            members = self.members.get(want)
            if members is None or n == len(members):
                members = self.members[want] = grow(
                    members if members is not None else np.empty(0, np.int32), max(16, 2 * n), None
                )
            members[n] = t
            self.bucket_pos[t] = n
            self.bucket_len[want] = n + 1

    def rebuild_buckets(self, places: np.ndarray | None = None) -> None:
        """The bucket arrays from the difficulties and counts: tasks at their saved `places` when these are
        consistent, else in bucket order."""
        n = len(self.task_ids)
        tasks = np.nonzero((self.difficulty[:n] >= 0) & (self.count[:n] > 0))[0]
        tasks = tasks[np.argsort(self.difficulty_order[tasks], kind="stable")]
        difficulties = self.difficulty[tasks]
        self.members, self.bucket_len = {}, {}
        self.bucket_at[:n] = -1
        self.bucket_pos[:n] = -1
        for difficulty in np.unique(difficulties).tolist():
            members = tasks[difficulties == difficulty].astype(np.int32)
            if places is not None:
                at = places[members]
                if np.array_equal(np.sort(at), np.arange(len(members))):
                    members = members[np.argsort(at)]
            self.members[difficulty] = members
            self.bucket_len[difficulty] = len(members)
            self.bucket_at[members] = difficulty
            self.bucket_pos[members] = np.arange(len(members), dtype=np.int32)

    # -------------------------------------------------------------------------------------------------- slots
    def append_slot(self, t: int, key: int) -> None:
        n = int(self.count[t])
        if n == self.slots.shape[1]:  # a task with more trajectories than it had slots for (`_FIRST_WIDTH`)
            more = max(1, min(n, self.capacity - n))  # doubled, up to the capacity
            self.slots = np.concatenate([self.slots, np.full((len(self.slots), more), -1, np.int32)], axis=1)
        self.slots[t, n] = key
        self.count[t] = n + 1
        self.num_live += 1
        if n == 0:
            self.num_stored_tasks += 1
            self.store_order[t] = self.next_stamp()
            self.place_in_bucket(t)

    def replace_slot(self, t: int, i: int, key: int) -> int:
        """Put `key` at position `i` of task `t`; returns the key it replaced."""
        old = int(self.slots[t, i])
        self.slots[t, i] = key
        return old

    def shift_append(self, t: int, i: int, key: int) -> int:
        """Remove position `i` of task `t` and append `key` (list.pop(i), then append); returns the removed key."""
        n = int(self.count[t])
        row = self.slots[t]
        old = int(row[i])
        row[i : n - 1] = row[i + 1 : n].copy()
        row[n - 1] = key
        return old

    def remove_slot(self, t: int, i: int) -> int:
        """Remove position `i` of task `t` (list.pop(i)); returns its key."""
        n = int(self.count[t])
        row = self.slots[t]
        old = int(row[i])
        row[i : n - 1] = row[i + 1 : n].copy()
        row[n - 1] = -1
        self.count[t] = n - 1
        self.num_live -= 1
        if n == 1:
            self.num_stored_tasks -= 1
            self.place_in_bucket(t)
        return old

    def clear(self, t: int) -> list[int]:
        """Empty task `t`'s store; returns its keys."""
        n = int(self.count[t])
        keys = self.slots[t, :n].tolist()
        self.slots[t, :n] = -1
        self.count[t] = 0
        self.num_live -= n
        if n:
            self.num_stored_tasks -= 1
            self.place_in_bucket(t)
        self.store_order[t] = -1
        return keys

    # ------------------------------------------------------------------------------------------------ queries
    def ordered(self, order: np.ndarray) -> np.ndarray:
        """Task indices whose `order` stamp is set, in stamp order."""
        n = len(self.task_ids)
        tasks = np.nonzero(order[:n] >= 0)[0]
        return tasks[np.argsort(order[tasks], kind="stable")]

    def keys(self, t: int, current_step=None, max_policy_age=None) -> list[int]:
        """Task `t`'s trajectory keys in store order (with both arguments: those young enough to replay)."""
        keys = self.slots[t, : self.count[t]]
        if max_policy_age is None or current_step is None:
            return keys.tolist()
        return keys[current_step - self.key_version[keys] <= max_policy_age].tolist()

    def replayable(self, tasks: np.ndarray, min_trajectories: int, current_step, max_policy_age) -> np.ndarray:
        """Mask of `tasks` (indices) that can be replayed now (`rules.replayable`, on the index's arrays)."""
        skipped = self.skip_order[tasks] >= 0
        ok = replayable(self.difficulty[tasks], skipped, self.has_row[tasks], self.count[tasks], min_trajectories)
        if max_policy_age is not None and current_step is not None and ok.any():
            # Only the young trajectories can be selected: count them for the tasks still in (none holds more than
            # `count`), O(tasks x slots) on the index, no trajectory read.
            slots = self.slots[tasks[ok]]
            valid = slots >= 0
            valid &= current_step - self.key_version[np.where(valid, slots, 0)] <= max_policy_age
            ok[ok] = valid.sum(axis=1) >= min_trajectories
        return ok

    def replayable_listing(self, min_trajectories, current_step, max_policy_age):
        """(task indices, difficulties) of the replayable tasks, in bucket order."""
        tasks = self.ordered(self.difficulty_order)
        tasks = tasks[self.replayable(tasks, min_trajectories, current_step, max_policy_age)]
        return tasks, self.difficulty[tasks]

    def buckets(self, min_trajectories, current_step, max_policy_age, names) -> TaskBuckets:
        """The buckets' tasks that hold trajectories, as `TaskBuckets` (`names`: task indices -> task ids)."""
        args = (min_trajectories, current_step, max_policy_age)
        return TaskBuckets(
            members={d: self.members[d][:n] for d, n in sorted(self.bucket_len.items()) if n},
            replayable=lambda tasks: self.replayable(np.asarray(tasks, np.int64), *args),
            listing=lambda: self.replayable_listing(*args),
            names=names,
        )

    # -------------------------------------------------------------------------------------------------- state
    def to_state(self) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """What a save records: the per-task columns (`STATE_COLUMNS`, ``task_id`` and ``has_row``), and each task's
        trajectory keys in store order as (offsets, keys)."""
        n = len(self.task_ids)
        columns = {"task_id": self.task_ids, "has_row": self.has_row[:n]}
        columns.update({name: getattr(self, name)[:n] for name in STATE_COLUMNS})
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(self.count[:n], out=offsets[1:])
        slots = self.slots[:n]
        return columns, offsets, slots[slots >= 0].astype(np.int64)

    @classmethod
    def from_state(
        cls, capacity: int, counters: dict, columns: dict, entry_task: np.ndarray, entry_key: np.ndarray
    ) -> PoolIndex:
        """The index a save recorded (its counters and `to_state`'s columns, ``has_row`` those of the loaded rows),
        with the trajectory keys `entry_key` of tasks `entry_task`, listed task by task in store order (the keys'
        own arrays are set by the caller, `set_key` or directly)."""
        index = cls(capacity, **{name: int(counters[name]) for name in COUNTERS})
        index.task_ids = list(columns["task_id"])
        index.task_index = {task_id: i for i, task_id in enumerate(index.task_ids)}
        n = len(index.task_ids)
        index.ensure_tasks(n)
        for name in ("has_row", *STATE_COLUMNS):
            getattr(index, name)[:n] = columns[name]
        counts = np.bincount(entry_task, minlength=n).astype(np.int32) if n else np.zeros(0, np.int32)
        width = max(1, min(capacity, _FIRST_WIDTH), int(counts.max(initial=0)))  # the lists found, not capacity
        index.slots = np.full((len(index.difficulty), width), -1, np.int32)
        starts = np.cumsum(counts) - counts
        index.slots[entry_task, np.arange(len(entry_key)) - starts[entry_task]] = entry_key
        index.count[:n] = counts
        index.store_order[:n][counts == 0] = -1
        index.num_live = index.num_keys = len(entry_key)
        index.num_stored_tasks = int((counts > 0).sum())
        index.rebuild_buckets(columns["bucket_pos"])
        return index
