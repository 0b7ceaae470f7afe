"""`ExperiencePool`: past successful trajectories per task, difficulty buckets and the skip set.

Semantics follow the ExGRPO / AgentEvolver design (seed 000, section 3.1; seed 001, section 2.11):

* a task's difficulty is its number of successes among its fresh rollouts of one step; a task lives in exactly one
  bucket, the one of its latest difficulty;
* a task solved by every fresh rollout enters the skip set and leaves the buckets and the store; a task of the skip
  set that stops being fully solved leaves it;
* a task's successful trajectories are stored only when ``lbound < successes < rbound``;
* each task stores at most ``max_trajectories_per_task``; at capacity, ``argmin`` keeps the lowest-entropy
  trajectories, ``argmax`` the highest, ``random`` evicts the oldest (FIFO).

Storage (`trl_exreplay.pool_store`): the trajectories and the tasks' dataset rows live in memory-mapped Arrow shards;
RAM holds an index only: per trajectory its task, entropy, policy version, id and store rank (~40 bytes), per task
its bucket, order stamps and the keys of its trajectories. Appends are buffered and written by a background thread;
an evicted trajectory leaves a tombstone that compaction removes. Replay queries touch the index and read only the
trajectories they return; the buckets are also kept as arrays of task indices (O(1) per move, saved with the pool),
from which the trainer draws replay tasks in O(batch) (`replay_buckets`, `planner.plan_replay`). `save` is incremental
and atomic (no pickle anywhere); `push_to_hub` / `from_hub` share a pool as a `datasets` dataset repository, and a
pool refuses a tokenizer other than the one it was recorded with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from .planner import TaskBuckets
from .pool_check import (
    CHECKSUM,
    SETTINGS,
    TASKS_SCHEMA,
    PoolFolder,
    PoolFormatError,
    bad_trajectory_rows,
    check_arrow,
    check_settings,
    check_tasks_table,
    file_checksum,
    state_checksum,
    trajectory_problem,
)
from .pool_store import (
    FORMAT_VERSION,
    HISTORY_DIR,
    STATE_FILE,
    TASK_ROW_SCHEMA,
    TASK_ROWS_DIR,
    TASKS_DIR,
    TRAJECTORIES_DIR,
    TRAJECTORY_FEATURES,
    TRAJECTORY_SCHEMA,
    Scratch,
    Shard,
    ShardLog,
    Writer,
    _grow,
    fsync_path,
    invalid_rows,
    prune,
    read_arrow,
    read_state,
    trim_heap,
    write_arrow,
    write_atomic,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

__all__ = ["ExperiencePool", "TaskOutcome", "Trajectory", "task_key", "tokenizer_fingerprint"]


@dataclass
class Trajectory:
    """One stored rollout of a task (token ids, not text, so it is replayed exactly as it was generated)."""

    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]  # 1 on model tokens (trained), 0 on environment / template tokens
    logps: list[float]  # behaviour-policy log-prob of each completion token (0 where completion_mask is 0)
    rewards: list[float]  # one per reward function, as recorded
    reward: float  # total (weighted) reward
    entropy: float  # mean entropy over model tokens under the generating policy
    policy_version: int  # optimizer step of the generating policy
    traj_id: int = -1  # assigned by the pool

    def __post_init__(self):
        # Normalise to the stored dtypes so a saved and reloaded pool is bit-identical to the live one.
        for name in ("rewards", "reward", "entropy", "policy_version", "traj_id", "logps"):
            if getattr(self, name) is None:
                raise ValueError(f"Trajectory of task {self.task_id!r}: `{name}` is missing.")
        if not isinstance(self.rewards, (list, tuple, np.ndarray)):
            raise ValueError(f"Trajectory of task {self.task_id!r}: `rewards` must be a list, got {self.rewards!r}.")
        self.traj_id = int(self.traj_id)
        self.prompt_ids = [int(x) for x in self.prompt_ids]
        self.completion_ids = [int(x) for x in self.completion_ids]
        self.completion_mask = [int(x) for x in self.completion_mask]
        self.logps = np.asarray(self.logps, dtype=np.float32).tolist()
        self.rewards = np.asarray(self.rewards, dtype=np.float32).tolist()
        self.reward = float(np.float32(self.reward))
        self.entropy = float(np.float32(self.entropy))
        self.policy_version = int(self.policy_version)
        n = len(self.completion_ids)
        if len(self.completion_mask) != n or len(self.logps) != n:
            raise ValueError(
                f"Trajectory of task {self.task_id!r}: completion_ids ({n}), completion_mask "
                f"({len(self.completion_mask)}) and logps ({len(self.logps)}) must have the same length."
            )


class _LazyList:
    """A token list of a `Trajectory` read by `ExperiencePool.sample`: kept as the bytes read, converted to the list
    (and kept) on first access, so that a sample pays for Python lists only where they are used.

    A non-data descriptor: an instance's own value (every trajectory built normally has one) is found first, at no
    cost; this runs only for a lazily read one.
    """

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, trajectory, owner=None):
        if trajectory is None:
            return self
        fields = trajectory.__dict__
        lazy = fields.get("_lazy")
        if lazy is None or self.name not in lazy:
            raise AttributeError(f"{type(trajectory).__name__!r} object has no attribute {self.name!r}")
        convert, data = lazy[self.name]
        value = fields[self.name] = convert(data)
        lazy.pop(self.name, None)
        if not lazy:
            fields.pop("_lazy", None)
        return value


@dataclass
class TaskOutcome:
    """What one generation step says about a task: its fresh rollouts, and the successful ones as trajectories."""

    task_id: str
    successes: int
    num_fresh: int
    successful: list[Trajectory] = field(default_factory=list)
    task_row: str | None = None  # JSON of the dataset row, so a replayed task can be rolled out again


# Columns of a trajectory shard that must be present and non-null for the row to be replayable.
_REQUIRED = (
    "prompt_ids",
    "completion_ids",
    "completion_mask",
    "logps",
    "rewards",
    "reward",
    "entropy",
    "policy_version",
    "traj_id",
    "store_seq",
)
_SAME_LENGTH = ("completion_ids", "completion_mask", "logps")
_INDEX_COLUMNS = ("traj_id", "entropy", "policy_version", "store_seq")  # what the RAM index keeps of a trajectory
_SLOT_COLUMNS = ("traj_shard", "traj_row", "traj_id")  # where a snapshot's tasks table says each trajectory is
_STORED_COLUMNS = ("prompt_ids", "completion_ids", "completion_mask", "logps", "rewards", "reward")  # read back
_TOKEN_COLUMNS = ("prompt_ids", "completion_ids", "completion_mask", "logps")  # one value per token
for _name in _TOKEN_COLUMNS:  # after @dataclass: its fields and methods are unchanged
    setattr(Trajectory, _name, _LazyList(_name))
del _name
_LIST_DTYPES = (
    ("prompt_ids", np.int32),
    ("completion_ids", np.int32),
    ("completion_mask", np.int8),
    ("logps", np.float32),
    ("rewards", np.float32),
)


class ExperiencePool:
    """Replay pool of successful trajectories per task.

    Args:
        max_trajectories_per_task: capacity per task.
        experience_lbound, experience_rbound: a task's trajectories are stored when lbound < successes < rbound.
        exp_select_mode: ``"argmin"``, ``"argmax"`` or ``"random"``: replay selection and eviction policy.
        pool_store_mode: ``"all"`` stores every success of a qualifying task, ``"best"`` only the best by entropy.
        max_policy_age: a full task first evicts trajectories older than this many policy versions (`sample` also
            skips them); None: no limit.
        replay_window: `sample` draws only among the `replay_window` most recently stored trajectories (RLinf's
            sample window; evicted ones still count in it); None: the whole pool.
        seed: seed of the random choices the pool makes itself (``random`` store/eviction ties, `sample`).
        work_dir: folder under which the live pool writes its shards (a private subfolder, deleted with the pool);
            None: the system temporary folder. Put it on the disk of your checkpoints, not on a tmpfs.
        shard_rows: trajectories per shard file (at most; a shard is also closed at 16 MB, and by a save).

    Example:

    ```python
    from trl_exreplay import ExperiencePool
    from trl_exreplay.pool import TaskOutcome, Trajectory

    pool = ExperiencePool(experience_rbound=4)
    traj = Trajectory("t1", [1, 2], [3, 4], [1, 1], [-0.5, -0.7], [1.0], 1.0, entropy=0.9, policy_version=3)
    pool.record_outcome(TaskOutcome("t1", successes=2, num_fresh=4, successful=[traj], task_row='{"prompt": "hi"}'))
    assert pool.bucket_of("t1") == 2 and pool.num_trajectories == 1
    assert [t.traj_id for t in pool.sample(1)] == [0]
    pool.save("pool_dir")  # then only new shards and the small state on each save
    assert ExperiencePool.load("pool_dir").content_hash() == pool.content_hash()
    ```
    """

    def __init__(
        self,
        max_trajectories_per_task: int = 5,
        experience_lbound: int = 0,
        experience_rbound: int = 8,
        exp_select_mode: str = "argmin",
        pool_store_mode: str = "all",
        max_policy_age: int | None = None,
        replay_window: int | None = None,
        seed: int = 0,
        *,
        work_dir: str | None = None,
        shard_rows: int = 1024,
    ):
        self.max_trajectories_per_task = max_trajectories_per_task
        self.experience_lbound = experience_lbound
        self.experience_rbound = experience_rbound
        self.exp_select_mode = exp_select_mode
        self.pool_store_mode = pool_store_mode
        self.max_policy_age = max_policy_age
        self.replay_window = replay_window
        self.seed = seed
        _check_settings(self._settings())
        self.tokenizer_fingerprint: str | None = None  # of the tokenizer whose ids the trajectories hold
        self.rejected_reasons: Counter = Counter()  # rows refused (at load, or when added), by reason
        self.vocab_size: int | None = None  # token ids must be below it (None: unchecked), see `set_vocab_size`
        self._next_traj_id = 0
        self._num_outcomes = 0
        self._stored_count = 0  # trajectories ever stored: store_seq of the next one
        self._stamp = 0  # order of bucket entries, skip set entries and stores (dict insertion order, as numbers)
        # Per task, by dense index. difficulty -1: in no bucket; an order -1: not in that ordered set.
        self._task_index: dict[str, int] = {}
        self._task_ids: list[str] = []
        self._difficulty = np.empty(0, np.int32)
        self._difficulty_order = np.empty(0, np.int64)
        self._skip_order = np.empty(0, np.int64)
        self._store_order = np.empty(0, np.int64)
        self._row_key = np.empty(0, np.int64)  # key of the task's row in the task row log, -1: none
        # The buckets' tasks that hold trajectories (the others cannot be replayed), as arrays of task indices kept as
        # tasks move (O(1) each: a leaving task's place takes its array's last one), so that replay draws cost
        # O(batch) (`replay_buckets`). Saved, so that a loaded pool draws as the live one.
        self._bucket_at = np.empty(0, np.int32)  # the difficulty of the task's array, -1: in none
        self._bucket_pos = np.empty(0, np.int32)  # the task's place in it
        self._members: dict[int, np.ndarray] = {}  # difficulty -> task indices (the first `_bucket_len[d]`)
        self._bucket_len: dict[int, int] = {}
        self._count = np.empty(0, np.int32)
        self._slots = np.full((0, max(1, max_trajectories_per_task)), -1, np.int32)  # trajectory keys, store order
        self._num_stored_tasks = 0
        self._num_live = 0
        # Per trajectory, by the key the trajectory log gave it.
        self._key_task = np.empty(0, np.int32)
        self._key_entropy = np.empty(0, np.float32)
        self._key_version = np.empty(0, np.int64)
        self._key_traj_id = np.empty(0, np.int64)
        self._key_seq = np.empty(0, np.int64)
        self._writer = Writer()
        self._scratch = Scratch(work_dir)
        self._trajectories = ShardLog(
            TRAJECTORIES_DIR,
            "traj",
            TRAJECTORY_SCHEMA,
            _trajectory_batch,
            self._writer,
            self._scratch,
            shard_rows,
            read_columns=_STORED_COLUMNS,
            keep_open=True,
        )
        self._task_rows = ShardLog(
            TASK_ROWS_DIR,
            "rows",
            TASK_ROW_SCHEMA,
            _task_row_batch,
            self._writer,
            self._scratch,
            shard_rows,
            read_columns=("task_row",),
        )
        self._finalizer = weakref.finalize(
            self, _close_storage, self._writer, self._scratch, (self._trajectories, self._task_rows)
        )

    @property
    def rejected_rows(self) -> int:
        """Rows refused, at load or when added (their reasons: `rejected_reasons`); none of them is ever replayed."""
        return sum(self.rejected_reasons.values())

    # ----------------------------------------------------------------------------------------------- updates
    def record_outcome(self, outcome: TaskOutcome) -> None:
        """Update buckets, skip set and store with one task's outcome of one step."""
        self._num_outcomes += 1
        t = self._task(outcome.task_id)
        if outcome.task_row is not None:
            self._set_task_row(t, outcome.task_row)
        if outcome.num_fresh > 0 and outcome.successes == outcome.num_fresh:
            if self._skip_order[t] < 0:  # a set: a task already in it keeps its place
                self._skip_order[t] = self._next_stamp()
            self._set_difficulty(t, -1)
            self._difficulty_order[t] = -1
            self._clear_store(t)
            return
        self._skip_order[t] = -1
        self._set_difficulty(t, outcome.successes)
        self._difficulty_order[t] = self._next_stamp()  # bucket order follows the latest update
        if not (self.experience_lbound < outcome.successes < self.experience_rbound):
            return
        successful = list(outcome.successful)
        if self.pool_store_mode == "best" and successful:
            successful = [self._best(successful)]
        for trajectory in successful:
            self.add(trajectory)

    def add(self, trajectory: Trajectory) -> bool:
        """Store one trajectory under its task, evicting at capacity; returns whether it was kept.

        The pool keeps a copy (later changes to `trajectory` do not reach it), written to a shard off this thread.
        A trajectory a model cannot be trained on (non-finite log-prob, reward or entropy, a mask value other than
        0/1, a token id < 0 or >= `vocab_size`) is refused and counted in `rejected_reasons`.
        """
        problem = trajectory_problem(trajectory, self.vocab_size)
        if problem is not None:
            self._reject(problem, 1, f"a trajectory of task {trajectory.task_id!r}")
            return False
        trajectory.traj_id = self._next_traj_id
        self._next_traj_id += 1
        t = self._task(trajectory.task_id)
        n = int(self._count[t])
        if n < self.max_trajectories_per_task:
            self._append_slot(t, trajectory)
            return True
        keys = self._slots[t, :n].tolist()
        ids = self._key_traj_id[keys].tolist()
        if self.max_policy_age is not None:
            # Trajectories too old to replay would otherwise hold their slots forever: they go first.
            versions = self._key_version[keys].tolist()
            stale = [i for i in range(n) if trajectory.policy_version - versions[i] > self.max_policy_age]
            if stale:
                oldest = min(stale, key=lambda i: (versions[i], ids[i]))
                self._shift_append(t, oldest, trajectory)
                return True
        entropies = self._key_entropy[keys].tolist()
        if self.exp_select_mode == "argmin":
            worst = max(range(n), key=lambda i: (entropies[i], ids[i]))
            if trajectory.entropy < entropies[worst]:
                self._replace_slot(t, worst, trajectory)
                return True
            return False
        if self.exp_select_mode == "argmax":
            worst = min(range(n), key=lambda i: (entropies[i], -ids[i]))
            if trajectory.entropy > entropies[worst]:
                self._replace_slot(t, worst, trajectory)
                return True
            return False
        self._shift_append(t, 0, trajectory)  # FIFO
        return True

    def _reject(self, reason: str, count: int, what: str) -> None:
        if reason not in self.rejected_reasons:
            logger.warning(
                "trl_exreplay: %s was refused by the experience pool (%s); counted in pool rejected_rows (logged "
                "once per reason).",
                what,
                reason,
            )
        self.rejected_reasons[reason] += count

    def set_vocab_size(self, vocab_size: int) -> int:
        """Refuse token ids >= `vocab_size` from now on, and remove (and count) the stored trajectories holding one
        (a pool given to a model with a smaller vocabulary would otherwise fail with an IndexError mid-training).
        Reads the token columns of the stored trajectories once; returns how many were removed."""
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}.")
        self.vocab_size = vocab_size
        self.flush(wait=True)
        n = len(self._task_ids)
        tasks, places = np.nonzero(self._slots[:n] >= 0)
        keys = self._slots[tasks, places].astype(np.int64)
        locations = self._trajectories.locations(keys)
        bad_keys = []
        for sid in np.unique(locations >> 32).tolist():
            mine = np.nonzero((locations >> 32) == sid)[0]
            shard = self._trajectories.shards[sid]
            bad, why = bad_trajectory_rows(shard.table(), locations[mine] & 0xFFFFFFFF, vocab_size)
            shard.release()
            for reason, count in why.items():
                self._reject(reason, count, f"{count} stored trajectory(ies)")
            bad_keys += keys[mine[bad]].tolist()
        for key in bad_keys:
            t = int(self._key_task[key])
            self._remove_slot(t, self._slots[t, : self._count[t]].tolist().index(key))
        return len(bad_keys)

    def configure(self, **settings) -> list[str]:
        """Apply settings (the constructor's keyword arguments); returns the names whose value changed."""
        for name in settings:
            if name not in SETTINGS:
                raise ValueError(f"Unknown ExperiencePool setting {name!r}: allowed {', '.join(SETTINGS)}.")
        _check_settings({**self._settings(), **settings})
        changed = []
        for name, value in settings.items():
            if getattr(self, name) != value:
                changed.append(name)
                setattr(self, name, value)
        return changed

    def bind_tokenizer(self, fingerprint: str, source: str = "this experience pool") -> None:
        """Record the tokenizer (its `tokenizer_fingerprint`) the pool's token ids belong to; refuse another one."""
        if self.tokenizer_fingerprint is None:
            self.tokenizer_fingerprint = fingerprint
        elif self.tokenizer_fingerprint != fingerprint:
            raise ValueError(
                f"The experience pool from {source} was recorded with another tokenizer (fingerprint "
                f"{self.tokenizer_fingerprint[:16]}..., this one {fingerprint[:16]}...): its token ids would be read "
                "as other tokens. Use the tokenizer the pool was recorded with, or start from an empty pool."
            )

    def _best(self, trajectories: Sequence[Trajectory]) -> Trajectory:
        if self.exp_select_mode == "argmin":
            return min(trajectories, key=lambda t: t.entropy)
        if self.exp_select_mode == "argmax":
            return max(trajectories, key=lambda t: t.entropy)
        rng = np.random.default_rng([self.seed, self._num_outcomes])
        return trajectories[int(rng.integers(len(trajectories)))]

    def _next_stamp(self) -> int:
        self._stamp += 1
        return self._stamp

    def _task(self, task_id: str) -> int:
        index = self._task_index.get(task_id)
        if index is None:
            index = len(self._task_ids)
            self._ensure_tasks(index + 1)
            self._task_ids.append(task_id)
            self._task_index[task_id] = index
        return index

    def _ensure_tasks(self, size: int) -> None:
        if size <= len(self._difficulty):
            return
        grown = max(256, 2 * len(self._difficulty), size)
        for name, fill in (
            ("_difficulty", -1),
            ("_difficulty_order", -1),
            ("_skip_order", -1),
            ("_store_order", -1),
            ("_row_key", -1),
            ("_count", 0),
            ("_bucket_at", -1),
            ("_bucket_pos", -1),
        ):
            setattr(self, name, _grow(getattr(self, name), grown, fill))
        slots = np.full((grown, self._slots.shape[1]), -1, np.int32)
        slots[: len(self._slots)] = self._slots
        self._slots = slots

    def _ensure_keys(self, size: int) -> None:
        if size <= len(self._key_task):
            return
        grown = max(1024, 2 * len(self._key_task), size)
        for name in ("_key_task", "_key_entropy", "_key_version", "_key_traj_id", "_key_seq"):
            setattr(self, name, _grow(getattr(self, name), grown, None))  # written when a key is used

    def _set_difficulty(self, t: int, difficulty: int) -> None:
        """Move task `t` to the bucket of `difficulty` (-1: to none)."""
        self._difficulty[t] = difficulty
        self._place_in_bucket(t)

    def _place_in_bucket(self, t: int) -> None:
        """Put task `t` in the array of its bucket if it holds trajectories, else in none (after either changed)."""
        want = int(self._difficulty[t]) if self._count[t] > 0 else -1
        have = int(self._bucket_at[t])
        if want == have:
            return
        if have >= 0:
            place, last = int(self._bucket_pos[t]), self._bucket_len[have] - 1
            members = self._members[have]
            moved = int(members[last])
            members[place] = moved
            self._bucket_pos[moved] = place
            self._bucket_len[have] = last
        self._bucket_at[t] = want
        self._bucket_pos[t] = -1
        if want >= 0:
            n = self._bucket_len.get(want, 0)
            members = self._members.get(want)
            if members is None or n == len(members):
                members = self._members[want] = _grow(
                    members if members is not None else np.empty(0, np.int32), max(16, 2 * n), None
                )
            members[n] = t
            self._bucket_pos[t] = n
            self._bucket_len[want] = n + 1

    def _rebuild_buckets(self, places: np.ndarray | None = None) -> None:
        """The bucket arrays from the difficulties and counts: tasks at their saved `places` when these are
        consistent, else in bucket order."""
        n = len(self._task_ids)
        tasks = np.nonzero((self._difficulty[:n] >= 0) & (self._count[:n] > 0))[0]
        tasks = tasks[np.argsort(self._difficulty_order[tasks], kind="stable")]
        difficulties = self._difficulty[tasks]
        self._members, self._bucket_len = {}, {}
        self._bucket_at[:n] = -1
        self._bucket_pos[:n] = -1
        for difficulty in np.unique(difficulties).tolist():
            members = tasks[difficulties == difficulty].astype(np.int32)
            if places is not None:
                at = places[members]
                if np.array_equal(np.sort(at), np.arange(len(members))):
                    members = members[np.argsort(at)]
            self._members[difficulty] = members
            self._bucket_len[difficulty] = len(members)
            self._bucket_at[members] = difficulty
            self._bucket_pos[members] = np.arange(len(members), dtype=np.int32)

    def _set_task_row(self, t: int, row: str) -> None:
        key = int(self._row_key[t])
        if key >= 0:
            if self._task_row_text(key) == row:
                return  # the trainer sends the same row every step: no new row in the log
            self._task_rows.delete(key)
        self._row_key[t] = self._task_rows.append((self._task_ids[t], row))

    def _task_row_text(self, key: int) -> str:
        item, row = self._task_rows.locate(key)
        return item[1] if row is None else item.read(("task_row",), [row])[0]["task_row"]

    def _store_trajectory(self, t: int, trajectory: Trajectory, seq: int | None = None) -> int:
        """Append a copy of `trajectory` to the log; returns its key."""
        if seq is None:
            seq = self._stored_count
            self._stored_count += 1
        size = len(trajectory.prompt_ids) + len(trajectory.completion_ids)  # tokens: bounds the Python objects held
        key = self._trajectories.append((_copy(trajectory), seq), size)
        self._ensure_keys(key + 1)
        self._key_task[key] = t
        self._key_entropy[key] = trajectory.entropy
        self._key_version[key] = trajectory.policy_version
        self._key_traj_id[key] = trajectory.traj_id
        self._key_seq[key] = seq
        self._num_live += 1
        return key

    def _drop_key(self, key: int) -> None:
        self._trajectories.delete(key)
        self._num_live -= 1

    def _append_slot(self, t: int, trajectory: Trajectory, seq: int | None = None) -> None:
        n = int(self._count[t])
        if n == self._slots.shape[1]:  # capacity raised by `configure`
            self._slots = np.concatenate([self._slots, np.full((len(self._slots), n), -1, np.int32)], axis=1)
        self._slots[t, n] = self._store_trajectory(t, trajectory, seq)
        self._count[t] = n + 1
        if n == 0:
            self._num_stored_tasks += 1
            self._store_order[t] = self._next_stamp()
            self._place_in_bucket(t)

    def _replace_slot(self, t: int, i: int, trajectory: Trajectory) -> None:
        old = int(self._slots[t, i])
        self._slots[t, i] = self._store_trajectory(t, trajectory)
        self._drop_key(old)

    def _shift_append(self, t: int, i: int, trajectory: Trajectory) -> None:
        """Remove the trajectory at position `i` and append `trajectory` (list.pop(i) then append)."""
        n = int(self._count[t])
        row = self._slots[t]
        old = int(row[i])
        row[i : n - 1] = row[i + 1 : n].copy()
        row[n - 1] = self._store_trajectory(t, trajectory)
        self._drop_key(old)

    def _remove_slot(self, t: int, i: int) -> None:
        """Remove the trajectory at position `i` of task `t` (list.pop(i))."""
        n = int(self._count[t])
        row = self._slots[t]
        old = int(row[i])
        row[i : n - 1] = row[i + 1 : n].copy()
        row[n - 1] = -1
        self._count[t] = n - 1
        self._drop_key(old)
        if n == 1:
            self._num_stored_tasks -= 1
            self._place_in_bucket(t)

    def _clear_store(self, t: int) -> None:
        n = int(self._count[t])
        for key in self._slots[t, :n].tolist():
            self._drop_key(key)
        self._slots[t, :n] = -1
        self._count[t] = 0
        if n:
            self._num_stored_tasks -= 1
            self._place_in_bucket(t)
        self._store_order[t] = -1

    # ---------------------------------------------------------------------------------------------- queries
    def bucket_of(self, task_id: str) -> int | None:
        t = self._task_index.get(task_id)
        if t is None or self._difficulty[t] < 0:
            return None
        return int(self._difficulty[t])

    def _ordered(self, order: np.ndarray) -> np.ndarray:
        """Task indices whose `order` stamp is set, in stamp order."""
        n = len(self._task_ids)
        tasks = np.nonzero(order[:n] >= 0)[0]
        return tasks[np.argsort(order[tasks], kind="stable")]

    def buckets(self) -> dict[int, list[str]]:
        """Difficulty -> tasks (each task in exactly one bucket), tasks in the order of their latest update."""
        out: dict[int, list[str]] = {}
        tasks = self._ordered(self._difficulty_order)
        for t, difficulty in zip(tasks.tolist(), self._difficulty[tasks].tolist()):
            out.setdefault(difficulty, []).append(self._task_ids[t])
        return dict(sorted(out.items()))

    @property
    def skip_set(self) -> list[str]:
        return [self._task_ids[t] for t in self._ordered(self._skip_order).tolist()]

    @property
    def num_tasks(self) -> int:
        """Tasks with at least one stored trajectory."""
        return self._num_stored_tasks

    @property
    def num_trajectories(self) -> int:
        return self._num_live

    def stored_tasks(self) -> list[str]:
        """Tasks with at least one stored trajectory, in the order their store was created."""
        return [self._task_ids[t] for t in self._ordered(self._store_order).tolist() if self._count[t] > 0]

    @property
    def _store(self) -> list[str]:
        # Callers written against the former dict attribute iterate its keys: the stored tasks.
        return self.stored_tasks()

    def trajectories(self, task_id: str) -> list[Trajectory]:
        """Copies of a task's stored trajectories, in store order (read from the shards)."""
        t = self._task_index.get(task_id)
        return [] if t is None else self._read_all(self._keys(t))

    def task_row(self, task_id: str) -> dict | None:
        t = self._task_index.get(task_id)
        if t is None or self._row_key[t] < 0:
            return None
        return json.loads(self._task_row_text(int(self._row_key[t])))

    def _keys(self, t: int, current_step=None, max_policy_age=None, window=None) -> list[int]:
        keys = self._slots[t, : self._count[t]]
        if window is None and (max_policy_age is None or current_step is None):
            return keys.tolist()
        keep = np.ones(len(keys), bool)
        if max_policy_age is not None and current_step is not None:
            keep &= current_step - self._key_version[keys] <= max_policy_age
        if window is not None:
            keep &= self._key_seq[keys] >= self._stored_count - window
        return keys[keep].tolist()

    def candidates(
        self,
        task_id: str,
        current_step: int | None = None,
        max_policy_age: int | None = None,
        window: int | None = None,
    ) -> list[Trajectory]:
        """Stored trajectories of a task young enough to replay (and among the `window` most recently stored)."""
        t = self._task_index.get(task_id)
        return [] if t is None else self._read_all(self._keys(t, current_step, max_policy_age, window))

    def _replayable(
        self, tasks: np.ndarray, min_trajectories: int, current_step, max_policy_age, window
    ) -> np.ndarray:
        """Mask of `tasks` (indices) that are bucketed, outside the skip set, have a row and enough candidates."""
        ok = (
            (self._difficulty[tasks] >= 0)
            & (self._skip_order[tasks] < 0)
            & (self._row_key[tasks] >= 0)
            & (self._count[tasks] >= min_trajectories)
        )
        aged = max_policy_age is not None and current_step is not None
        if (aged or window is not None) and ok.any():
            # Count the candidates of the tasks still in: O(tasks x capacity) on the index, no trajectory read.
            checked = tasks[ok]
            slots = self._slots[checked]
            valid = slots >= 0
            keys = np.where(valid, slots, 0)
            if aged:
                valid &= current_step - self._key_version[keys] <= max_policy_age
            if window is not None:
                valid &= self._key_seq[keys] >= self._stored_count - window
            ok[np.nonzero(ok)[0]] = valid.sum(axis=1) >= min_trajectories
        return ok

    def replayable_tasks(
        self,
        min_trajectories: int = 1,
        current_step: int | None = None,
        max_policy_age: int | None = None,
        window: int | None = None,
    ) -> list[tuple[str, int]]:
        """(task, difficulty) of bucketed tasks outside the skip set with enough replayable trajectories, in bucket
        order (vectorized over the index; reads no trajectory). O(tasks): the trainer draws from `replay_buckets`."""
        tasks, difficulties = self._replayable_listing(min_trajectories, current_step, max_policy_age, window)
        return list(zip(_gather(self._task_ids, tasks.tolist()), difficulties.tolist()))

    def _replayable_listing(self, min_trajectories, current_step, max_policy_age, window):
        tasks = self._ordered(self._difficulty_order)
        tasks = tasks[self._replayable(tasks, min_trajectories, current_step, max_policy_age, window)]
        return tasks, self._difficulty[tasks]

    def replay_buckets(
        self,
        min_trajectories: int = 1,
        current_step: int | None = None,
        max_policy_age: int | None = None,
        window: int | None = None,
    ) -> TaskBuckets:
        """The buckets (their tasks that hold trajectories), for `planner.plan_replay` to draw replay tasks from in
        O(batch): the tasks `replayable_tasks` lists (with these arguments) are those the draw can return, with the
        same weights, without listing them. Valid until the pool changes.
        """
        return TaskBuckets(
            members={d: self._members[d][:n] for d, n in sorted(self._bucket_len.items()) if n},
            replayable=lambda tasks: self._replayable(
                np.asarray(tasks, np.int64), min_trajectories, current_step, max_policy_age, window
            ),
            listing=lambda: self._replayable_listing(min_trajectories, current_step, max_policy_age, window),
            names=lambda tasks: _gather(self._task_ids, [int(t) for t in tasks]),
        )

    def select(
        self,
        candidates: Sequence[Trajectory],
        num: int,
        entropies: Sequence[float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> list[Trajectory]:
        """Pick `num` of `candidates` by entropy (the saved one, or `entropies` under the current policy)."""
        keys = [t.entropy for t in candidates] if entropies is None else list(entropies)
        order = self._selection_order(keys, [t.traj_id for t in candidates], num, rng)
        return [candidates[i] for i in order]

    def _selection_order(
        self, entropies: Sequence[float], traj_ids: Sequence[int], num: int, rng: np.random.Generator | None
    ) -> list[int]:
        """Positions of the `num` candidates `exp_select_mode` picks (ties: lowest trajectory id first)."""
        if num > len(entropies):
            raise ValueError(f"Cannot select {num} trajectories out of {len(entropies)} candidates.")
        order = list(range(len(entropies)))
        if self.exp_select_mode == "argmin":
            order.sort(key=lambda i: (entropies[i], traj_ids[i]))
        elif self.exp_select_mode == "argmax":
            order.sort(key=lambda i: (-entropies[i], traj_ids[i]))
        else:
            rng = rng if rng is not None else np.random.default_rng(self.seed)
            order = [int(i) for i in rng.permutation(len(entropies))]
        return order[:num]

    def choose(
        self,
        task_ids: Sequence[str],
        num: int,
        current_step: int | None = None,
        max_policy_age: int | None = None,
        window: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> dict[str, list[Trajectory]]:
        """``{task: select(candidates(task, current_step, max_policy_age, window), num, rng=rng)}`` for each of
        `task_ids` in turn (the same trajectories and the same use of `rng`), choosing on the index by saved entropy
        and reading only the chosen trajectories, all in one pass over their shards."""
        chosen: dict[str, list[int]] = {}
        for task_id in task_ids:
            t = self._task_index.get(task_id)
            keys = [] if t is None else self._keys(t, current_step, max_policy_age, window)
            # On the index: the entropies and ids the read trajectories would carry.
            order = self._selection_order(self._key_entropy[keys].tolist(), self._key_traj_id[keys].tolist(), num, rng)
            chosen[task_id] = [keys[i] for i in order]
        trajectories = iter(self._read_all([key for keys in chosen.values() for key in keys]))
        return {task_id: [next(trajectories) for _ in keys] for task_id, keys in chosen.items()}

    def sample(
        self, num: int, current_step: int | None = None, rng: np.random.Generator | None = None
    ) -> list[Trajectory]:
        """Draw `num` distinct replayable tasks uniformly and one trajectory of each, chosen as `select` would by
        saved entropy (``exp_select_mode``); fewer when fewer tasks are replayable.

        Honours ``replay_window`` and, given `current_step`, ``max_policy_age``. Cost O(num x capacity): tasks are
        drawn by rejection on the index (an O(tasks) vectorized pass only when few tasks qualify) and only the chosen
        trajectories are read from the shards. Their token lists (`prompt_ids`, `completion_ids`, `completion_mask`,
        `logps`) are read now but become Python lists on first access (the same values), which is most of the cost
        of a sample: a caller that uses a few of them does not pay for the others.
        """
        rng = rng if rng is not None else np.random.default_rng(self.seed)
        age, window = self.max_policy_age, self.replay_window
        total = len(self._task_ids)
        chosen: list[int] = []
        seen: set[int] = set()
        for _ in range(8):
            need = num - len(chosen)
            if need <= 0 or total == 0:
                break
            draw = rng.integers(total, size=2 * need + 8)
            for t in draw[self._replayable(draw, 1, current_step, age, window)].tolist():
                if t not in seen and len(chosen) < num:
                    seen.add(t)
                    chosen.append(t)
        if len(chosen) < num and total:  # few tasks qualify: take the rest from the full list
            everyone = np.arange(total)
            rest = np.setdiff1d(everyone[self._replayable(everyone, 1, current_step, age, window)], chosen)
            chosen += rng.permutation(rest)[: num - len(chosen)].tolist()
        if not chosen:
            return []
        tasks = np.asarray(chosen)
        slots = self._slots[tasks]
        valid = slots >= 0
        keys = np.where(valid, slots, 0)
        if age is not None and current_step is not None:
            valid &= current_step - self._key_version[keys] <= age
        if window is not None:
            valid &= self._key_seq[keys] >= self._stored_count - window
        if self.exp_select_mode == "random":
            picked = []
            for row_keys, row_valid in zip(keys.tolist(), valid.tolist()):
                candidates = [k for k, ok in zip(row_keys, row_valid) if ok]
                picked.append(candidates[int(rng.permutation(len(candidates))[0])])
        else:  # as `select`: by saved entropy (lowest for argmin, highest for argmax), ties to the oldest
            sign = 1.0 if self.exp_select_mode == "argmin" else -1.0
            entropy = np.where(valid, sign * self._key_entropy[keys].astype(np.float64), np.inf)
            best = valid & (entropy == entropy.min(axis=1, keepdims=True))
            ids = np.where(best, self._key_traj_id[keys], np.iinfo(np.int64).max)
            picked = keys[np.arange(len(tasks)), ids.argmin(axis=1)].tolist()
        return self._read_all(picked, lazy=True)

    def stats(self) -> dict[str, float]:
        out = {
            "pool_tasks": float(self.num_tasks),
            "pool_trajectories": float(self.num_trajectories),
            "skip_set": float(int((self._skip_order[: len(self._task_ids)] >= 0).sum())),
            "pool_rejected_rows": float(self.rejected_rows),
        }
        difficulties = self._difficulty[: len(self._task_ids)]
        for difficulty, count in enumerate(np.bincount(difficulties[difficulties >= 0]).tolist()):
            if count:
                out[f"bucket_{difficulty}"] = float(count)
        return out

    def storage_stats(self) -> dict[str, int]:
        """Shards, rows, tombstones and buffered rows of the trajectory and task row logs."""
        out = {f"trajectory_{k}": v for k, v in self._trajectories.stats().items()}
        out.update({f"task_row_{k}": v for k, v in self._task_rows.stats().items()})
        return out

    def _read_all(self, keys: list[int], lazy: bool = False) -> list[Trajectory]:
        """The trajectories of `keys`: pending ones copied, written ones read from their shards (one pass per shard,
        with `pread`: reading maps no page of the pool's files into the process). `lazy`: token lists read as bytes
        are converted to lists on first access (`_LazyList`)."""
        if not keys:
            return []
        places = self._trajectories.locate_many(keys)
        tasks = self._key_task[keys].tolist()
        entropies = self._key_entropy[keys].tolist()  # float32 -> the same Python floats the pool stored
        versions = self._key_version[keys].tolist()
        ids = self._key_traj_id[keys].tolist()
        out: list = [None] * len(keys)
        by_shard: dict[int, tuple] = {}
        for i, (place, row) in enumerate(places):
            if row is None:
                out[i] = _copy(place[0])
            else:
                by_shard.setdefault(id(place), (place, []))[1].append((i, row))
        raw = _TOKEN_COLUMNS if lazy else ()
        for shard, wanted in by_shard.values():
            for (i, _), fields in zip(wanted, shard.read(_STORED_COLUMNS, [row for _, row in wanted], raw)):
                fields.update(
                    task_id=self._task_ids[tasks[i]], entropy=entropies[i], policy_version=versions[i], traj_id=ids[i]
                )
                if lazy:
                    pending = {name: fields.pop(name) for name in raw if type(fields.get(name)) is tuple}
                    if pending:
                        fields["_lazy"] = pending
                trajectory = object.__new__(Trajectory)
                trajectory.__dict__ = fields  # already in the stored types: no per-token normalisation
                out[i] = trajectory
        self._trajectories.release()  # shards read through their mapping (no file left) are unmapped again
        return out

    # ------------------------------------------------------------------------------------------------ storage
    def flush(self, wait: bool = False) -> None:
        """Have the writer thread write every buffered row to shard files now; `wait` blocks until it is done."""
        self._trajectories.flush(seal=True)
        self._task_rows.flush(seal=True)
        if wait:
            self._writer.wait()

    def compact(self) -> None:
        """Rewrite every shard that holds tombstones, now (compaction otherwise runs by itself, in the background)."""
        self._trajectories.compact()
        self._task_rows.compact()

    def close(self) -> None:
        """Stop the writer thread and delete the pool's scratch shards (saved pools keep their own links)."""
        self._finalizer()

    def __enter__(self) -> ExperiencePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ persistence
    def _hash_state(self) -> dict:
        tasks = range(len(self._task_ids))
        return {
            "settings": self._settings(),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "next_traj_id": self._next_traj_id,
            "num_outcomes": self._num_outcomes,
            "stored_count": self._stored_count,
            "difficulty": [
                [self._task_ids[t], int(self._difficulty[t])] for t in self._ordered(self._difficulty_order).tolist()
            ],
            "skip_set": self.skip_set,
            "task_rows": sorted(
                [self._task_ids[t], self._task_row_text(int(self._row_key[t]))] for t in tasks if self._row_key[t] >= 0
            ),
            "store": sorted(
                [self._task_ids[t], [int(self._key_seq[k]) for k in self._keys(t)]]
                for t in tasks
                if self._count[t] > 0
            ),
        }

    def content_hash(self) -> str:
        """SHA-256 of the pool's whole content (state and every trajectory): equal pools, equal hashes. Reads the
        whole pool: meant for tests and checks, not for a training loop."""
        digest = hashlib.sha256()
        digest.update(json.dumps(self._hash_state(), sort_keys=True).encode())
        for task_id in sorted(self.stored_tasks()):
            for trajectory in self.trajectories(task_id):
                digest.update(json.dumps(asdict(trajectory), sort_keys=True).encode())
        return digest.hexdigest()

    def _settings(self) -> dict:
        return {name: getattr(self, name) for name in SETTINGS}

    def save(self, path: str, save_total_limit: int = 1) -> None:
        """Save the pool to folder `path`: incrementally, atomically, keeping `save_total_limit` snapshots there.

        Only what the folder lacks is written: shards new since the last save to it (hard links to the live pool's
        files when on the same file system, so no trajectory is ever written twice) and the small per-task state.
        The commit is the atomic replacement of ``state.json``; a process killed at any instant of a save leaves
        the previous snapshot complete and loadable. Snapshots beyond `save_total_limit` and the files only they
        used are deleted after the commit.
        """
        if not isinstance(save_total_limit, int) or save_total_limit < 1:
            raise ValueError(f"save_total_limit must be an integer >= 1, got {save_total_limit!r}.")
        self.flush(wait=True)
        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
        previous = _committed_state(path)
        snapshot = previous["snapshot"] + 1 if previous else 1
        try:
            entries = {
                TRAJECTORIES_DIR: self._trajectories.save_into(os.path.join(path, TRAJECTORIES_DIR)),
                TASK_ROWS_DIR: self._task_rows.save_into(os.path.join(path, TASK_ROWS_DIR)),
            }
            tasks_file = f"{TASKS_DIR}/{snapshot:08d}-{uuid.uuid4().hex[:12]}.arrow"
            os.makedirs(os.path.join(path, TASKS_DIR), exist_ok=True)
            table = self._tasks_table(entries)
            write_atomic(os.path.join(path, tasks_file), lambda tmp: write_arrow(tmp, table))
            files = {tasks_file: _file_entry(*_digest(os.path.join(path, tasks_file)))}
            for kind, es in entries.items():
                files.update({f"{kind}/{e['name']}": _file_entry(*e["digest"]) for e in es})
            for folder in (TRAJECTORIES_DIR, TASK_ROWS_DIR, TASKS_DIR):
                fsync_path(os.path.join(path, folder))
            if save_total_limit > 1 and previous is not None:
                os.makedirs(os.path.join(path, HISTORY_DIR), exist_ok=True)
                kept = {k: v for k, v in previous.items() if k != "verified"}  # as it was written
                write_json_atomic(os.path.join(path, HISTORY_DIR, f"{previous['snapshot']:08d}.json"), kept)
                fsync_path(os.path.join(path, HISTORY_DIR))
            state = {
                "format_version": FORMAT_VERSION,
                "snapshot": snapshot,
                "save_total_limit": save_total_limit,
                "settings": self._settings(),
                "tokenizer_fingerprint": self.tokenizer_fingerprint,
                "counters": {
                    "next_traj_id": self._next_traj_id,
                    "num_outcomes": self._num_outcomes,
                    "stored_count": self._stored_count,
                    "stamp": self._stamp,
                },
                "num_trajectories": self.num_trajectories,
                "num_tasks": len(self._task_ids),
                "tasks_file": tasks_file,
                "shards": {
                    kind: [{k: e[k] for k in ("name", "rows", "live")} for e in es] for kind, es in entries.items()
                },
                "files": files,
            }
            state["checksum"] = state_checksum(state)
            write_json_atomic(os.path.join(path, STATE_FILE), state)  # the commit
            fsync_path(path)
        except BaseException:
            try:  # remove what this save added; the committed snapshot is untouched
                if previous is not None:
                    prune(path, previous.get("save_total_limit", 1))
                elif not os.path.exists(os.path.join(path, STATE_FILE)):
                    for folder in (TRAJECTORIES_DIR, TASK_ROWS_DIR, TASKS_DIR):
                        shutil.rmtree(os.path.join(path, folder), ignore_errors=True)
            except Exception:  # noqa: BLE001 - the save's own error is the one to report
                logger.exception("trl_exreplay: cleaning up after a failed pool save")
            raise
        prune(path, save_total_limit)
        trim_heap()  # the tasks table and the flushed buffers were large transients

    def _tasks_table(self, entries: dict[str, list[dict]]):
        """The per-task table of a snapshot: task state and where its rows are (shard number in the state, row)."""
        import pyarrow as pa

        n = len(self._task_ids)
        counts = self._count[:n]
        slots = self._slots[:n]
        keys = slots[slots >= 0]  # task by task, in store order
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(counts, out=offsets[1:])

        def where(log, keys, kind):
            index = np.full(log._next_sid + 1, -1, np.int32)
            for i, entry in enumerate(entries[kind]):
                index[entry["sid"]] = i
            locations = log.locations(keys)
            return index[locations >> 32], (locations & 0xFFFFFFFF).astype(np.int32)

        traj_shard, traj_row = where(self._trajectories, keys, TRAJECTORIES_DIR)
        row_keys = self._row_key[:n]
        has_row = row_keys >= 0
        row_shard = np.full(n, -1, np.int32)
        row_index = np.full(n, -1, np.int32)
        row_shard[has_row], row_index[has_row] = where(self._task_rows, row_keys[has_row], TASK_ROWS_DIR)

        def lists(values):
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

        return pa.table(
            {
                "task_id": pa.array(self._task_ids, pa.string()),
                "difficulty": self._difficulty[:n],
                "difficulty_order": self._difficulty_order[:n],
                "bucket_pos": self._bucket_pos[:n],
                "skip_order": self._skip_order[:n],
                "store_order": self._store_order[:n],
                "row_shard": row_shard,
                "row_index": row_index,
                "traj_shard": lists(traj_shard),
                "traj_row": lists(traj_row),
                "traj_id": lists(self._key_traj_id[keys]),
            },
            schema=TASKS_SCHEMA,
        )

    @classmethod
    def load(
        cls,
        path: str,
        *,
        snapshot: int | None = None,
        tokenizer=None,
        vocab_size: int | None = None,
        verify: bool = True,
        allow_missing_fingerprint: bool = False,
        work_dir: str | None = None,
        shard_rows: int = 1024,
    ) -> ExperiencePool:
        """Load the pool saved at `path` (its committed snapshot, or an older kept `snapshot`).

        The folder is untrusted input (`trl_exreplay.pool_check`): ``state.json`` is validated, every file must be
        named inside the folder and resolve inside it, have its recorded size and (with `verify`, the default) its
        recorded xxh3-64 checksum, and a valid Arrow layout, before anything is mapped. Any damage raises one
        `PoolFormatError` (a `ValueError`) naming the file. Shards are then memory-mapped, not read: RAM receives the
        index only. A row a model cannot train on (null field, lists of unequal length, wrong trajectory id,
        non-finite log-prob or reward, a mask value other than 0/1, a token id < 0 or >= `vocab_size`) is left out,
        counted in `rejected_rows` (by reason in `rejected_reasons`) and logged.

        Given a `tokenizer`, a pool recorded with another one is refused (`ValueError`), and so is a pool recorded
        with none, unless `allow_missing_fingerprint`. ``verify=False`` skips the checksums (sizes, names, layouts
        and row values are still checked): for a local pool on a trusted disk (`benchmarks/pool_scale.py` measures
        both). `from_hub` always verifies.
        """
        path = os.path.abspath(path)
        if not os.path.lexists(os.path.join(path, STATE_FILE)):
            raise FileNotFoundError(f"No experience pool at {path} (missing {STATE_FILE}).")
        state = read_state(path, snapshot)
        if state["format_version"] == 1:
            pool = cls._load_format_1(path, state, work_dir, shard_rows)
        else:
            if not state["verified"]:
                logger.warning(
                    "trl_exreplay: the experience pool at %s was saved in format_version 2, without checksums: damage "
                    "to its files cannot be detected. Save it again (to another folder) to add them.",
                    path,
                )
            pool = cls._load_snapshot(path, state, work_dir, shard_rows, vocab_size, verify)
        if pool.rejected_rows:
            logger.warning(
                "trl_exreplay: %d row(s) of the experience pool at %s were left out (%s); counted in "
                "ExperiencePool.rejected_rows.",
                pool.rejected_rows,
                path,
                ", ".join(f"{n} {reason}" for reason, n in sorted(pool.rejected_reasons.items())),
            )
        if tokenizer is not None:
            if pool.tokenizer_fingerprint is None and not allow_missing_fingerprint:
                pool.close()
                raise ValueError(
                    f"The experience pool at {path} records no tokenizer fingerprint, so nothing says its token ids "
                    "belong to the given tokenizer. Pass allow_missing_fingerprint=True to use it with this tokenizer "
                    "anyway (it is then bound to it), or start from an empty pool."
                )
            pool.bind_tokenizer(tokenizer_fingerprint(tokenizer), source=path)
        return pool

    @classmethod
    def _load_snapshot(cls, path: str, state: dict, work_dir, shard_rows, vocab_size, verify) -> ExperiencePool:
        import pyarrow as pa

        folder = PoolFolder(path)
        tasks_path = folder.verify(state, state["tasks_file"], verify)
        try:
            tasks = read_arrow(tasks_path)
        except (OSError, pa.ArrowException) as e:
            raise PoolFormatError(tasks_path, f"is not an Arrow file ({e}).") from None
        check_tasks_table(tasks, state, tasks_path, TRAJECTORIES_DIR, TASK_ROWS_DIR)
        pool = cls(**state["settings"], work_dir=work_dir, shard_rows=shard_rows)
        try:
            pool._fill_from_snapshot(folder, state, tasks, vocab_size, verify)
        except BaseException:
            pool.close()
            raise
        return pool

    def _fill_from_snapshot(self, folder: PoolFolder, state: dict, tasks, vocab_size, verify) -> None:
        import pyarrow as pa

        self.tokenizer_fingerprint = state.get("tokenizer_fingerprint")
        counters = state["counters"]
        self._next_traj_id = int(counters["next_traj_id"])
        self._num_outcomes = int(counters["num_outcomes"])
        self._stored_count = int(counters["stored_count"])
        self._stamp = int(counters["stamp"])
        n = tasks.num_rows
        self._task_ids = tasks.column("task_id").to_pylist()
        self._task_index = {task_id: i for i, task_id in enumerate(self._task_ids)}
        self._ensure_tasks(n)
        for name in ("difficulty", "difficulty_order", "skip_order", "store_order"):
            getattr(self, f"_{name}")[:n] = tasks.column(name).to_numpy()
        places = tasks.column("bucket_pos") if "bucket_pos" in tasks.schema.names else None  # absent before
        places = places.to_numpy() if places is not None else None

        def shards(kind, schema):
            """(index in the state, shard) of each shard file, checked, then mapped one at a time."""
            for i, entry in enumerate(state["shards"][kind]):
                file = folder.verify(state, f"{kind}/{entry['name']}", verify)
                shard = Shard(-1, entry["name"], 0, [file])
                try:
                    shard.map(file)
                except (OSError, pa.ArrowException) as e:
                    raise PoolFormatError(file, f"is not an Arrow file ({e}).") from None
                check_arrow(shard.table(), schema, file)
                if shard.rows != entry["rows"]:
                    raise PoolFormatError(file, f"has {shard.rows} rows; the pool recorded {entry['rows']}.")
                if verify and state["verified"]:  # checked just now: a later save need not hash it again
                    recorded = state["files"][f"{kind}/{entry['name']}"]
                    shard.digest = (recorded["size"], recorded[CHECKSUM])
                yield i, shard

        def settle(log, shard):
            shard.layout(log.read_columns)  # so that no read pays for it
            shard.release()  # validation read offsets and ids through the mapping: unmap them again
            log.keep(shard)  # unmapped too, when a hard link in the scratch folder keeps the file

        reasons = self.rejected_reasons
        row_shard = tasks.column("row_shard").to_numpy()
        row_index = tasks.column("row_index").to_numpy().astype(np.int64)
        placed = np.zeros(n, bool)
        row_groups = _group_by(row_shard)
        for i, shard in shards(TASK_ROWS_DIR, TASK_ROW_SCHEMA):
            owners = row_groups(i)
            if len(owners) == 0:
                continue
            rows = row_index[owners]
            good = ~invalid_rows(shard.table(), rows, ("task_row",), ())
            self._row_key[owners[good]] = self._task_rows.adopt(shard, rows[good])
            placed[owners[good]] = True
            settle(self._task_rows, shard)
        lost = int(((row_shard >= 0) & ~placed).sum())
        if lost:
            reasons["missing or malformed task row"] += lost

        lengths = np.diff(tasks.column("traj_shard").combine_chunks().offsets.to_numpy())
        entry_task = np.repeat(np.arange(n, dtype=np.int32), lengths)
        flat = {name: tasks.column(name).combine_chunks().flatten().to_numpy() for name in _SLOT_COLUMNS}
        del tasks
        entry_key = np.full(len(entry_task), -1, np.int64)
        entry_groups = _group_by(flat["traj_shard"])
        for i, shard in shards(TRAJECTORIES_DIR, TRAJECTORY_SCHEMA):
            entries = entry_groups(i)
            if len(entries) == 0:
                continue
            rows = flat["traj_row"][entries].astype(np.int64)
            table = shard.table()
            bad = invalid_rows(table, rows, _REQUIRED, _SAME_LENGTH)
            if bad.any():
                reasons["missing or malformed row"] += int(bad.sum())
            safe = np.where(bad, 0, rows)
            columns = {name: table.column(name).to_numpy() for name in _INDEX_COLUMNS} if not bad.all() else {}
            if columns:  # a row must be the trajectory the snapshot says it is, with values a model can train on
                wrong = ~bad & (columns["traj_id"][safe] != flat["traj_id"][entries])
                if wrong.any():
                    reasons["row is another trajectory"] += int(wrong.sum())
                bad |= wrong
                unusable, why = bad_trajectory_rows(table, safe, vocab_size, skip=bad)
                reasons.update(why)
                bad |= unusable
            good, rows = entries[~bad], rows[~bad]
            if len(good) == 0:
                shard.release()
                continue
            keys = self._trajectories.adopt(shard, rows)
            self._ensure_keys(int(keys.max()) + 1)
            self._key_task[keys] = entry_task[good]
            self._key_entropy[keys] = columns["entropy"][rows]
            self._key_version[keys] = columns["policy_version"][rows]
            self._key_traj_id[keys] = columns["traj_id"][rows]
            self._key_seq[keys] = columns["store_seq"][rows]
            entry_key[good] = keys
            del table, columns
            settle(self._trajectories, shard)
        ok = entry_key >= 0
        self._place_slots(entry_task[ok], entry_key[ok], n)
        self._rebuild_buckets(places)
        self.vocab_size = vocab_size
        trim_heap()

    def _place_slots(self, entry_task: np.ndarray, entry_key: np.ndarray, n: int) -> None:
        """Rebuild the slots from keys listed task by task, in store order."""
        counts = np.bincount(entry_task, minlength=n).astype(np.int32) if n else np.zeros(0, np.int32)
        width = max(1, self.max_trajectories_per_task, int(counts.max(initial=0)))
        self._slots = np.full((len(self._difficulty), width), -1, np.int32)
        starts = np.cumsum(counts) - counts
        self._slots[entry_task, np.arange(len(entry_key)) - starts[entry_task]] = entry_key
        self._count[:n] = counts
        self._store_order[:n][counts == 0] = -1
        self._num_live = len(entry_key)
        self._num_stored_tasks = int((counts > 0).sum())

    @classmethod
    def _load_format_1(cls, path: str, state: dict, work_dir, shard_rows) -> ExperiencePool:
        """A pool of the first format (one `datasets` table, `save_to_disk`), read into the sharded store."""
        import datasets

        pool = cls(**state["settings"], work_dir=work_dir, shard_rows=shard_rows)
        for task_id, difficulty in state["difficulty"]:
            t = pool._task(task_id)
            pool._set_difficulty(t, int(difficulty))
            pool._difficulty_order[t] = pool._next_stamp()
        for task_id in state["skip_set"]:
            pool._skip_order[pool._task(task_id)] = pool._next_stamp()
        for task_id, row in state["task_rows"].items():
            pool._set_task_row(pool._task(task_id), row)
        by_id = {}
        rows = datasets.load_from_disk(os.path.join(path, TRAJECTORIES_DIR)) if state["num_trajectories"] else []
        for row in rows:
            try:
                trajectory = Trajectory(**row)
            except (TypeError, ValueError):
                pool.rejected_reasons["malformed row"] += 1
                continue
            by_id[trajectory.traj_id] = trajectory
        rank = {traj_id: i for i, traj_id in enumerate(sorted(by_id))}
        for task_id, traj_ids in state["store_order"]:
            t = pool._task(task_id)
            for traj_id in traj_ids:
                if traj_id in by_id:
                    pool._append_slot(t, by_id[traj_id], seq=rank[traj_id])
        pool._next_traj_id = int(state["next_traj_id"])
        pool._num_outcomes = int(state["num_outcomes"])
        pool._stored_count = len(by_id)
        return pool

    # ------------------------------------------------------------------------------------------------ sharing
    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
        commit_message: str = "Upload experience pool from trl-exreplay",
        card: str | None = None,
    ) -> str:
        """Upload the pool to the Hub dataset repository `repo_id` in one commit; returns the commit URL.

        The pool is compacted first, so the repository's Arrow files hold exactly its trajectories:
        ``datasets.load_dataset(repo_id)`` reads them as a table and `from_hub` reads the pool back.
        """
        from .hub import push_pool

        self.compact()
        export = tempfile.mkdtemp(prefix="export-", dir=self._scratch.folder("exports"))  # same disk: hard links
        try:
            self.save(export)
            return push_pool(
                export,
                repo_id,
                card=card,
                private=private,
                token=token,
                revision=revision,
                commit_message=commit_message,
            )
        finally:
            shutil.rmtree(export, ignore_errors=True)

    @classmethod
    def from_hub(
        cls,
        repo_id: str,
        *,
        revision: str | None = None,
        token: str | None = None,
        tokenizer=None,
        vocab_size: int | None = None,
        allow_missing_fingerprint: bool = False,
        cache_dir: str | None = None,
        work_dir: str | None = None,
    ) -> ExperiencePool:
        """Download a pool pushed by `push_to_hub` (or `hub.push_pool`) and load it (see `load`), always verifying
        every file's checksum; a pool of an older format (no checksums) is refused.

        Given a `tokenizer`, a pool recorded with another one (or with none, unless `allow_missing_fingerprint`) is
        refused with a `ValueError`.
        """
        from huggingface_hub import HfApi

        folder = HfApi(token=token).snapshot_download(
            repo_id, repo_type="dataset", revision=revision, cache_dir=cache_dir
        )
        version = read_state(folder)["format_version"]
        if version != FORMAT_VERSION:
            raise ValueError(
                f"The experience pool {repo_id} on the Hub is of the older format_version {version}, whose files have "
                "no checksums, so its integrity cannot be checked. If you trust it, load the downloaded folder with "
                "ExperiencePool.load and push it again."
            )
        return cls.load(
            folder,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            verify=True,
            allow_missing_fingerprint=allow_missing_fingerprint,
            work_dir=work_dir,
        )


def _committed_state(path: str) -> dict | None:
    """The committed state of the pool folder `path`, None for an empty folder. A folder holding anything else (a
    pool of an older format, which `load` reads but a save does not extend, or a damaged state) is refused."""
    if not os.path.lexists(os.path.join(path, STATE_FILE)):
        return None
    try:
        state = read_state(path)
    except PoolFormatError as e:
        raise ValueError(
            f"Not saving into {path}: its {STATE_FILE} is not that of a usable experience pool ({e}). Save to another "
            "folder, or delete this one first."
        ) from None
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"Not saving into {path}: it holds an experience pool of the older format_version {version} (this "
            f"version writes {FORMAT_VERSION}). Load it with ExperiencePool.load and save it to another folder."
        )
    return state


def _digest(path: str) -> tuple[int, str]:
    return os.path.getsize(path), file_checksum(path)


def _file_entry(size: int, checksum: str) -> dict:
    return {"size": size, CHECKSUM: checksum}


def _check_settings(settings: dict) -> None:
    """`pool_check.check_settings` for settings given in code: a plain `ValueError` naming the setting."""
    try:
        check_settings(settings, "settings", where="")
    except PoolFormatError as e:
        raise ValueError(f"ExperiencePool: {e.problem}") from None


def _gather(items: list, indices: list[int]) -> list:
    """``[items[i] for i in indices]`` in C (a pool of 200k tasks lists them in a few ms)."""
    if len(indices) < 2:
        return [items[i] for i in indices]
    return list(operator.itemgetter(*indices)(items))


def _group_by(values: np.ndarray):
    """``i -> indices where values == i`` (ascending), after one sort instead of one scan per `i`."""
    order = np.argsort(values, kind="stable")
    ordered = values[order].astype(np.int64)  # else every searchsorted casts the whole array to compare

    def group(i: int) -> np.ndarray:
        return order[np.searchsorted(ordered, i, side="left") : np.searchsorted(ordered, i, side="right")]

    return group


def _close_storage(writer: Writer, scratch: Scratch, logs: tuple[ShardLog, ...]) -> None:
    if threading.current_thread().name != "exreplay-pool-writer":
        writer.close()
    for log in logs:
        log.close_files()
    scratch.remove()


def _trusted(**fields) -> Trajectory:
    """A `Trajectory` from values already in the stored types (no per-token normalisation)."""
    trajectory = object.__new__(Trajectory)
    trajectory.__dict__.update(fields)
    return trajectory


def _copy(t: Trajectory) -> Trajectory:
    return _trusted(
        task_id=t.task_id,
        prompt_ids=list(t.prompt_ids),
        completion_ids=list(t.completion_ids),
        completion_mask=list(t.completion_mask),
        logps=list(t.logps),
        rewards=list(t.rewards),
        reward=t.reward,
        entropy=t.entropy,
        policy_version=t.policy_version,
        traj_id=t.traj_id,
    )


def _mask(row) -> np.ndarray:
    """A 0/1 mask as int8: bytes() converts a list of small ints 3x faster than numpy."""
    try:
        data = bytes(row)
    except (TypeError, ValueError):
        return np.asarray(row, np.int8)
    return np.frombuffer(data, np.int8) if max(data, default=0) <= 1 else np.asarray(row, np.int8)


def _list_array(rows: list, dtype):
    import pyarrow as pa

    # One call per row: the GIL can switch in between.
    parts = [_mask(row) if dtype == np.int8 else np.asarray(row, dtype=dtype) for row in rows]
    offsets = np.zeros(len(parts) + 1, np.int32)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts) if parts else np.empty(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _trajectory_batch(items: list):
    """Writer thread: (trajectory, store_seq) pairs -> one record batch of `TRAJECTORY_SCHEMA`."""
    import pyarrow as pa

    trajectories = [t for t, _ in items]
    arrays = [pa.array([t.task_id for t in trajectories], pa.string())]
    arrays += [_list_array([getattr(t, name) for t in trajectories], dtype) for name, dtype in _LIST_DTYPES]
    arrays += [
        pa.array(np.array([t.reward for t in trajectories], np.float32)),
        pa.array(np.array([t.entropy for t in trajectories], np.float32)),
        pa.array(np.array([t.policy_version for t in trajectories], np.int64)),
        pa.array(np.array([t.traj_id for t in trajectories], np.int64)),
        pa.array(np.array([seq for _, seq in items], np.int64)),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=TRAJECTORY_SCHEMA)


def _task_row_batch(items: list):
    import pyarrow as pa

    return pa.RecordBatch.from_arrays(
        [pa.array([task for task, _ in items], pa.string()), pa.array([row for _, row in items], pa.string())],
        schema=TASK_ROW_SCHEMA,
    )


def _features():
    """The `datasets.Features` of a trajectory shard (what `datasets.load_dataset` shows for a pushed pool)."""
    import datasets

    return datasets.Features.from_dict(TRAJECTORY_FEATURES)


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of what maps text to token ids: the tokenizer's vocabulary, merges, added tokens and normalisation.

    Padding / truncation settings, special-token roles and the chat template do not change what an id means and are
    left out. A processor is fingerprinted by its tokenizer.
    """
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:
        spec = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def task_key(row: dict, task_id_column: str) -> str:
    """A task's id: its `task_id_column` value, else a stable hash of its prompt."""
    if task_id_column in row and row[task_id_column] is not None:
        return str(row[task_id_column])
    prompt = row.get("prompt")
    blob = json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)
    return "prompt-" + hashlib.sha1(blob.encode()).hexdigest()[:16]
