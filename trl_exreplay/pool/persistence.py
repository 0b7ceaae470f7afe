"""Writing an `ExperiencePool`'s storage to a folder and reading it back: incremental, atomic, checked.

A save writes only what the folder lacks (shards new since the last save, hard-linked from the live pool when on the
same file system) and the per-task table of the snapshot, then commits by replacing ``state.json`` (layout and
atomicity: `folder.py`). A load treats the folder as untrusted input (`check.py`): the state, every file's name,
size, checksum and Arrow layout are checked before anything is mapped; rows a model cannot train on are counted and
left out. RAM receives the index only (`index.PoolIndex.from_state`): the shards stay memory-mapped files.

`ExperiencePool.save` and `ExperiencePool.load` call these with the pool's two logs and its index; nothing here
reaches into the pool itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections import Counter

import numpy as np

from .check import (
    CHECKSUM,
    TASKS_SCHEMA,
    PoolFolder,
    PoolFormatError,
    bad_trajectory_rows,
    check_arrow,
    check_tasks_table,
    file_checksum,
    state_checksum,
)
from .folder import (
    FORMAT_VERSION,
    STATE_FILE,
    TASK_ROWS_DIR,
    TASKS_DIR,
    TRAJECTORIES_DIR,
    fsync_path,
    prune,
    read_state,
    write_atomic,
    write_json_atomic,
)
from .index import STATE_COLUMNS, PoolIndex
from .shards import (
    TASK_ROW_SCHEMA,
    TRAJECTORY_SCHEMA,
    Shard,
    ShardLog,
    invalid_rows,
    read_arrow,
    trim_heap,
    write_arrow,
)

logger = logging.getLogger("trl_exreplay.pool")

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


def save_folder(path: str, logs: dict[str, ShardLog], index: PoolIndex, header: dict) -> None:
    """Commit a snapshot of the pool whose sealed `logs` (by folder: trajectories, task rows) and `index` are given
    into folder `path`; `header` holds its ``settings`` and ``tokenizer_fingerprint``. See `ExperiencePool.save`."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    previous = _committed_state(path)
    snapshot = previous["snapshot"] + 1 if previous else 1
    try:
        entries = {kind: log.save_into(os.path.join(path, kind)) for kind, log in logs.items()}
        tasks_file = f"{TASKS_DIR}/{snapshot:08d}-{uuid.uuid4().hex[:12]}.arrow"
        os.makedirs(os.path.join(path, TASKS_DIR), exist_ok=True)
        counters, table = _tasks_table(index, logs, entries)
        write_atomic(os.path.join(path, tasks_file), lambda tmp: write_arrow(tmp, table))
        files = {tasks_file: _file_entry(*_digest(os.path.join(path, tasks_file)))}
        for kind, es in entries.items():
            files.update({f"{kind}/{e['name']}": _file_entry(*e["digest"]) for e in es})
        for folder in (TRAJECTORIES_DIR, TASK_ROWS_DIR, TASKS_DIR):
            fsync_path(os.path.join(path, folder))
        state = {
            "format_version": FORMAT_VERSION,
            "snapshot": snapshot,
            **header,
            "counters": counters,
            "num_trajectories": index.num_live,
            "num_tasks": table.num_rows,
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
                prune(path)
            elif not os.path.exists(os.path.join(path, STATE_FILE)):
                for folder in (TRAJECTORIES_DIR, TASK_ROWS_DIR, TASKS_DIR):
                    shutil.rmtree(os.path.join(path, folder), ignore_errors=True)
        except Exception:  # noqa: BLE001 - the save's own error is the one to report
            logger.exception("trl_exreplay: cleaning up after a failed pool save")
        raise
    prune(path)
    trim_heap()  # the tasks table and the flushed buffers were large transients


def _tasks_table(index: PoolIndex, logs: dict[str, ShardLog], entries: dict[str, list[dict]]):
    """The counters and the per-task table of a snapshot: `index.to_state()`, with each key's row located (shard
    number in the state, row) instead of its key."""
    import pyarrow as pa

    counters, columns, offsets, keys = index.to_state()

    def where(kind, keys):
        locations = logs[kind].locations(keys)
        sids = [entry["sid"] for entry in entries[kind]]
        number = np.full(max([*sids, int((locations >> 32).max(initial=-1))]) + 1, -1, np.int32)
        number[sids] = np.arange(len(sids), dtype=np.int32)  # a shard's place in the state's list of its folder
        return number[locations >> 32], (locations & 0xFFFFFFFF).astype(np.int32)

    traj_shard, traj_row = where(TRAJECTORIES_DIR, keys)
    row_keys = columns.pop("row_key")
    has_row = row_keys >= 0
    row_shard = np.full(len(row_keys), -1, np.int32)
    row_index = np.full(len(row_keys), -1, np.int32)
    row_shard[has_row], row_index[has_row] = where(TASK_ROWS_DIR, row_keys[has_row])

    def lists(values):
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    columns.update(
        row_shard=row_shard,
        row_index=row_index,
        traj_shard=lists(traj_shard),
        traj_row=lists(traj_row),
        traj_id=lists(index.key_traj_id[keys]),
    )
    return counters, pa.table({name: columns[name] for name in TASKS_SCHEMA.names}, schema=TASKS_SCHEMA)


def read_committed(path: str, verify: bool) -> tuple[dict, PoolFolder, object]:
    """The validated state of the pool saved at `path`, its folder and its tasks table (checked: `check.py`)."""
    import pyarrow as pa

    path = os.path.abspath(path)
    if not os.path.lexists(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"No experience pool at {path} (missing {STATE_FILE}).")
    state = read_state(path)
    folder = PoolFolder(path)
    tasks_path = folder.verify(state, state["tasks_file"], verify)
    try:
        tasks = read_arrow(tasks_path)
    except (OSError, pa.ArrowException) as e:
        raise PoolFormatError(tasks_path, f"is not an Arrow file ({e}).") from None
    check_tasks_table(tasks, state, tasks_path, TRAJECTORIES_DIR, TASK_ROWS_DIR)
    return state, folder, tasks


def load_index(
    folder: PoolFolder, state: dict, tasks, logs: dict[str, ShardLog], capacity: int, vocab_size, verify
) -> tuple[PoolIndex, Counter]:
    """Adopt the checked shards of a committed snapshot into the empty `logs` and rebuild the index from its tasks
    table; returns the index and the rows left out, by reason."""
    import pyarrow as pa

    def shards(kind, schema):
        """(index in the state, shard) of each shard file, checked, then mapped one at a time."""
        for i, entry in enumerate(state["shards"][kind]):
            file = folder.verify(state, f"{kind}/{entry['name']}", verify)
            shard = Shard(-1, entry["name"], 0, file)
            try:
                shard.map(file)
            except (OSError, pa.ArrowException) as e:
                raise PoolFormatError(file, f"is not an Arrow file ({e}).") from None
            check_arrow(shard.table(), schema, file)
            if shard.rows != entry["rows"]:
                raise PoolFormatError(file, f"has {shard.rows} rows; the pool recorded {entry['rows']}.")
            if verify:  # checked just now: a later save need not hash it again
                recorded = state["files"][f"{kind}/{entry['name']}"]
                shard.digest = (recorded["size"], recorded[CHECKSUM])
            yield i, shard

    reasons: Counter = Counter()
    n = tasks.num_rows
    columns = {name: tasks.column(name).to_numpy() for name in STATE_COLUMNS}
    columns["task_id"] = tasks.column("task_id").to_pylist()
    row_shard = tasks.column("row_shard").to_numpy()
    row_index = tasks.column("row_index").to_numpy().astype(np.int64)
    row_key = np.full(n, -1, np.int64)
    row_groups = _group_by(row_shard)
    for i, shard in shards(TASK_ROWS_DIR, TASK_ROW_SCHEMA):
        owners = row_groups(i)
        if len(owners) == 0:
            continue
        rows = row_index[owners]
        good = ~invalid_rows(shard.table(), rows, ("task_row",), ())
        row_key[owners[good]] = logs[TASK_ROWS_DIR].adopt(shard, rows[good])
        logs[TASK_ROWS_DIR].keep(shard)  # so that it outlives `folder`
    lost = int(((row_shard >= 0) & (row_key < 0)).sum())
    if lost:
        reasons["missing or malformed task row"] += lost
    columns["row_key"] = row_key

    lengths = np.diff(tasks.column("traj_shard").combine_chunks().offsets.to_numpy())
    entry_task = np.repeat(np.arange(n, dtype=np.int32), lengths)
    flat = {name: tasks.column(name).combine_chunks().flatten().to_numpy() for name in _SLOT_COLUMNS}
    del tasks
    entry_key = np.full(len(entry_task), -1, np.int64)
    per_key: list[tuple[np.ndarray, dict]] = []  # (keys, their index columns), set once the index exists
    entry_groups = _group_by(flat["traj_shard"])
    log = logs[TRAJECTORIES_DIR]
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
        values = {name: table.column(name).to_numpy() for name in _INDEX_COLUMNS} if not bad.all() else {}
        if values:  # a row must be the trajectory the snapshot says it is, with values a model can train on
            wrong = ~bad & (values["traj_id"][safe] != flat["traj_id"][entries])
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
        keys = log.adopt(shard, rows)
        entry_key[good] = keys
        per_key.append((keys, {"task": entry_task[good], **{name: values[name][rows] for name in _INDEX_COLUMNS}}))
        del table, values
        log.keep(shard)
    ok = entry_key >= 0
    index = PoolIndex.from_state(capacity, state["counters"], columns, entry_task[ok], entry_key[ok])
    for keys, values in per_key:
        index.ensure_keys(int(keys.max()) + 1)
        index.key_task[keys] = values["task"]
        index.key_entropy[keys] = values["entropy"]
        index.key_version[keys] = values["policy_version"]
        index.key_traj_id[keys] = values["traj_id"]
        index.key_seq[keys] = values["store_seq"]
    trim_heap()
    return index, reasons


def _committed_state(path: str) -> dict | None:
    """The committed state of the pool folder `path`, None for an empty folder. A folder holding anything else (a
    damaged state, a pool of another format) is refused."""
    if not os.path.lexists(os.path.join(path, STATE_FILE)):
        return None
    try:
        state = read_state(path)
    except PoolFormatError as e:
        raise ValueError(
            f"Not saving into {path}: its {STATE_FILE} is not that of a usable experience pool ({e}). Save to another "
            "folder, or delete this one first."
        ) from None
    return state


def _digest(path: str) -> tuple[int, str]:
    return os.path.getsize(path), file_checksum(path)


def _file_entry(size: int, checksum: str) -> dict:
    return {"size": size, CHECKSUM: checksum}


def _group_by(values: np.ndarray):
    """``i -> indices where values == i`` (ascending), after one sort instead of one scan per `i`."""
    order = np.argsort(values, kind="stable")
    ordered = values[order].astype(np.int64)  # else every searchsorted casts the whole array to compare

    def group(i: int) -> np.ndarray:
        return order[np.searchsorted(ordered, i, side="left") : np.searchsorted(ordered, i, side="right")]

    return group
