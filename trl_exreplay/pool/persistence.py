"""A pool's saved folder: its layout, its atomic commit, and the save and load of its storage (incremental, checked).

A save writes only what the folder lacks (shards new since the last save, hard-linked from the live pool when on the
same file system) and the snapshot's per-task table, then commits by replacing ``state.json``; the files no committed
state names are pruned after. A process killed at any instant leaves the previous ``state.json`` and all its files::

    state.json                     the committed snapshot: settings, counters, shard lists, its tasks table, every
                                   file's size and xxh3-64 checksum, and its own checksum
    tasks/<snapshot>-<id>.arrow    per-task state of a snapshot (difficulty, skip set, where its rows are)
    trajectories/*.arrow           trajectory shards, one row per trajectory (`datasets` features)
    task_rows/*.arrow              task row shards (task id, the dataset row as JSON)

A load treats the folder as untrusted input (`check.py`): the state, every file's name, size, checksum and Arrow layout
are checked before anything is mapped; rows a model cannot train on are counted and left out. RAM receives the index
only (`index.PoolIndex.from_state`); the shards stay memory-mapped files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa

from .check import (
    CHECKSUM,
    TASKS_SCHEMA,
    PoolFolder,
    PoolFormatError,
    bad_trajectory_rows,
    check_arrow,
    check_tasks_table,
    file_checksum,
    invalid_rows,
    parse_state,
    state_checksum,
)
from .index import STATE_COLUMNS, PoolIndex
from .store import (
    TASK_ROW_SCHEMA,
    TRAJECTORY_SCHEMA,
    Log,
    Shard,
    fsync_path,
    read_arrow,
    write_arrow,
    write_atomic,
    write_json_atomic,
)

FORMAT_VERSION = 3  # 3: every file's size and xxh3-64 checksum recorded in state.json
STATE_FILE = "state.json"
TRAJECTORIES_DIR = "trajectories"
TASK_ROWS_DIR = "task_rows"
TASKS_DIR = "tasks"
_MAX_STATE_BYTES = 64 << 20

logger = logging.getLogger("trl_exreplay.pool")

# Columns of a trajectory shard that must be present and non-null for the row to be replayable.
_REQUIRED = tuple(TRAJECTORY_SCHEMA.names[1:])
_SAME_LENGTH = ("completion_ids", "completion_mask", "logps")
_INDEX_COLUMNS = ("traj_id", "entropy", "policy_version", "store_seq")  # what the RAM index keeps of a trajectory


# ------------------------------------------------------------------------------------------------------ the folder
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
    return parse_state(text, file, FORMAT_VERSION, (TRAJECTORIES_DIR, TASK_ROWS_DIR), TASKS_DIR)


def state_files(state: dict) -> list[str]:
    """The files (relative to the pool folder) a committed state names, state.json first."""
    files = [STATE_FILE, state["tasks_file"]]
    for kind in (TRAJECTORIES_DIR, TASK_ROWS_DIR):
        files += [f"{kind}/{entry['name']}" for entry in state["shards"][kind]]
    return files


def prune(path: str) -> None:
    """After a commit: delete the files of the pool's folders that the committed state does not name, and the
    temporary files of interrupted saves. A crash here leaves garbage, never a broken pool."""
    keep = set(state_files(read_state(path)))
    for folder in (TRAJECTORIES_DIR, TASK_ROWS_DIR, TASKS_DIR):
        if os.path.isdir(os.path.join(path, folder)):
            for name in os.listdir(os.path.join(path, folder)):
                if f"{folder}/{name}" not in keep:
                    target = os.path.join(path, folder, name)
                    shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    for name in os.listdir(path):
        if name.startswith(f".{STATE_FILE}.tmp-"):
            os.remove(os.path.join(path, name))


# ------------------------------------------------------------------------------------------------------------ save
def save_folder(path: str, logs: dict[str, Log], index: PoolIndex, header: dict) -> None:
    """Commit a snapshot of the pool whose `logs` (by folder: trajectories, task rows) and `index` are given into
    folder `path`; `header` holds its ``settings`` and ``tokenizer_fingerprint``. See `ExperiencePool.save`."""
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
        files = {tasks_file: _file_entry(os.path.join(path, tasks_file))}
        for kind, es in entries.items():
            for e in es:
                fsync_path(os.path.join(path, kind, e["name"]))  # a scratch file's bytes may not be on disk yet
                files[f"{kind}/{e['name']}"] = {"size": e["size"], CHECKSUM: e["checksum"]}
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
        parse_state(json.dumps(state), STATE_FILE, FORMAT_VERSION, (TRAJECTORIES_DIR, TASK_ROWS_DIR), TASKS_DIR)
        write_json_atomic(os.path.join(path, STATE_FILE), state)  # the commit: of a state its load accepts
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


def _tasks_table(index: PoolIndex, logs: dict[str, Log], entries: dict[str, list[dict]]):
    """The counters and the per-task table of a snapshot: `index.to_state()`, with each key's row located (the shard's
    place in the state's list, its row) instead of its key."""
    counters, columns, offsets, keys = index.to_state()

    def where(kind, keys):
        at = logs[kind].where[keys]
        numbers = [entry["shard"] for entry in entries[kind]]
        place = np.full(max(numbers, default=0) + 1, -1, np.int32)
        place[numbers] = np.arange(len(numbers), dtype=np.int32)
        return place[at >> 32], (at & 0xFFFFFFFF).astype(np.int32)

    traj_shard, traj_row = where(TRAJECTORIES_DIR, keys)
    has_row = columns["row_key"] >= 0
    row_shard = np.full(len(has_row), -1, np.int32)
    row_index = np.full(len(has_row), -1, np.int32)
    row_shard[has_row], row_index[has_row] = where(TASK_ROWS_DIR, np.nonzero(has_row)[0])

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


def _committed_state(path: str) -> dict | None:
    """The committed state of the pool folder `path`, None for an empty folder. A folder holding anything else (a
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


def _file_entry(path: str) -> dict:
    return {"size": os.path.getsize(path), CHECKSUM: file_checksum(path)}


# ------------------------------------------------------------------------------------------------------------ load
def read_committed(path: str, verify: bool) -> tuple[dict, PoolFolder, object]:
    """The validated state of the pool saved at `path`, its folder and its tasks table (checked: `check.py`)."""
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
    folder: PoolFolder, state: dict, tasks, logs: dict[str, Log], capacity: int, vocab_size, verify
) -> tuple[PoolIndex, Counter]:
    """Adopt the checked shards of a committed snapshot into the empty `logs` and rebuild the index from its tasks
    table; returns the index and the rows left out, by reason. A task's row key is its index, a trajectory's key its
    place in the tasks table's lists."""

    def shards(kind, schema):
        """(place in the state, its table read into memory, `map()` -> its shard) of each shard file, checked."""
        for i, entry in enumerate(state["shards"][kind]):
            name = f"{kind}/{entry['name']}"
            file = folder.verify(state, name, verify)
            try:
                table = read_arrow(file)
            except (OSError, pa.ArrowException) as e:
                raise PoolFormatError(file, f"is not an Arrow file ({e}).") from None
            check_arrow(table, schema, file)
            if table.num_rows != entry["rows"]:
                raise PoolFormatError(file, f"has {table.num_rows} rows; the pool recorded {entry['rows']}.")

            def open_shard(entry=entry, name=name, file=file):
                shard = Shard.open(entry["name"], file, schema, rows=entry["rows"])
                if verify:  # checked just now: a later save need not hash it again
                    shard.digests[shard.inode] = (state["files"][name]["size"], state["files"][name][CHECKSUM])
                return shard

            yield i, table, open_shard

    reasons: Counter = Counter()
    n = tasks.num_rows
    columns = {name: tasks.column(name).to_numpy() for name in STATE_COLUMNS}
    columns["task_id"] = tasks.column("task_id").to_pylist()
    row_shard = tasks.column("row_shard").to_numpy()
    row_index = tasks.column("row_index").to_numpy().astype(np.int64)
    row_key = np.full(n, -1, np.int64)
    row_groups = _groups(row_shard, len(state["shards"][TASK_ROWS_DIR]))
    for i, table, open_shard in shards(TASK_ROWS_DIR, TASK_ROW_SCHEMA):
        owners = row_groups[i]
        rows = row_index[owners]
        good = ~invalid_rows(table, rows, ("task_id", "task_row"), ())
        ids = table.column("task_id").to_pylist()
        good[good] = [ids[row] == columns["task_id"][t] for row, t in zip(rows[good], owners[good])]  # its own row
        del table
        _adopt(logs[TASK_ROWS_DIR], open_shard, owners[good], rows[good])
        row_key[owners[good]] = owners[good]
    lost = int(((row_shard >= 0) & (row_key < 0)).sum())
    if lost:
        reasons["missing or malformed task row"] += lost
    columns["row_key"] = row_key

    lengths = np.diff(tasks.column("traj_shard").combine_chunks().offsets.to_numpy())
    entry_task = np.repeat(np.arange(n, dtype=np.int32), lengths)
    flat = {
        name: tasks.column(name).combine_chunks().flatten().to_numpy()
        for name in ("traj_shard", "traj_row", "traj_id")
    }
    ok = np.zeros(len(entry_task), bool)
    values = {name: np.zeros(len(entry_task), dtype) for name, dtype in
              (("traj_id", np.int64), ("entropy", np.float32), ("policy_version", np.int64), ("store_seq", np.int64))}  # fmt: skip
    adopted = []
    entry_groups = _groups(flat["traj_shard"], len(state["shards"][TRAJECTORIES_DIR]))
    for i, table, open_shard in shards(TRAJECTORIES_DIR, TRAJECTORY_SCHEMA):
        entries = entry_groups[i]
        rows = flat["traj_row"][entries].astype(np.int64)
        bad = invalid_rows(table, rows, _REQUIRED, _SAME_LENGTH)
        reasons["missing or malformed row"] += int(bad.sum())
        safe = np.where(bad, 0, rows)
        if not bad.all():  # a row must be the trajectory the snapshot says it is, with values a model can train on
            for name in _INDEX_COLUMNS:
                values[name][entries] = table.column(name).to_numpy()[safe]
            wrong = ~bad & (values["traj_id"][entries] != flat["traj_id"][entries])
            reasons["row is another trajectory"] += int(wrong.sum())
            unusable, why = bad_trajectory_rows(table, safe, vocab_size, skip=bad | wrong)
            reasons.update(why)
            bad |= wrong | unusable
        ok[entries[~bad]] = True
        adopted.append((open_shard, entries[~bad], rows[~bad]))
        del table  # one shard in memory at a time
    reasons = Counter({reason: count for reason, count in reasons.items() if count})
    key_of = np.cumsum(ok) - 1  # the kept trajectories' keys: 0, 1, ... in the tasks table's order
    for open_shard, entries, rows in adopted:
        _adopt(logs[TRAJECTORIES_DIR], open_shard, key_of[entries], rows)
    kept = np.nonzero(ok)[0]
    index = PoolIndex.from_state(capacity, state["counters"], columns, entry_task[ok], key_of[ok])
    index.ensure_keys(len(kept))
    index.key_task[: len(kept)] = entry_task[kept]
    index.key_entropy[: len(kept)] = values["entropy"][kept]
    index.key_version[: len(kept)] = values["policy_version"][kept]
    index.key_traj_id[: len(kept)] = values["traj_id"][kept]
    index.key_seq[: len(kept)] = values["store_seq"][kept]
    return index, reasons


def _groups(values: np.ndarray, count: int) -> list[np.ndarray]:
    """For each ``i < count``, the indices where ``values == i``, ascending (one sort, not one scan per `i`)."""
    order = np.argsort(values, kind="stable")
    bounds = np.searchsorted(values[order], np.arange(count + 1))
    return [order[bounds[i] : bounds[i + 1]] for i in range(count)]


def _adopt(log: Log, open_shard, keys: np.ndarray, rows: np.ndarray) -> None:
    """Map a checked shard (`open_shard()`) into `log` as the rows `rows` of `keys`, if it holds any the load kept."""
    if len(keys):
        shard = open_shard()
        log.adopt(shard)
        log.add_shard(shard, keys, rows)
