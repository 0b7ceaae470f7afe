"""What a saved experience pool must be before any of it is trusted: pure checks of its metadata, names and rows.

A pool folder is untrusted input (pools are downloaded from the Hub and shared), so `ExperiencePool.load` runs
these, in this order, before it maps or uses anything:

1. `parse_state`: ``state.json`` parsed into a validated structure (types, ranges, settings a pool can run with),
   its own checksum included, so that a damaged or hand-edited state is one clear error.
2. `PoolFolder.file`: every name the state gives is a plain relative name in one of the pool's folders, and the
   file it resolves to (through symlinks) stays inside the pool folder, or inside the ``blobs/`` folder of the
   Hugging Face cache entry the pool was downloaded to: nothing wider.
3. `PoolFolder.verify`: each file's size (before it is mapped: a truncated file is never mapped past its end) and
   its xxh3-64 checksum, recorded at save. A hard link cannot be told from its target, so links are checked by
   content: a file whose bytes are not those the pool recorded is refused, wherever it lives.
4. `check_arrow`: the Arrow file's schema, and its offsets and strings (``validate(full=True)``), before any column is
   read.
5. `bad_trajectory_rows`: row values a model could not train on (non-finite log-probs or rewards, a mask other than
   0/1, token ids outside the vocabulary): such rows are rejected and counted by reason, never trained.

Every refusal is a `PoolFormatError` (a `ValueError`) that names the file and what is wrong.

Example:

```python
from trl_exreplay.pool.check import PoolFormatError, check_settings

check_settings({"max_trajectories_per_task": 5, "experience_lbound": 0, "experience_rbound": 8,
                "exp_select_mode": "argmin", "pool_store_mode": "all", "max_policy_age": None,
                "replay_window": None, "seed": 0}, "state.json")
try:
    check_settings({"max_trajectories_per_task": 5, "experience_lbound": 0, "experience_rbound": -1,
                    "exp_select_mode": "argmin", "pool_store_mode": "all", "max_policy_age": None,
                    "replay_window": None, "seed": 0}, "state.json")
except PoolFormatError as e:
    assert "experience_rbound" in str(e)
```
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from .index import COUNTERS

__all__ = [
    "PoolFormatError",
    "PoolFolder",
    "bad_trajectory_rows",
    "check_arrow",
    "check_settings",
    "check_tasks_table",
    "file_checksum",
    "invalid_rows",
    "parse_state",
    "state_checksum",
    "trajectory_problem",
]

CHECKSUM = "xxh3_64"
SELECT_MODES = ("argmin", "argmax", "random")
STORE_MODES = ("all", "best")
# The settings a saved pool records (the `ExperiencePool` constructor's keyword arguments), in this order, with what
# each must be: ``(value, settings) -> ok`` and its description for messages.
_SETTING_RULES = {
    "max_trajectories_per_task": (lambda v, s: _is_int(v) and v >= 1, "an integer >= 1"),
    "experience_lbound": (lambda v, s: _is_int(v) and v >= 0, "an integer >= 0"),
    "experience_rbound": (
        lambda v, s: _is_int(v) and _is_int(s["experience_lbound"]) and v >= s["experience_lbound"] + 2,
        "an integer >= experience_lbound + 2 (a task's trajectories are stored when lbound < successes < rbound)",
    ),
    "exp_select_mode": (lambda v, s: v in SELECT_MODES, f"one of {list(SELECT_MODES)}"),
    "pool_store_mode": (lambda v, s: v in STORE_MODES, f"one of {list(STORE_MODES)}"),
    "max_policy_age": (lambda v, s: v is None or (_is_int(v) and v >= 0), "null or an integer >= 0"),
    "replay_window": (lambda v, s: v is None or (_is_int(v) and v >= 1), "null or an integer >= 1"),
    "seed": (lambda v, s: _is_int(v), "an integer"),
}
SETTINGS = tuple(_SETTING_RULES)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_HEX = re.compile(r"[0-9a-f]{16}")
_CHUNK = 8 << 20


class PoolFormatError(ValueError):
    """A saved experience pool that cannot be used as it is; the message names the file and what is wrong."""

    def __init__(self, file: str, problem: str):
        self.file, self.problem = file, problem
        super().__init__(f"Experience pool file {file}: {problem}")


# ------------------------------------------------------------------------------------------------------ checksums
def file_checksum(path: str) -> str:
    """xxh3-64 of the file's bytes, as 16 hex digits (~10 GB/s: the disk, not the hash, sets the cost)."""
    digest = xxhash.xxh3_64()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


def state_checksum(state: dict) -> str:
    """xxh3-64 of the state's canonical JSON, without its own ``checksum`` field."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------- the state
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _need(condition: bool, file: str, problem: str) -> None:
    if not condition:
        raise PoolFormatError(file, problem)


def _int(mapping: dict, key: str, file: str, low: int = 0, where: str = "") -> int:
    value = mapping.get(key)
    _need(_is_int(value) and value >= low, file, f"`{where}{key}` must be an integer >= {low}, got {value!r}.")
    return value


def check_settings(settings, file: str, where: str = "settings.") -> dict:
    """The pool settings saved in a state (or given to `ExperiencePool`), refused unless a pool can run with them;
    `where` prefixes the names in messages (``settings.`` in a state file)."""
    _need(isinstance(settings, dict), file, f"`settings` must be an object, got {type(settings).__name__}.")
    unknown = sorted(set(settings) - set(SETTINGS))
    _need(not unknown, file, f"unknown settings {unknown}; allowed: {list(SETTINGS)}.")
    missing = [name for name in SETTINGS if name not in settings]
    _need(not missing, file, f"settings {missing} are missing.")
    for name, (ok, allowed) in _SETTING_RULES.items():
        _need(ok(settings[name], settings), file, f"`{where}{name}` must be {allowed}, got {settings[name]!r}.")
    return settings


def _check_name(name, file: str, folder: str, what: str) -> str:
    """`name` must be ``<folder>/<plain name>`` (no other folder, no ``..``, nothing absolute, no hidden file)."""
    _need(isinstance(name, str), file, f"{what} must be a string, got {name!r}.")
    parts = name.split("/")
    _need(
        len(parts) == 2
        and parts[0] == folder
        and _NAME.fullmatch(parts[1]) is not None
        and parts[1].endswith(".arrow"),
        file,
        f"{what} {name!r} is not a file name inside `{folder}/` (allowed: {folder}/<letters, digits, '.', '_', "
        "'-'>.arrow; no '..', no absolute path, no other folder).",
    )
    return name


def parse_state(text: bytes | str, file: str, version: int, folders: Sequence[str], tasks_folder: str) -> dict:
    """``state.json`` parsed and validated; refuses anything else with `PoolFormatError`.

    `version` is the format this code writes; `folders` are the shard folders, `tasks_folder` the tasks tables' folder.
    """
    try:
        state = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting too deep to parse
        raise PoolFormatError(file, f"not valid JSON ({e}).") from None
    _need(isinstance(state, dict), file, f"must hold a JSON object, got {type(state).__name__}.")
    found = state.get("format_version")
    _need(_is_int(found), file, f"`format_version` must be an integer, got {found!r}.")
    _need(
        found == version,
        file,
        f"format_version {found} is not the one this version of trl_exreplay reads ({version}); "
        + (
            "upgrade trl_exreplay." if found > version else "it is a development format from before the first release."
        ),
    )
    recorded = state.get("checksum")
    _need(isinstance(recorded, str), file, "`checksum` is missing (every save records one).")
    _need(recorded == state_checksum(state), file, "checksum mismatch: the file was damaged or edited.")
    _int(state, "snapshot", file, 1)
    check_settings(state.get("settings"), file)
    fingerprint = state.get("tokenizer_fingerprint")
    _need(
        fingerprint is None or (isinstance(fingerprint, str) and len(fingerprint) <= 128),
        file,
        f"`tokenizer_fingerprint` must be null or a string, got {fingerprint!r}.",
    )
    counters = state.get("counters")
    _need(isinstance(counters, dict), file, "`counters` must be an object.")
    for key in COUNTERS:
        _int(counters, key, file, 0, "counters.")
    _int(state, "num_trajectories", file, 0)
    _int(state, "num_tasks", file, 0)
    _check_name(state.get("tasks_file"), file, tasks_folder, "`tasks_file`")
    shards = state.get("shards")
    _need(isinstance(shards, dict) and sorted(shards) == sorted(folders), file, f"`shards` must have keys {folders}.")
    for folder in folders:
        entries = shards[folder]
        _need(isinstance(entries, list), file, f"`shards.{folder}` must be a list.")
        names = set()
        for i, entry in enumerate(entries):
            where = f"shards.{folder}[{i}]."
            _need(isinstance(entry, dict), file, f"`{where[:-1]}` must be an object.")
            name = _check_name(f"{folder}/{entry.get('name')}", file, folder, f"`{where}name`")
            _need(name not in names, file, f"`{where}name` {name!r} is listed twice.")
            names.add(name)
            rows = _int(entry, "rows", file, 0, where)
            live = _int(entry, "live", file, 0, where)
            _need(live <= rows, file, f"`{where}live` ({live}) exceeds `{where}rows` ({rows}).")
    live = sum(entry["live"] for entry in shards[folders[0]])
    _need(
        live == state["num_trajectories"],
        file,
        f"`num_trajectories` ({state['num_trajectories']}) is not the live rows of its shards ({live}).",
    )
    files = state.get("files")
    expected = [state["tasks_file"]] + [f"{k}/{e['name']}" for k in folders for e in shards[k]]
    _need(
        isinstance(files, dict) and sorted(files) == sorted(expected),
        file,
        "`files` must give the size and checksum of exactly the files the state names.",
    )
    for name, entry in files.items():
        _need(isinstance(entry, dict), file, f"`files[{name!r}]` must be an object.")
        _int(entry, "size", file, 0, f"files[{name!r}].")
        _need(
            isinstance(entry.get(CHECKSUM), str) and _HEX.fullmatch(entry[CHECKSUM]) is not None,
            file,
            f"`files[{name!r}].{CHECKSUM}` must be 16 hex digits, got {entry.get(CHECKSUM)!r}.",
        )
    return state


# ------------------------------------------------------------------------------------------------------ the folder
def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class PoolFolder:
    """The files of the pool saved at `path`: names confined to it, sizes and checksums checked on request.

    A folder ``<repo>/snapshots/<revision>`` of the Hugging Face cache (what `snapshot_download` returns) holds
    symlinks into ``<repo>/blobs/``: exactly that folder is also accepted as a place the files may resolve to.
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.roots = [os.path.realpath(self.path)]
        parent = os.path.dirname(self.path)
        if os.path.basename(parent) == "snapshots":
            blobs = os.path.join(os.path.dirname(parent), "blobs")
            if os.path.isdir(blobs):
                self.roots.append(os.path.realpath(blobs))

    def file(self, name: str) -> str:
        """The path of pool file `name` (already checked by `parse_state` to be ``<folder>/<plain name>``), refused
        when it resolves outside the pool folder (or its cache's blobs)."""
        path = os.path.join(self.path, *name.split("/"))
        real = os.path.realpath(path)
        _need(
            any(_within(real, root) for root in self.roots),
            path,
            f"resolves to {real}, outside the pool folder {self.path}: a pool's files must stay in its folder.",
        )
        return path

    def verify(self, state: dict, name: str, checksum: bool = True) -> str:
        """Path of `name` after checking it is a regular file of the recorded size (and, with `checksum`, bytes)."""
        path = self.file(name)
        try:
            info = os.stat(path)
        except OSError as e:
            raise PoolFormatError(path, f"cannot be read ({e.strerror}).") from None
        _need(os.path.isfile(path), path, "is not a regular file.")
        entry = state["files"][name]
        _need(info.st_size == entry["size"], path, f"has {info.st_size} bytes; the pool recorded {entry['size']}.")
        if checksum:
            found = file_checksum(path)
            _need(found == entry[CHECKSUM], path, f"checksum mismatch ({found} != {entry[CHECKSUM]}): damaged.")
        return path


# ----------------------------------------------------------------------------------------------------- Arrow files
def check_arrow(table: pa.Table, schema: pa.Schema, file: str, full: bool = True) -> None:
    """The table of an Arrow file must have exactly `schema`'s columns and types, and (`full`) valid offsets and strings
    (checked before any column is read: a bad offset would otherwise be followed out of the file)."""
    found = [(f.name, str(f.type)) for f in table.schema]
    expected = [(f.name, str(f.type)) for f in schema]
    _need(found == expected, file, f"columns {found} are not the expected {expected}.")
    if not full:
        return
    try:
        table.validate(full=True)
    except (pa.ArrowInvalid, pa.ArrowException) as e:
        raise PoolFormatError(file, f"invalid Arrow data ({e}).") from None


def _rows_with(values: np.ndarray, bad: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Which of `rows` have a True of `bad` (one per list value) among their values (`offsets`: the list offsets)."""
    if not bad.any():
        return np.zeros(len(rows), bool)
    cumulative = np.concatenate([[0], np.cumsum(bad, dtype=np.int64)])
    return cumulative[offsets[rows + 1]] > cumulative[offsets[rows]]


def invalid_rows(table: pa.Table, rows: np.ndarray, required: Sequence[str], same_length: Sequence[str]) -> np.ndarray:
    """Which of `rows` are bad: beyond the table, a null in a `required` column (or inside a list of one), or lists
    of unequal length among `same_length`. Reads only offsets and validity bitmaps (no row data)."""
    if table.num_rows == 0:
        return np.ones(len(rows), bool)
    bad = (rows < 0) | (rows >= table.num_rows)
    rows = np.where(bad, 0, rows)
    for name in required:
        column = table.column(name)
        if column.null_count:
            bad |= column.is_null().to_numpy(zero_copy_only=False)[rows]
        if pa.types.is_list(column.type) and any(chunk.values.null_count for chunk in column.chunks):
            # A null inside a list (a hand-edited file): rare, so checked row by row.
            inside = np.array([value is not None and None in value for value in column.to_pylist()], bool)
            bad |= inside[rows]
    lengths = [
        pc.list_value_length(table.column(name)).fill_null(-1).to_numpy(zero_copy_only=False)[rows]
        for name in same_length
    ]
    for other in lengths[1:]:
        bad |= other != lengths[0]
    return bad


def bad_trajectory_rows(
    table: pa.Table, rows: np.ndarray, vocab_size: int | None, skip: np.ndarray | None = None
) -> tuple[np.ndarray, Counter]:
    """Which of `rows` (valid row numbers of a checked trajectory table, `skip`: those already refused) a model cannot
    be trained on, and the count of each reason.

    Refused: a non-finite ``logps``, ``rewards``, ``reward`` or ``entropy``; a ``completion_mask`` value other than
    0 or 1; a negative token id, or one >= `vocab_size` (when known), in ``prompt_ids`` or ``completion_ids``.
    Reads the columns once, vectorised (a shard of 1k trajectories of 1k tokens: a few ms).
    """
    skip = np.zeros(len(rows), bool) if skip is None else skip
    bad = skip.copy()
    reasons: Counter = Counter()

    def flag(mask: np.ndarray, reason: str) -> None:
        new = mask & ~bad
        if new.any():
            reasons[reason] += int(new.sum())
        bad[:] |= mask

    def listed(name: str):
        column = table.column(name).combine_chunks()
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = column.values.to_numpy(zero_copy_only=False)
        return values, offsets

    for name in ("logps", "rewards"):
        values, offsets = listed(name)
        flag(_rows_with(values, ~np.isfinite(values), offsets, rows), f"non-finite {name}")
    for name in ("reward", "entropy"):
        values = table.column(name).to_numpy()[rows]
        flag(~np.isfinite(values), f"non-finite {name}")
    values, offsets = listed("completion_mask")
    flag(_rows_with(values, (values != 0) & (values != 1), offsets, rows), "completion_mask not 0/1")
    for name in ("prompt_ids", "completion_ids"):
        values, offsets = listed(name)
        out = values < 0 if vocab_size is None else (values < 0) | (values >= vocab_size)
        flag(_rows_with(values, out, offsets, rows), "token id outside the vocabulary")
    return bad & ~skip, reasons


def trajectory_problem(trajectory, vocab_size: int | None) -> str | None:
    """Why a model cannot be trained on `trajectory` (a `pool.Trajectory`), as `bad_trajectory_rows` judges a
    stored row; None when it can. Plain Python over the lists (~30 us for 1k tokens: it runs on every stored one)."""
    for name in ("reward", "entropy"):
        if not math.isfinite(getattr(trajectory, name)):
            return f"non-finite {name}"
    for name in ("logps", "rewards"):
        values = getattr(trajectory, name)
        # A sum is finite when every value is (log-probs are <= 0 and rewards small: no overflow to inf).
        if not math.isfinite(sum(values)) and not all(map(math.isfinite, values)):
            return f"non-finite {name}"
    mask = trajectory.completion_mask
    if mask.count(1) + mask.count(0) != len(mask):
        return "completion_mask not 0/1"
    for name in ("prompt_ids", "completion_ids"):
        ids = getattr(trajectory, name)
        if ids and (min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)):
            return "token id outside the vocabulary"
    return None


# --------------------------------------------------------------------------------------------------- tasks tables
# The per-task table of a snapshot (`ExperiencePool._tasks_table`): task state and where its rows are.
TASKS_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("difficulty", pa.int32()),
        ("difficulty_order", pa.int64()),
        ("bucket_pos", pa.int32()),
        ("skip_order", pa.int64()),
        ("store_order", pa.int64()),
        ("task_row", pa.string()),  # the task's dataset row as JSON (null: none), to roll a replayed task out again
        ("traj_shard", pa.list_(pa.int32())),
        ("traj_row", pa.list_(pa.int32())),
        ("traj_id", pa.list_(pa.int64())),
    ]
)


def _min(values: np.ndarray, empty: int) -> int:
    return int(values.min()) if len(values) else empty


def _max(values: np.ndarray, empty: int) -> int:
    return int(values.max()) if len(values) else empty


def check_tasks_table(tasks: pa.Table, state: dict, file: str, trajectories: str) -> None:
    """A snapshot's tasks table must be one a pool could have written: its schema, no null (but the row of a task that
    has none), one row per task, task and trajectory ids unique, orders within the state's counters, slot lists that
    agree, no task above the capacity, and shard numbers that exist (`trajectories`: the state's shard folder). Damage
    here is an error, not a rejected row: the table is the pool's index itself."""
    check_arrow(tasks, TASKS_SCHEMA, file)

    def need(condition: bool, problem: str) -> None:
        _need(condition, file, problem)

    need(tasks.num_rows == state["num_tasks"], f"has {tasks.num_rows} tasks; the state records {state['num_tasks']}.")
    for name, column in zip(tasks.column_names, tasks.columns):
        need(column.null_count == 0 or name == "task_row", "holds a null value.")
        if pa.types.is_list(column.type):
            need(all(chunk.values.null_count == 0 for chunk in column.chunks), "holds a null value in a list.")
    need(len(set(tasks.column("task_id").to_pylist())) == tasks.num_rows, "lists a task id twice.")
    stamp = state["counters"]["stamp"]
    for name in ("difficulty", "difficulty_order", "skip_order", "store_order"):
        values = tasks.column(name).to_numpy()
        need(_min(values, -1) >= -1, f"`{name}` holds a value below -1.")
        if name != "difficulty":
            need(_max(values, -1) <= stamp, f"`{name}` holds a value above counters.stamp ({stamp}).")
    lists = [tasks.column(name).combine_chunks() for name in ("traj_shard", "traj_row", "traj_id")]
    offsets = [c.offsets.to_numpy() for c in lists]
    need(
        all(np.array_equal(offsets[0], o) for o in offsets[1:]),
        "`traj_shard`, `traj_row`, `traj_id` differ in length.",
    )
    counts = np.diff(offsets[0])
    capacity = state["settings"]["max_trajectories_per_task"]
    need(
        _max(counts, 0) <= capacity,
        f"a task holds {_max(counts, 0)} trajectories, above max_trajectories_per_task={capacity}.",
    )
    shard, row, traj_id = (c.values.to_numpy() for c in lists)
    need(_min(shard, 0) >= 0 and _max(shard, -1) < len(state["shards"][trajectories]), "`traj_shard` out of range.")
    need(_min(row, 0) >= 0, "`traj_row` holds a value below 0.")
    need(len(traj_id) == len(np.unique(traj_id)), "lists a trajectory id twice.")
    next_id = state["counters"]["next_traj_id"]
    need(_min(traj_id, 0) >= 0 and _max(traj_id, -1) < next_id, "`traj_id` outside [0, counters.next_traj_id).")
