"""`ExperiencePool`: the index of the replay pool, and the queries the trainer makes of it.

The pool applies the ExGRPO rules (`rules.py`) to one step's task outcomes: buckets by difficulty, the skip set, what
is stored and what is evicted; and answers the trainer's replay queries: which tasks can be replayed
(`replay_buckets`, drawn from by `planner.plan_replay` in O(batch)), and which of a task's trajectories
(`choose`, by the current or the saved entropy).

RAM holds an index only: per trajectory its task, entropy, policy version, id and store rank (~40 bytes); per task its
bucket, order stamps and the keys of its trajectories. The trajectories and the tasks' dataset rows live in
memory-mapped Arrow shards written by a background thread (`store.py`); an evicted trajectory leaves a tombstone that
compaction removes. `save` / `load` (`persistence.py`) are incremental, atomic and checked (no pickle anywhere), and
`hub.py` shares a pool as a `datasets` dataset repository. A pool refuses a tokenizer other than the one it was
recorded with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import threading
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from ..planner import TaskBuckets
from .check import SETTINGS, PoolFormatError, bad_trajectory_rows, check_settings, trajectory_problem
from .persistence import load_pool, save_pool
from .records import TaskOutcome, Trajectory, copy_trajectory
from .rules import best_index, eviction, is_solved, selection_order, stores_successes
from .store import (
    TASK_ROW_SCHEMA,
    TASK_ROWS_DIR,
    TRAJECTORIES_DIR,
    TRAJECTORY_SCHEMA,
    Scratch,
    ShardLog,
    Writer,
    _grow,
)

logger = logging.getLogger("trl_exreplay.pool")

__all__ = ["ExperiencePool"]

_STORED_COLUMNS = ("prompt_ids", "completion_ids", "completion_mask", "logps", "rewards", "reward")  # read back
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
        experience_lbound: a task's trajectories are stored when lbound < successes < rbound.
        experience_rbound: the upper bound of that rule (exclusive).
        exp_select_mode: ``"argmin"``, ``"argmax"`` or ``"random"``: replay selection and eviction policy.
        pool_store_mode: ``"all"`` stores every success of a qualifying task, ``"best"`` only the best by entropy.
        max_policy_age: a full task first evicts trajectories older than this many policy versions; None: no
            limit.
        replay_window: recorded with the pool's settings: the trainer replays only among the `replay_window` most
            recently stored trajectories (RLinf's sample window), passing it to `replay_buckets` and `choose`.
        seed: seed of the random choices the pool makes itself (``random`` store/eviction ties and selection).
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
    assert [t.traj_id for t in pool.choose(["t1"], 1)["t1"]] == [0]
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
        if is_solved(outcome.successes, outcome.num_fresh):
            if self._skip_order[t] < 0:  # a set: a task already in it keeps its place
                self._skip_order[t] = self._next_stamp()
            self._set_difficulty(t, -1)
            self._difficulty_order[t] = -1
            self._clear_store(t)
            return
        self._skip_order[t] = -1
        self._set_difficulty(t, outcome.successes)
        self._difficulty_order[t] = self._next_stamp()  # bucket order follows the latest update
        if not stores_successes(outcome.successes, self.experience_lbound, self.experience_rbound):
            return
        successful = list(outcome.successful)
        if self.pool_store_mode == "best" and successful:
            rng = np.random.default_rng([self.seed, self._num_outcomes])
            successful = [successful[best_index([t.entropy for t in successful], self.exp_select_mode, rng)]]
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
        action, i = eviction(
            self._key_entropy[keys].tolist(),
            self._key_traj_id[keys].tolist(),
            self._key_version[keys].tolist(),
            trajectory.entropy,
            trajectory.policy_version,
            self.exp_select_mode,
            self.max_policy_age,
        )
        if action == "refuse":
            return False
        if action == "replace":
            self._replace_slot(t, i, trajectory)
        else:
            self._shift_append(t, i, trajectory)
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
        key = self._trajectories.append((copy_trajectory(trajectory), seq), size)
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
        """Positions of the `num` candidates `exp_select_mode` picks (`rules.selection_order`)."""
        if self.exp_select_mode == "random" and rng is None:
            rng = np.random.default_rng(self.seed)
        return selection_order(entropies, traj_ids, num, self.exp_select_mode, rng)

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
        """Shards, rows, tombstones and buffered rows of the trajectory and task row logs; and the shard files this
        process linked from the one that writes for it (`share_storage`) or wrote itself."""
        out = {f"trajectory_{k}": v for k, v in self._trajectories.stats().items()}
        out.update({f"task_row_{k}": v for k, v in self._task_rows.stats().items()})
        out.update({f"shard_files_{k}": v for k, v in self._scratch.shared.items()})
        return out

    def scratch_folder(self) -> str:
        """The folder where this live pool writes its shard files (made now if not yet)."""
        return self._scratch.root()

    def share_storage(self, source: str | None, wait: float = 5.0) -> None:
        """Read the shard files that another process holding the same pool wrote into its `scratch_folder()` `source`
        instead of writing them again (None: write every file here, the default).

        Ranks of a run hold identical pools, so their shard files are byte for byte the same; with this, one process
        per machine writes them and the others hard-link its files (one copy on disk and in the page cache). Each file
        is checked before it is linked (its size and checksum must be what this process would write); a file that does
        not come within `wait` seconds, differs, or is on another filesystem is written here instead, so sharing never
        changes what is read, only how often it is written (`storage_stats()["shard_files_written"]`)."""
        self._scratch.share_from(source, wait)

    def _read_all(self, keys: list[int]) -> list[Trajectory]:
        """The trajectories of `keys`: pending ones copied, written ones read from their shards (one pass per shard,
        with `pread`: reading maps no page of the pool's files into the process)."""
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
                out[i] = copy_trajectory(place[0])
            else:
                by_shard.setdefault(id(place), (place, []))[1].append((i, row))
        for shard, wanted in by_shard.values():
            for (i, _), fields in zip(wanted, shard.read(_STORED_COLUMNS, [row for _, row in wanted])):
                fields.update(
                    task_id=self._task_ids[tasks[i]], entropy=entropies[i], policy_version=versions[i], traj_id=ids[i]
                )
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
    # The bodies live in persistence.py (saving and loading is that module's job); these are the pool's API.
    save = save_pool
    load = classmethod(load_pool)

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


def _check_settings(settings: dict) -> None:
    """`check.check_settings` for settings given in code: a plain `ValueError` naming the setting."""
    try:
        check_settings(settings, "settings", where="")
    except PoolFormatError as e:
        raise ValueError(f"ExperiencePool: {e.problem}") from None


def _gather(items: list, indices: list[int]) -> list:
    """``[items[i] for i in indices]`` in C (a pool of 200k tasks lists them in a few ms)."""
    if len(indices) < 2:
        return [items[i] for i in indices]
    return list(operator.itemgetter(*indices)(items))


def _close_storage(writer: Writer, scratch: Scratch, logs: tuple[ShardLog, ...]) -> None:
    if threading.current_thread().name != "exreplay-pool-writer":
        writer.close()
    for log in logs:
        log.close_files()
    scratch.remove()


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
