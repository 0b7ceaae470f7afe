"""A pool's saved folder: its layout, its atomic commit, and the save and load of its storage (incremental, checked).

A save writes only what the folder lacks (shards new since the last save, hard-linked from the live pool when on the
same file system) and the save's tasks table, then commits by replacing ``state.json``; the files no committed state
names are pruned after. A process killed at any instant leaves the previous ``state.json`` and all its files::

    state.json                  settings, counters, the files below with their sizes and xxh3-64 checksums, and its
                                own checksum
    tasks-<id>.arrow            one row per task: its bucket, skip set and store state, its dataset row (JSON), and
                                the ids of its trajectories in store order
    trajectories-<id>.arrow     trajectory shards, one row per trajectory (`datasets` features); rows no task lists
                                are evicted ones, dropped at the next compaction

A load checks the folder as untrusted input (`check.py`) before anything is mapped; rows a model cannot train on are
counted and left out. RAM receives the index (`index.PoolIndex.from_state`) and the task rows; the shards stay
memory-mapped files.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import check
from .check import CHECKSUM, PoolFolder, PoolFormatError
from .index import COUNTERS, STATE_COLUMNS, PoolIndex
from .store import TRAJECTORY_SCHEMA, Log, Shard, fsync_path, read_arrow, write_arrow, write_atomic, write_json_atomic

# 7: the settings named as the config's fields (`replay_store_rbound`, ..., were ExGRPO's `experience_rbound`, ...);
# 6: no store rank (`store_seq` column, `counters.stored_count`: they served only the removed replay window); 5: one
# folder, trajectories found by id; 4: task rows in the tasks table; 3: every file's checksum
FORMAT_VERSION = 7
STATE_FILE = "state.json"
_MAX_STATE_BYTES = 64 << 20
_INDEX_COLUMNS = (("entropy", np.float32), ("policy_version", np.int64))  # kept in RAM

logger = logging.getLogger("trl_exreplay.pool")


def read_state(path: str) -> dict:
    """The committed state of the pool saved at `path` (``state.json``), parsed and validated (`check.parse_state`)."""
    file = PoolFolder(path).file(STATE_FILE)
    if os.path.lexists(file) and not os.path.isfile(file):
        raise PoolFormatError(file, "is not a regular file.")  # opening a FIFO would block
    try:
        with open(file, "rb") as f:
            text = f.read(_MAX_STATE_BYTES + 1)
    except OSError as e:
        raise PoolFormatError(file, f"cannot be read ({e.strerror}).") from None
    if len(text) > _MAX_STATE_BYTES:
        raise PoolFormatError(file, f"is larger than {_MAX_STATE_BYTES} bytes; a pool's state is far smaller.")
    return check.parse_state(text, file, FORMAT_VERSION)


def state_files(state: dict) -> list[str]:
    """The files of the pool folder a committed state names, state.json first."""
    return [STATE_FILE, state["tasks"]["name"]] + [entry["name"] for entry in state["shards"]]


# The names a save writes (`store.Log` names its shards so), and those of `write_atomic`'s temporary files.
_OURS = re.compile(r"\.?(tasks|trajectories)-[0-9a-f]{16}\.arrow(\.tmp-[0-9a-f]{12})?|\.state\.json\.tmp-[0-9a-f]{12}")


def _prune(path: str, keep: set[str]) -> None:
    """Delete the files a save writes in `path` that are not in `keep`, and the temporary files of interrupted
    saves."""
    for name in os.listdir(path):
        if _OURS.fullmatch(name) and name not in keep and not os.path.isdir(os.path.join(path, name)):
            os.remove(os.path.join(path, name))


def save_folder(path: str, log: Log, task_rows: dict[int, str], index: PoolIndex, header: dict) -> None:
    """Commit a snapshot of the pool whose trajectory `log`, `task_rows` (task index -> JSON) and `index` are given
    into folder `path`; `header` holds its ``settings`` and ``tokenizer_fingerprint``. See `ExperiencePool.save`."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    _committed_state(path)  # refuses a folder that holds something else
    try:
        shards = log.save_into(path)
        for entry in shards:
            fsync_path(os.path.join(path, entry["name"]))  # a scratch file's bytes may not be on disk yet
        tasks = {"name": f"tasks-{uuid.uuid4().hex[:16]}.arrow"}
        table = _tasks_table(index, task_rows)
        write_atomic(os.path.join(path, tasks["name"]), lambda tmp: write_arrow(tmp, table))
        tasks.update(size=os.path.getsize(os.path.join(path, tasks["name"])))
        tasks[CHECKSUM] = check.file_checksum(os.path.join(path, tasks["name"]))
        counters = {name: int(getattr(index, name)) for name in COUNTERS}
        state = {"format_version": FORMAT_VERSION, **header, "counters": counters, "tasks": tasks, "shards": shards}
        state["checksum"] = check.state_checksum(state)
        # Commit only what its load accepts.
        check.check_tasks_table(table, check.parse_state(json.dumps(state), STATE_FILE, FORMAT_VERSION), tasks["name"])
        fsync_path(path)  # the new files' names, before the state that names them
        write_json_atomic(os.path.join(path, STATE_FILE), state)  # the commit
        fsync_path(path)
    except BaseException:
        try:  # remove what this save added, unless it got as far as its commit
            committed = _committed_state(path)
            _prune(path, set(state_files(committed)) if committed else set())
        except Exception:  # noqa: BLE001 - the save's own error is the one to report
            logger.exception("trl_exreplay: cleaning up after a failed pool save")
        raise
    _prune(path, set(state_files(state)))


def _tasks_table(index: PoolIndex, task_rows: dict[int, str]) -> pa.Table:
    columns, offsets, keys = index.to_state()
    columns["task_row"] = pa.array([task_rows.get(t) for t in range(len(columns["task_id"]))], pa.string())
    columns["traj_ids"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(index.key_traj_id[keys]))
    return pa.table({name: columns[name] for name in check.TASKS_SCHEMA.names}, schema=check.TASKS_SCHEMA)


def _committed_state(path: str) -> dict | None:
    """The committed state of the pool folder `path`, None for a folder without one. A folder holding anything else (a
    damaged state, a pool of another format) is refused."""
    if not os.path.lexists(os.path.join(path, STATE_FILE)):
        return None
    try:
        return read_state(path)
    except PoolFormatError as e:
        raise ValueError(
            f"Not saving into {path}: its {STATE_FILE} is not that of a usable experience pool ({e}). Save to another "
            "folder, or delete this one first."
        ) from None


def read_committed(path: str, verify: bool) -> tuple[dict, PoolFolder, pa.Table]:
    """The validated state of the pool saved at `path`, its folder and its checked tasks table."""
    path = os.path.abspath(path)
    if not os.path.lexists(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"No experience pool at {path} (missing {STATE_FILE}).")
    state = read_state(path)
    folder = PoolFolder(path)
    file = folder.verify(state["tasks"], verify)
    tasks = _read_checked(file)
    check.check_tasks_table(tasks, state, file)
    return state, folder, tasks


def _read_checked(file: str, schema: pa.Schema | None = None) -> pa.Table:
    """The Arrow file `file` read into memory (not mapped: the checks leave no page of it counted in resident memory),
    checked against `schema`."""
    try:
        table = read_arrow(file)
    except (OSError, pa.ArrowException) as e:
        raise PoolFormatError(file, f"is not an Arrow file ({e}).") from None
    if schema is not None:
        check.check_arrow(table, schema, file)
        check.check_no_nulls(table, file)
    return table


def load_index(folder: PoolFolder, state: dict, tasks: pa.Table, log: Log, capacity: int, vocab_size, verify):
    """Adopt the checked shards of a committed save into the empty trajectory `log` and rebuild the index from its
    tasks table; returns the index, the task rows (task index -> JSON) and the rows left out, by reason. A trajectory's
    key is its place among the kept ones in the tasks table's lists."""
    reasons: Counter = Counter()
    columns = {name: tasks.column(name).to_numpy() for name in STATE_COLUMNS}
    columns["task_id"] = tasks.column("task_id").to_pylist()
    task_rows = {t: row for t, row in enumerate(tasks.column("task_row").to_pylist()) if row is not None}
    for t in [t for t, row in task_rows.items() if not _is_json(row)]:  # `task_row()` parses it, mid-training
        del task_rows[t]
        reasons["task row not JSON"] += 1
    columns["has_row"] = np.isin(np.arange(tasks.num_rows), list(task_rows))

    lists = tasks.column("traj_ids").combine_chunks()
    entry_task = np.repeat(np.arange(tasks.num_rows, dtype=np.int32), np.diff(lists.offsets.to_numpy()))
    entry_id = lists.values.to_numpy()  # unique (`check_tasks_table`)
    by_id = np.argsort(entry_id)
    found, ok = np.zeros(len(entry_id), bool), np.zeros(len(entry_id), bool)
    values = {name: np.zeros(len(entry_id), dtype) for name, dtype in _INDEX_COLUMNS}
    task_names = tasks.column("task_id").combine_chunks()
    adopted = []
    for entry in state["shards"]:
        file = folder.verify(entry, verify)
        table = _read_checked(file, TRAJECTORY_SCHEMA)
        if table.num_rows != entry["rows"]:
            raise PoolFormatError(file, f"has {table.num_rows} rows; the pool recorded {entry['rows']}.")
        # An id the pool has yet to hand out, even in a row no task lists: a later trajectory would take it (the next
        # load would find the id twice).
        given, high = table.column("traj_id").to_numpy(), state["counters"]["next_traj_id"]
        if len(given) and (given.min() < 0 or given.max() >= high):
            raise PoolFormatError(file, f"holds a `traj_id` outside [0, counters.next_traj_id) = [0, {high}).")
        # The rows a task lists (the others are evicted trajectories), and the place of each in the tasks table.
        row_ids = table.column("traj_id").to_numpy()
        at = np.searchsorted(entry_id, row_ids, sorter=by_id).clip(max=max(len(entry_id) - 1, 0))
        rows = np.nonzero(entry_id[by_id[at]] == row_ids)[0] if len(entry_id) else np.zeros(0, np.int64)
        entries = by_id[at[rows]]
        if found[entries].any() or len(np.unique(entries)) < len(entries):
            raise PoolFormatError(file, "holds a trajectory that another row of the pool holds too.")
        if len(entries) != entry["live"]:  # `push_pool` trusts it to tell a folder that needs compacting
            raise PoolFormatError(
                file, f"holds {len(entries)} trajectories a task lists; the state says {entry['live']}."
            )
        found[entries] = True
        bad, why = check.bad_trajectory_rows(table, rows, vocab_size)
        reasons.update(why)
        listed_by = task_names.take(entry_task[entries])
        wrong = ~pc.equal(table.column("task_id").take(rows), listed_by).to_numpy(zero_copy_only=False) & ~bad
        reasons["row of another task"] += int(wrong.sum())
        bad |= wrong
        for name, _ in _INDEX_COLUMNS:
            values[name][entries] = table.column(name).to_numpy()[rows]
        ok[entries[~bad]] = True
        adopted.append((entry, file, entries[~bad], rows[~bad]))
        del table  # one shard in memory at a time
    reasons["missing row"] += int((~found).sum())
    key_of = np.cumsum(ok) - 1  # the kept trajectories' keys: 0, 1, ... in the tasks table's order
    for entry, file, entries, rows in adopted:
        if len(entries):  # a shard that holds no kept row is not mapped, nor saved again
            shard = Shard.open(entry["name"], file, TRAJECTORY_SCHEMA, rows=entry["rows"])
            if verify:  # checked just now: a later save need not hash it again
                shard.digests[shard.inode] = (entry["size"], entry[CHECKSUM])
            log.adopt(shard)
            log.add_shard(shard, key_of[entries], rows)
    index = PoolIndex.from_state(capacity, state["counters"], columns, entry_task[ok], key_of[ok])
    kept = len(key_of[ok])
    index.ensure_keys(kept)
    index.key_task[:kept], index.key_traj_id[:kept] = entry_task[ok], entry_id[ok]
    index.key_entropy[:kept], index.key_version[:kept] = values["entropy"][ok], values["policy_version"][ok]
    return index, task_rows, +reasons  # without the zero counts


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
