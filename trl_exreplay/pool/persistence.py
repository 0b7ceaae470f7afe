"""A pool's saved folder: its layout, its atomic commit, and the save and load of its storage (incremental, checked).

A save writes only what the folder lacks (shards new since the last save, hard-linked from the live pool when on the
same file system) and the snapshot's per-task table, then commits by replacing ``state.json``; the files no committed
state names are pruned after. A process killed at any instant leaves the previous ``state.json`` and all its files::

    state.json                     the committed snapshot: settings, counters, shard lists, its tasks table, every
                                   file's size and xxh3-64 checksum, and its own checksum
    tasks/<snapshot>-<id>.arrow    per-task state of a snapshot (difficulty, skip set, where its trajectories are)
                                   and its dataset row (JSON), so that a replayed task can be rolled out again
    trajectories/*.arrow           trajectory shards, one row per trajectory (`datasets` features)

A load treats the folder as untrusted input (`check.py`): the state, every file's name, size, checksum and Arrow layout
are checked before anything is mapped; rows a model cannot train on are counted and left out. RAM receives the index
(`index.PoolIndex.from_state`) and the task rows; the shards stay memory-mapped files.
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
    TRAJECTORY_SCHEMA,
    Log,
    Shard,
    fsync_path,
    read_arrow,
    write_arrow,
    write_atomic,
    write_json_atomic,
)

FORMAT_VERSION = 4  # 3: every file's size and xxh3-64 checksum in state.json; 4: task rows in the tasks table
STATE_FILE = "state.json"
TRAJECTORIES_DIR = "trajectories"
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
    return parse_state(text, file, FORMAT_VERSION, (TRAJECTORIES_DIR,), TASKS_DIR)


def state_files(state: dict) -> list[str]:
    """The files (relative to the pool folder) a committed state names, state.json first."""
    return [STATE_FILE, state["tasks_file"]] + [
        f"{TRAJECTORIES_DIR}/{e['name']}" for e in state["shards"][TRAJECTORIES_DIR]
    ]


def prune(path: str) -> None:
    """After a commit: delete the files of the pool's folders that the committed state does not name, and the
    temporary files of interrupted saves. A crash here leaves garbage, never a broken pool."""
    keep = set(state_files(read_state(path)))
    for folder in (TRAJECTORIES_DIR, TASKS_DIR):
        if os.path.isdir(os.path.join(path, folder)):
            for name in os.listdir(os.path.join(path, folder)):
                if f"{folder}/{name}" not in keep:
                    target = os.path.join(path, folder, name)
                    shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    for name in os.listdir(path):
        if name.startswith(f".{STATE_FILE}.tmp-"):
            os.remove(os.path.join(path, name))


# ------------------------------------------------------------------------------------------------------------ save
def save_folder(path: str, log: Log, task_rows: dict[int, str], index: PoolIndex, header: dict) -> None:
    """Commit a snapshot of the pool whose trajectory `log`, `task_rows` (task index -> JSON) and `index` are given into
    folder `path`; `header` holds its ``settings`` and ``tokenizer_fingerprint``. See `ExperiencePool.save`."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    previous = _committed_state(path)
    snapshot = previous["snapshot"] + 1 if previous else 1
    try:
        entries = log.save_into(os.path.join(path, TRAJECTORIES_DIR))
        tasks_file = f"{TASKS_DIR}/{snapshot:08d}-{uuid.uuid4().hex[:12]}.arrow"
        os.makedirs(os.path.join(path, TASKS_DIR), exist_ok=True)
        counters, table = _tasks_table(index, log, entries, task_rows)
        write_atomic(os.path.join(path, tasks_file), lambda tmp: write_arrow(tmp, table))
        files = {tasks_file: _file_entry(os.path.join(path, tasks_file))}
        for e in entries:
            fsync_path(
                os.path.join(path, TRAJECTORIES_DIR, e["name"])
            )  # a scratch file's bytes may not be on disk yet
            files[f"{TRAJECTORIES_DIR}/{e['name']}"] = {"size": e["size"], CHECKSUM: e["checksum"]}
        for folder in (TRAJECTORIES_DIR, TASKS_DIR):
            fsync_path(os.path.join(path, folder))
        state = {
            "format_version": FORMAT_VERSION,
            "snapshot": snapshot,
            **header,
            "counters": counters,
            "num_trajectories": index.num_live,
            "num_tasks": table.num_rows,
            "tasks_file": tasks_file,
            "shards": {TRAJECTORIES_DIR: [{k: e[k] for k in ("name", "rows", "live")} for e in entries]},
            "files": files,
        }
        state["checksum"] = state_checksum(state)
        parse_state(json.dumps(state), STATE_FILE, FORMAT_VERSION, (TRAJECTORIES_DIR,), TASKS_DIR)
        write_json_atomic(os.path.join(path, STATE_FILE), state)  # the commit: of a state its load accepts
        fsync_path(path)
    except BaseException:
        try:  # remove what this save added; the committed snapshot is untouched
            if previous is not None:
                prune(path)
            elif not os.path.exists(os.path.join(path, STATE_FILE)):
                for folder in (TRAJECTORIES_DIR, TASKS_DIR):
                    shutil.rmtree(os.path.join(path, folder), ignore_errors=True)
        except Exception:  # noqa: BLE001 - the save's own error is the one to report
            logger.exception("trl_exreplay: cleaning up after a failed pool save")
        raise
    prune(path)


def _tasks_table(index: PoolIndex, log: Log, entries: list[dict], task_rows: dict[int, str]):
    """The counters and the per-task table of a snapshot: `index.to_state()`, with each trajectory's row located (the
    shard's place in the state's list, its row) instead of its key, and each task's row."""
    counters, columns, offsets, keys = index.to_state()
    at = log.where[keys]
    numbers = [entry["shard"] for entry in entries]
    place = np.full(max(numbers, default=0) + 1, -1, np.int32)
    place[numbers] = np.arange(len(numbers), dtype=np.int32)

    def lists(values):
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    columns.update(
        task_row=pa.array([task_rows.get(t) for t in range(len(columns.pop("has_row")))], pa.string()),
        traj_shard=lists(place[at >> 32]),
        traj_row=lists((at & 0xFFFFFFFF).astype(np.int32)),
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
    check_tasks_table(tasks, state, tasks_path, TRAJECTORIES_DIR)
    return state, folder, tasks


def load_index(
    folder: PoolFolder, state: dict, tasks, log: Log, capacity: int, vocab_size, verify
) -> tuple[PoolIndex, dict[int, str], Counter]:
    """Adopt the checked shards of a committed snapshot into the empty trajectory `log` and rebuild the index from its
    tasks table; returns the index, the task rows (task index -> JSON) and the rows left out, by reason. A
    trajectory's key is its place among the kept ones in the tasks table's lists."""

    def shards():
        """(place in the state, its table read into memory, `open_shard()` -> its shard) of each shard, checked."""
        schema = TRAJECTORY_SCHEMA
        for i, entry in enumerate(state["shards"][TRAJECTORIES_DIR]):
            name = f"{TRAJECTORIES_DIR}/{entry['name']}"
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
    task_rows = {t: row for t, row in enumerate(tasks.column("task_row").to_pylist()) if row is not None}
    for t in [t for t, row in task_rows.items() if not _is_json(row)]:  # `task_row()` parses it, mid-training
        del task_rows[t]
        reasons["task row not JSON"] += 1
    columns["has_row"] = np.zeros(n, bool)
    columns["has_row"][list(task_rows)] = True

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
    for i, table, open_shard in shards():
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
        if len(entries):  # a shard that holds no kept row is not mapped, nor saved again
            shard = open_shard()
            log.adopt(shard)
            log.add_shard(shard, key_of[entries], rows)
    kept = np.nonzero(ok)[0]
    index = PoolIndex.from_state(capacity, state["counters"], columns, entry_task[ok], key_of[ok])
    index.ensure_keys(len(kept))
    index.key_task[: len(kept)] = entry_task[kept]
    index.key_entropy[: len(kept)] = values["entropy"][kept]
    index.key_version[: len(kept)] = values["policy_version"][kept]
    index.key_traj_id[: len(kept)] = values["traj_id"][kept]
    index.key_seq[: len(kept)] = values["store_seq"][kept]
    return index, task_rows, reasons


def _groups(values: np.ndarray, count: int) -> list[np.ndarray]:
    """For each ``i < count``, the indices where ``values == i``, ascending (one sort, not one scan per `i`)."""
    order = np.argsort(values, kind="stable")
    bounds = np.searchsorted(values[order], np.arange(count + 1))
    return [order[bounds[i] : bounds[i + 1]] for i in range(count)]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
