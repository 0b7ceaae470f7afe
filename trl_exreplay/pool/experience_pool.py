"""`ExperiencePool`: the replay pool, and the queries the trainer makes of it.

The pool applies the ExGRPO rules (`rules.py`) to each task outcome, on its index in RAM (`index.PoolIndex`: ~40 bytes
a trajectory, and each task's dataset row as JSON); the trajectories live in Arrow files that `datasets` memory-maps
(`store.py`). It answers which tasks can be replayed (`replay_buckets`, drawn from by `planner.plan_replay` in
O(batch)) and which of a task's trajectories (`select`, by `rules.select`). `save` / `load` (`persistence.py`) are
incremental, atomic and checked, and `hub.py` shares a pool as a dataset repository. A pool refuses a tokenizer other
than its own.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import operator
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import pyarrow as pa

from .check import SETTINGS, PoolFormatError, bad_trajectory_rows, check_settings
from .index import PoolIndex, TaskBuckets
from .persistence import load_index, read_committed, save_folder
from .records import TaskOutcome, Trajectory, tokenizer_fingerprint
from .rules import best_index, eviction, is_solved, select, selection_order, stores_successes
from .store import TRAJECTORY_SCHEMA, Log, Scratch

logger = logging.getLogger("trl_exreplay.pool")

__all__ = ["ExperiencePool"]

_INDEX_ONLY = (
    "This pool holds the index only (from_index_snapshot): read or save the pool that holds the rows (rank 0)."
)
_STORED_COLUMNS = ("prompt_ids", "completion_ids", "completion_mask", "logps", "rewards", "reward")  # read back


class ExperiencePool:
    """Replay pool of successful trajectories per task.

    Args (the settings are named as `ExReplayGRPOConfig`'s fields, whose values the trainer gives the pool; the
    names of ExGRPO's own keys, arXiv 2510.02245, are in brackets):
        replay_max_trajectories_per_task: capacity per task.
        replay_store_lbound: a task's trajectories are stored when lbound < successes < rbound
            (``experience_lbound``).
        replay_store_rbound: the upper bound of that rule, exclusive (``experience_rbound``, inclusive there).
        replay_select_mode: ``"argmin"``, ``"argmax"`` or ``"random"``: replay selection and eviction policy
            (``exp_select_mode``).
        replay_store_mode: ``"all"`` stores every success of a qualifying task, ``"best"`` only the best by entropy.
        replay_max_policy_age: a full task first evicts trajectories older than this many policy versions; None: no
            limit.
        seed: seed of the random choices the pool makes itself (``random`` store/eviction ties and selection).
        work_dir: folder under which the live pool writes its shards (a private subfolder, deleted with the pool);
            None: the system temporary folder. Put it on the disk of your checkpoints, not on a tmpfs.
        shard_rows: trajectories per shard file (at most; a save also writes the rows not written yet).

    Example:

    ```python
    from trl_exreplay import ExperiencePool
    from trl_exreplay.pool import TaskOutcome, Trajectory

    pool = ExperiencePool(replay_store_rbound=4)
    traj = Trajectory("t1", [1, 2], [3, 4], [1, 1], [-0.5, -0.7], [1.0], 1.0, entropy=0.9, policy_version=3)
    pool.record_outcome(TaskOutcome("t1", successes=2, num_fresh=4, successful=[traj], task_row='{"prompt": "hi"}'))
    assert pool.bucket_of("t1") == 2 and pool.num_trajectories == 1
    assert [t.traj_id for t in pool.select(["t1"], 1)["t1"]] == [0]
    pool.save("pool_dir")  # then only new shards and the small state on each save
    assert ExperiencePool.load("pool_dir").content_hash() == pool.content_hash()
    ```
    """

    def __init__(
        self,
        replay_max_trajectories_per_task: int = 5,
        replay_store_lbound: int = 0,
        replay_store_rbound: int = 8,
        replay_select_mode: str = "argmin",
        replay_store_mode: str = "all",
        replay_max_policy_age: int | None = None,
        seed: int = 0,
        *,
        work_dir: str | None = None,
        shard_rows: int = 1024,
    ):
        self.replay_max_trajectories_per_task = replay_max_trajectories_per_task
        self.replay_store_lbound = replay_store_lbound
        self.replay_store_rbound = replay_store_rbound
        self.replay_select_mode = replay_select_mode
        self.replay_store_mode = replay_store_mode
        self.replay_max_policy_age = replay_max_policy_age
        self.seed = seed
        _check_settings(self._settings())
        self.tokenizer_fingerprint: str | None = None  # of the tokenizer whose ids the trajectories hold
        self.rejected_reasons: Counter = Counter()  # rows refused (at load, or when added), by reason
        self.vocab_size: int | None = None  # token ids must be below it (None: unchecked), see `set_vocab_size`
        self.index = PoolIndex(replay_max_trajectories_per_task)
        self._scratch = Scratch(work_dir)
        # None in a pool that holds the index only (`from_index_snapshot`)
        self._trajectories: Log | None = Log("trajectories", TRAJECTORY_SCHEMA, self._scratch, shard_rows)
        # Each task's dataset row (JSON), by task index, in RAM (a few hundred bytes a task)
        # and in a save's tasks table
        self._task_rows: dict[int, str] | None = {}
        self._write_failing = False
        self._finalizer = weakref.finalize(self, self._scratch.remove)

    @property
    def rejected_rows(self) -> int:
        """Rows refused, at load or when added (their reasons: `rejected_reasons`); none of them is ever replayed."""
        return sum(self.rejected_reasons.values())

    # ----------------------------------------------------------------------------------------------- updates
    def record_outcome(self, outcome: TaskOutcome, keep_solved: int = 0) -> None:
        """Update buckets, skip set and store with one task's outcome of one group. A solved task leaves its store,
        but for the `keep_solved` best of its successes (by `replay_select_mode`: the stored ones first, then this
        outcome's): rescue's material (`replay_rescue`) if the task is failed again. A solved task is not replayed."""
        index = self.index
        index.num_outcomes += 1
        t = index.task(outcome.task_id)
        if outcome.task_row is not None:
            self._set_task_row(t, outcome.task_row)
        if is_solved(outcome.successes, outcome.num_fresh):
            if index.skip_order[t] < 0:  # a set: a task already in it keeps its place
                index.skip_order[t] = index.next_stamp()
            index.set_difficulty(t, -1)
            index.difficulty_order[t] = -1
            kept = self._keep_best(t, min(keep_solved, int(index.count[t])))
            wanted = min(keep_solved - len(kept), len(outcome.successful))
            if wanted > 0:  # too few stored: this outcome's best successes make up the rest
                rng = np.random.default_rng([self.seed, index.num_outcomes])
                entropies, ids = [t.entropy for t in outcome.successful], list(range(len(outcome.successful)))
                for i in selection_order(entropies, ids, wanted, self.replay_select_mode, rng):
                    self.add(outcome.successful[i])
            return
        index.skip_order[t] = -1
        index.set_difficulty(t, outcome.successes)
        index.difficulty_order[t] = index.next_stamp()  # bucket order follows the latest update
        if not stores_successes(outcome.successes, self.replay_store_lbound, self.replay_store_rbound):
            return
        successful = list(outcome.successful)
        if self.replay_store_mode == "best" and successful:
            rng = np.random.default_rng([self.seed, index.num_outcomes])
            successful = [successful[best_index([t.entropy for t in successful], self.replay_select_mode, rng)]]
        for trajectory in successful:
            self.add(trajectory)

    def add(self, trajectory: Trajectory) -> bool:
        """Store one trajectory under its task, evicting at capacity; returns whether it was kept.

        The pool keeps a copy (later changes to `trajectory` do not reach it), written to a shard file with the next
        `shard_rows` ones.
        A trajectory a model cannot be trained on (non-finite log-prob, reward or entropy, a mask value other than
        0/1, a token id < 0 or >= `vocab_size`) is refused and counted in `rejected_reasons`.
        """
        index = self.index
        row = _trajectory_row(trajectory, index.next_traj_id)  # a copy, in the stored types
        bad, why = bad_trajectory_rows(row, np.zeros(1, np.int64), self.vocab_size)
        if bad[0]:
            self._reject(next(iter(why)), 1, f"a trajectory of task {trajectory.task_id!r}")
            return False
        trajectory.traj_id = index.next_traj_id
        index.next_traj_id += 1
        t = index.task(trajectory.task_id)
        n = int(index.count[t])
        if n < self.replay_max_trajectories_per_task:
            index.append_slot(t, self._store_copy(t, trajectory, row))
            self._write_full()
            return True
        keys = index.slots[t, :n].tolist()
        action, i = eviction(
            index.key_entropy[keys].tolist(),
            index.key_traj_id[keys].tolist(),
            index.key_version[keys].tolist(),
            trajectory.entropy,
            trajectory.policy_version,
            self.replay_select_mode,
            self.replay_max_policy_age,
        )
        if action == "refuse":
            return False
        if action == "replace":
            self._drop([index.replace_slot(t, i, self._store_copy(t, trajectory, row))])
        else:
            self._drop([index.shift_append(t, i, self._store_copy(t, trajectory, row))])
        self._write_full()
        return True

    def _write_full(self) -> None:
        """Write a shard file of each log that has `shard_rows` rows waiting. Called on the training path, once the
        index agrees with the logs: a failed write (a full disk) is logged and its rows wait for the next write, so
        that this pool's index stays that of the other ranks' (which write nothing); `save` and `flush` raise it."""
        if not self.holds_rows:
            return
        try:
            self._trajectories.write(if_full=True)
            self._write_failing = False
        except OSError as e:
            if not self._write_failing:  # once, until a write succeeds again
                logger.warning(
                    "trl_exreplay: the experience pool could not write a shard (%s); its rows wait in memory "
                    "and each add tries again; a save raises until a write succeeds.",
                    e,
                )
            self._write_failing = True

    def _store_copy(self, t: int, trajectory: Trajectory, row: pa.Table) -> int:
        """Append `row` (`trajectory` as a one-row table) to the trajectory log and index it; returns its key."""
        key = self.index.new_key()
        if self._trajectories is not None:
            self._trajectories.put(key, row)
        self.index.set_key(key, t, trajectory.entropy, trajectory.policy_version, trajectory.traj_id)
        return key

    def _drop(self, keys: list[int]) -> None:
        for key in keys:
            if self._trajectories is not None:
                self._trajectories.delete(key)
            self.index.free_keys.append(key)

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
        if not self.holds_rows:
            raise RuntimeError(_INDEX_ONLY)
        self.vocab_size = vocab_size
        self.flush()
        index = self.index
        _, _, keys = index.to_state()
        at = self._trajectories.where[keys]
        bad_keys = []
        for number in np.unique(at >> 32).tolist():
            mine = np.nonzero((at >> 32) == number)[0]
            shard = self._trajectories.shards[number]
            bad, why = bad_trajectory_rows(shard.table(), at[mine] & 0xFFFFFFFF, vocab_size)
            for reason, count in why.items():
                self._reject(reason, count, f"{count} stored trajectory(ies)")
            bad_keys += keys[mine[bad]].tolist()
        for key in bad_keys:
            t = int(index.key_task[key])
            self._drop([index.remove_slot(t, index.keys(t).index(key))])
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
        index = self.index
        index.capacity = self.replay_max_trajectories_per_task  # how far its slots may grow
        for t in np.nonzero(index.count[: len(index.task_ids)] > self.replay_max_trajectories_per_task)[0].tolist():
            self._keep_best(t, self.replay_max_trajectories_per_task)  # a lowered capacity: what a save's load accepts
        return changed

    def _keep_best(self, t: int, num: int) -> list[int]:
        """Keep only the `num` of task `t`'s trajectories that `replay_select_mode` picks first, in that order (the
        task's store is made anew); returns their keys."""
        index = self.index
        keys = index.clear(t)
        order = selection_order(
            index.key_entropy[keys].tolist(),
            index.key_traj_id[keys].tolist(),
            num,
            self.replay_select_mode,
            self._rng(),
        )
        kept = [keys[i] for i in order]
        for key in kept:
            index.append_slot(t, key)
        self._drop([key for key in keys if key not in kept])
        return kept

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

    def _set_task_row(self, t: int, row: str) -> None:
        self.index.has_row[t] = True  # every rank's index knows it; the pool that holds the rows keeps the row
        if self._task_rows is not None:
            self._task_rows[t] = row

    def _task_row_text(self, t: int) -> str:
        if not self.holds_rows:
            raise RuntimeError(_INDEX_ONLY)
        return self._task_rows[t]

    # ---------------------------------------------------------------------------------------------- queries
    def bucket_of(self, task_id: str) -> int | None:
        t = self.index.task_index.get(task_id)
        if t is None or self.index.difficulty[t] < 0:
            return None
        return int(self.index.difficulty[t])

    def buckets(self) -> dict[int, list[str]]:
        """Difficulty -> tasks (each task in exactly one bucket), tasks in the order of their latest update."""
        out: dict[int, list[str]] = {}
        tasks = self.index.ordered(self.index.difficulty_order)
        for t, difficulty in zip(tasks.tolist(), self.index.difficulty[tasks].tolist()):
            out.setdefault(difficulty, []).append(self.index.task_ids[t])
        return dict(sorted(out.items()))

    @property
    def skip_set(self) -> list[str]:
        return _gather(self.index.task_ids, self.index.ordered(self.index.skip_order).tolist())

    @property
    def num_tasks(self) -> int:
        """Tasks with at least one stored trajectory."""
        return self.index.num_stored_tasks

    @property
    def num_trajectories(self) -> int:
        return self.index.num_live

    def stored_tasks(self) -> list[str]:
        """Tasks with at least one stored trajectory, in the order their store was created."""
        index = self.index
        return [index.task_ids[t] for t in index.ordered(index.store_order).tolist() if index.count[t] > 0]

    def task_row(self, task_id: str) -> dict | None:
        t = self.index.task_index.get(task_id)
        if t is None or not self.index.has_row[t]:
            return None
        return json.loads(self._task_row_text(t))

    def trajectories(
        self,
        task_id: str,
        current_step: int | None = None,
        max_policy_age: int | None = None,
    ) -> list[Trajectory]:
        """Copies of a task's stored trajectories, in store order (read from the shards); with the arguments, those
        young enough to replay: the ones `select` chooses among."""
        t = self.index.task_index.get(task_id)
        return [] if t is None else self._read_all(self.index.keys(t, current_step, max_policy_age))

    def num_selectable(
        self,
        task_id: str,
        current_step: int | None = None,
        max_policy_age: int | None = None,
    ) -> int:
        """How many trajectories `select` chooses among for `task_id` (those `trajectories` would return, with the same
        arguments; counted on the index: nothing is read)."""
        t = self.index.task_index.get(task_id)
        return 0 if t is None else len(self.index.keys(t, current_step, max_policy_age))

    def replayable_tasks(
        self,
        min_trajectories: int = 1,
        current_step: int | None = None,
        max_policy_age: int | None = None,
    ) -> list[tuple[str, int]]:
        """(task, difficulty) of bucketed tasks outside the skip set with enough replayable trajectories, in bucket
        order (vectorized over the index; reads no trajectory). O(tasks): the trainer draws from `replay_buckets`."""
        tasks, difficulties = self.index.replayable_listing(min_trajectories, current_step, max_policy_age)
        return list(zip(_gather(self.index.task_ids, tasks.tolist()), difficulties.tolist()))

    def replay_buckets(
        self,
        min_trajectories: int = 1,
        current_step: int | None = None,
        max_policy_age: int | None = None,
    ) -> TaskBuckets:
        """The buckets (their tasks that hold trajectories), for `planner.plan_replay` to draw replay tasks from in
        O(batch): the tasks `replayable_tasks` lists (with these arguments) are those the draw can return, with the
        same weights, without listing them. Valid until the pool changes.
        """
        names = lambda tasks: _gather(self.index.task_ids, [int(t) for t in tasks])  # noqa: E731
        return self.index.buckets(min_trajectories, current_step, max_policy_age, names)

    def select(
        self,
        task_ids: Sequence[str],
        num: int,
        current_step: int | None = None,
        max_policy_age: int | None = None,
        rng: np.random.Generator | None = None,
    ) -> dict[str, list[Trajectory]]:
        """The `num` trajectories each of `task_ids` replays (`rules.select` by `replay_select_mode`, on the saved
        entropies; with `current_step` and `max_policy_age`, among those young enough; `rng`: the draws of ``random``,
        default: seeded by the pool's `seed`). Chosen on the index: only the chosen trajectories are read, all in one
        pass over their shards."""
        index = self.index
        keys: dict[str, list[int]] = {}
        for task_id in task_ids:
            t = index.task_index.get(task_id)
            keys[task_id] = [] if t is None else index.keys(t, current_step, max_policy_age)
        # On the index: the entropies and ids the read trajectories would carry.
        candidates = {task: (index.key_entropy[k].tolist(), index.key_traj_id[k].tolist()) for task, k in keys.items()}
        chosen = {
            task: [keys[task][i] for i in order]
            for task, order in select(candidates, num, self.replay_select_mode, self._rng(rng)).items()
        }
        trajectories = iter(self._read_all([key for keys in chosen.values() for key in keys]))
        return {task_id: [next(trajectories) for _ in keys] for task_id, keys in chosen.items()}

    def _rng(self, rng: np.random.Generator | None = None) -> np.random.Generator | None:
        """`rng`, or under ``random`` selection one seeded by the pool's `seed` (the other modes draw nothing)."""
        if rng is None and self.replay_select_mode == "random":
            return np.random.default_rng(self.seed)
        return rng

    def stats(self) -> dict[str, float]:
        out = {
            "pool_tasks": float(self.num_tasks),
            "pool_trajectories": float(self.num_trajectories),
            "skip_set": float(int((self.index.skip_order[: len(self.index.task_ids)] >= 0).sum())),
            "pool_rejected_rows": float(self.rejected_rows),
        }
        difficulties = self.index.difficulty[: len(self.index.task_ids)]
        for difficulty, count in enumerate(np.bincount(difficulties[difficulties >= 0]).tolist()):
            if count:
                out[f"bucket_{difficulty}"] = float(count)
        return out

    def storage_stats(self) -> dict[str, int]:
        """Shards, rows, dead rows and pending rows of the trajectory log ({} in a pool that holds the index only)."""
        return {f"trajectory_{k}": v for k, v in self._trajectories.stats().items()} if self.holds_rows else {}

    def scratch_folder(self) -> str | None:
        """The folder where this live pool writes its shard files (made now if not yet); None if it holds no rows."""
        if not self.holds_rows:
            return None
        return self._scratch.folder()

    # -------------------------------------------------------------------------------------------- index only
    @property
    def holds_rows(self) -> bool:
        """False for a pool made by `from_index_snapshot`: it decides what is stored, evicted and replayed as the pool
        it copies does, but reads no trajectory or task row (the trainer's ranks other than 0 hold such a pool)."""
        return self._trajectories is not None

    def index_snapshot(self) -> dict:
        """What `from_index_snapshot` needs: settings, tokenizer, vocabulary and the index (about 40 bytes per
        trajectory; for another process of the same run, never for a file)."""
        return {
            "settings": self._settings(),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "vocab_size": self.vocab_size,
            "rejected_reasons": dict(self.rejected_reasons),
            "index": copy.deepcopy(self.index),
        }

    @classmethod
    def from_index_snapshot(cls, snapshot: dict) -> ExperiencePool:
        """A pool holding the index of another one (`index_snapshot`) and no row: the same outcomes recorded in both
        keep their indexes equal (`index_hash`), while only the other pool writes and reads rows."""
        pool = cls(**snapshot["settings"])
        pool._trajectories = pool._task_rows = None
        pool.tokenizer_fingerprint = snapshot["tokenizer_fingerprint"]
        pool.vocab_size = snapshot["vocab_size"]
        pool.rejected_reasons.update(snapshot["rejected_reasons"])
        pool.index = snapshot["index"]
        return pool

    def _read_all(self, keys: list[int]) -> list[Trajectory]:
        """The trajectories of `keys`, read from their logs (one read a shard), in the stored types."""
        if keys and not self.holds_rows:
            raise RuntimeError(_INDEX_ONLY)
        index = self.index
        tasks = index.key_task[keys].tolist()
        entropies = index.key_entropy[keys].tolist()  # float32 -> the same Python floats the pool stored
        versions = index.key_version[keys].tolist()
        ids = index.key_traj_id[keys].tolist()
        out = []
        for i, found in enumerate(self._trajectories.read(keys, _STORED_COLUMNS) if keys else []):
            found.update(
                task_id=index.task_ids[tasks[i]], entropy=entropies[i], policy_version=versions[i], traj_id=ids[i]
            )
            trajectory = object.__new__(Trajectory)
            trajectory.__dict__ = found  # already in the stored types: no per-token normalisation
            out.append(trajectory)
        return out

    # ------------------------------------------------------------------------------------------------ storage
    def flush(self) -> None:
        """Write the pending rows to shard files now, and compact (a save does too)."""
        if self.holds_rows:
            self._trajectories.write()

    def compact(self) -> None:
        """Rewrite every shard that holds removed rows, now (otherwise only those with more removed than live rows
        are, after each write and before a save)."""
        if self.holds_rows:
            self._trajectories.compact()

    def close(self) -> None:
        """Delete the pool's scratch folder (saved pools keep their own links to its files)."""
        self._finalizer()

    def __enter__(self) -> ExperiencePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ persistence
    def save(self, path: str) -> None:
        """Save the pool to folder `path`, incrementally and atomically (`persistence.py`): only the shards new since
        the last save (hard links to the live pool's files on the same file system) and the tasks table are written,
        then ``state.json`` is replaced, so a process killed at any instant leaves the previous save complete.
        """
        if not self.holds_rows:
            raise RuntimeError(_INDEX_ONLY)
        header = {"settings": self._settings(), "tokenizer_fingerprint": self.tokenizer_fingerprint}
        save_folder(path, self._trajectories, self._task_rows, self.index, header)

    @classmethod
    def load(
        cls,
        path: str,
        *,
        tokenizer=None,
        vocab_size: int | None = None,
        verify: bool = True,
        allow_missing_fingerprint: bool = False,
        work_dir: str | None = None,
        shard_rows: int = 1024,
    ) -> ExperiencePool:
        """Load the pool saved at `path`, an untrusted folder (`check.py`): its state, file names, sizes, checksums
        (unless ``verify=False``, for a trusted local disk) and Arrow layouts are checked before anything is mapped;
        damage raises one `PoolFormatError` (a `ValueError`) naming the file. A row a model cannot train on (see
        `check.bad_trajectory_rows`, with `vocab_size`), missing, or of another task, and a task row that is not
        JSON, are left out and counted in `rejected_reasons`.

        Given a `tokenizer`, a pool recorded with another one is refused (`ValueError`), and so is a pool recorded
        with none, unless `allow_missing_fingerprint`. `pool.hub.pool_from_hub` always verifies.
        """
        state, folder, tasks = read_committed(path, verify)
        pool = cls(**state["settings"], work_dir=work_dir, shard_rows=shard_rows)
        try:
            pool.index, pool._task_rows, reasons = load_index(
                folder, state, tasks, pool._trajectories, pool.replay_max_trajectories_per_task, vocab_size, verify
            )
        except BaseException:
            pool.close()
            raise
        pool.tokenizer_fingerprint = state["tokenizer_fingerprint"]
        pool.vocab_size = vocab_size
        pool.rejected_reasons.update(reasons)
        if pool.rejected_rows:
            logger.warning(
                "trl_exreplay: %d row(s) of the experience pool at %s were left out (%s); counted in "
                "ExperiencePool.rejected_rows.",
                pool.rejected_rows,
                folder.path,
                ", ".join(f"{n} {reason}" for reason, n in sorted(pool.rejected_reasons.items())),
            )
        if tokenizer is not None:
            if pool.tokenizer_fingerprint is None and not allow_missing_fingerprint:
                pool.close()
                raise ValueError(
                    f"The experience pool at {folder.path} records no tokenizer fingerprint, so nothing says its "
                    "token ids belong to the given tokenizer. Pass allow_missing_fingerprint=True to use it with this "
                    "tokenizer anyway (it is then bound to it), or start from an empty pool."
                )
            try:
                pool.bind_tokenizer(tokenizer_fingerprint(tokenizer), source=folder.path)
            except ValueError:
                pool.close()
                raise
        return pool

    def index_hash(self) -> str:
        """SHA-256 of what the index decides with: settings, counters, buckets, skip set, and each stored trajectory's
        id, policy version and entropy. Equal on the ranks of a run, whichever of them holds the rows."""
        index, tasks = self.index, range(len(self.index.task_ids))
        keys = {t: index.keys(t) for t in tasks if index.count[t] > 0}
        columns = (index.key_traj_id, index.key_version, index.key_entropy)
        state = {
            "settings": self._settings(),
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "counters": [index.next_traj_id, index.num_outcomes],
            "difficulty": [
                [index.task_ids[t], int(index.difficulty[t])] for t in index.ordered(index.difficulty_order).tolist()
            ],
            "skip_set": self.skip_set,
            "with_row": sorted(_gather(index.task_ids, np.nonzero(index.has_row[: len(tasks)])[0].tolist())),
            "store": sorted([index.task_ids[t], [column[k].tolist() for column in columns]] for t, k in keys.items()),
        }
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()

    def content_hash(self) -> str:
        """SHA-256 of the pool's whole content (its `index_hash`, task rows and every trajectory): equal pools, equal
        hashes. Reads the whole pool: meant for tests and checks, not for a training loop."""
        digest = hashlib.sha256(self.index_hash().encode())
        for task_id in sorted(self.index.task_index):
            if self.index.has_row[self.index.task_index[task_id]]:
                digest.update(json.dumps([task_id, self.task_row(task_id)], sort_keys=True).encode())
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


def _trajectory_row(trajectory: Trajectory, traj_id: int) -> pa.Table:
    """`trajectory` as one row of `TRAJECTORY_SCHEMA`, under id `traj_id` (pyarrow converts the lists: ~0.13 ms for
    1k tokens)."""
    columns = {name: [getattr(trajectory, name)] for name in TRAJECTORY_SCHEMA.names[:-1]}
    return pa.table({**columns, "traj_id": [traj_id]}, schema=TRAJECTORY_SCHEMA)
