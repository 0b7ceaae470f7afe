"""A saved pool is untrusted input (pools are shared on the Hub): the checks `ExperiencePool.load` runs before it maps
or uses anything, as pure functions.

1. `parse_state`: ``state.json`` (types, ranges, settings a pool can run with, its own checksum).
2. `PoolFolder.verify`: each file the state names is a plain name of the pool folder that resolves inside it (or inside
   the ``blobs/`` of the Hugging Face cache entry it was downloaded to), of the recorded size and xxh3-64 checksum.
3. `check_arrow`: an Arrow file's schema, offsets and strings, before any column is read.
4. `check_tasks_table`: the per-task table, which is the index itself.
5. `bad_trajectory_rows`: rows a model cannot train on, counted by reason and left out, never trained.

Every refusal is a `PoolFormatError` (a `ValueError`) naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from .index import COUNTERS

__all__ = [
    "PoolFolder",
    "PoolFormatError",
    "bad_trajectory_rows",
    "check_arrow",
    "check_settings",
    "check_tasks_table",
    "compressed",
    "file_checksum",
    "parse_state",
    "state_checksum",
]

CHECKSUM = "xxh3_64"
SELECT_MODES = ("argmin", "argmax", "random")
STORE_MODES = ("all", "best")
# The settings a saved pool records (the `ExperiencePool` constructor's keyword arguments), in this order, with what
# each must be: ``(value, settings) -> ok`` and its description for messages.
_SETTING_RULES = {
    # at most int32's: the index counts a task's trajectories in int32 (and allocates by the lists a load finds)
    "replay_max_trajectories_per_task": (lambda v, s: _is_int(v) and 1 <= v < 2**31, "an integer in [1, 2**31 - 1]"),
    "replay_store_lbound": (lambda v, s: _is_int(v) and v >= 0, "an integer >= 0"),
    "replay_store_rbound": (
        lambda v, s: _is_int(v) and _is_int(s["replay_store_lbound"]) and v >= s["replay_store_lbound"] + 2,
        "an integer >= replay_store_lbound + 2 (a task's trajectories are stored when lbound < successes < rbound)",
    ),
    "replay_select_mode": (lambda v, s: v in SELECT_MODES, f"one of {list(SELECT_MODES)}"),
    "replay_store_mode": (lambda v, s: v in STORE_MODES, f"one of {list(STORE_MODES)}"),
    "replay_max_policy_age": (lambda v, s: v is None or (_is_int(v) and v >= 0), "null or an integer >= 0"),
    "seed": (lambda v, s: _is_int(v) and v >= 0, "an integer >= 0"),
}
SETTINGS = tuple(_SETTING_RULES)
# The fields a save writes, all of them: a state without one, or with another, is not one a pool wrote.
STATE_FIELDS = ("format_version", "settings", "tokenizer_fingerprint", "counters", "tasks", "shards", "checksum")
TASKS_FIELDS = ("name", "size", CHECKSUM)
SHARD_FIELDS = ("name", "rows", "live", "size", CHECKSUM)
_NAME = re.compile(r"(tasks|trajectories)-[0-9a-f]{16}\.arrow")  # the names a save writes: no folder, no '..'
_HEX = re.compile(r"[0-9a-f]{16}")
_CHUNK = 8 << 20
# The per-task table of a save: each task's state, its dataset row (JSON; null: none) and its trajectories' ids in
# store order.
TASKS_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("difficulty", pa.int32()),
        ("difficulty_order", pa.int64()),
        ("bucket_pos", pa.int32()),
        ("skip_order", pa.int64()),
        ("store_order", pa.int64()),
        ("task_row", pa.string()),
        ("traj_ids", pa.list_(pa.int64())),
    ]
)


class PoolFormatError(ValueError):
    """A saved experience pool that cannot be used as it is; the message names the file and what is wrong."""

    def __init__(self, file: str, problem: str):
        self.file, self.problem = file, problem
        super().__init__(f"Experience pool file {file}: {problem}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _need(condition: bool, file: str, problem: str) -> None:
    if not condition:
        raise PoolFormatError(file, problem)


def _fields(mapping: dict, allowed: tuple[str, ...], file: str, what: str) -> None:
    """`mapping` (`what`, in messages) must hold exactly the fields `allowed`: an unknown one would be ignored (or
    uploaded by `push_pool`), a missing one fail later as a bare `KeyError`."""
    unknown = sorted(set(mapping) - set(allowed))
    _need(not unknown, file, f"{what} holds unknown fields {unknown}; allowed: {list(allowed)}.")
    missing = [name for name in allowed if name not in mapping]
    _need(not missing, file, f"{what} lacks the fields {missing}; a save writes all of {list(allowed)}.")


def _int(mapping: dict, key: str, file: str, where: str = "", low: int = 0) -> int:
    value = mapping.get(key)
    _need(_is_int(value) and value >= low, file, f"`{where}{key}` must be an integer >= {low}, got {value!r}.")
    return value


def file_checksum(path: str) -> str:
    """xxh3-64 of the file's bytes, as 16 hex digits (~10 GB/s: the disk, not the hash, sets the cost)."""
    digest = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def state_checksum(state: dict) -> str:
    """xxh3-64 of the state's canonical JSON, without its own ``checksum`` field."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_settings(settings, file: str, where: str = "settings.") -> dict:
    """The pool settings saved in a state (or given to `ExperiencePool`), refused unless a pool can run with them;
    `where` prefixes the names in messages.

    ```python
    from trl_exreplay.pool.check import PoolFormatError, check_settings

    settings = {"replay_max_trajectories_per_task": 5, "replay_store_lbound": 0, "replay_store_rbound": 1,
                "replay_select_mode": "argmin", "replay_store_mode": "all", "replay_max_policy_age": None, "seed": 0}
    try:
        check_settings(settings, "state.json")
    except PoolFormatError as e:
        assert "replay_store_rbound" in str(e)
    ```
    """
    _need(isinstance(settings, dict), file, f"`settings` must be an object, got {type(settings).__name__}.")
    _fields(settings, SETTINGS, file, "`settings`")
    for name, (ok, allowed) in _SETTING_RULES.items():
        _need(ok(settings[name], settings), file, f"`{where}{name}` must be {allowed}, got {settings[name]!r}.")
    return settings


def _check_file_entry(entry, file: str, where: str, kind: str, fields: tuple[str, ...]) -> None:
    _need(isinstance(entry, dict), file, f"`{where}` must be an object.")
    _fields(entry, fields, file, f"`{where}`")
    name = entry.get("name")
    _need(
        isinstance(name, str) and _NAME.fullmatch(name) is not None and name.startswith(kind + "-"),
        file,
        f"`{where}.name` {name!r} is not a file name of the pool folder (allowed: {kind}-<16 hex digits>.arrow).",
    )
    _int(entry, "size", file, f"{where}.")
    _need(
        isinstance(entry.get(CHECKSUM), str) and _HEX.fullmatch(entry[CHECKSUM]) is not None,
        file,
        f"`{where}.{CHECKSUM}` must be 16 hex digits, got {entry.get(CHECKSUM)!r}.",
    )


def parse_state(text: bytes | str, file: str, version: int) -> dict:
    """``state.json`` parsed and validated (`version`: the format this code reads); anything else is refused."""
    try:
        state = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nesting too deep to parse
        raise PoolFormatError(file, f"not valid JSON ({e}).") from None
    _need(isinstance(state, dict), file, f"must hold a JSON object, got {type(state).__name__}.")
    found = state.get("format_version")
    _need(
        found == version and _is_int(found),
        file,
        f"format_version {found!r} is not {version}, the one this version of trl_exreplay reads (a newer format needs "
        "a newer trl_exreplay; the older ones are development formats from before the first release).",
    )
    _fields(state, STATE_FIELDS, file, "the state")
    _need(
        state.get("checksum") == state_checksum(state),
        file,
        "checksum missing or wrong: the file was damaged or edited.",
    )
    check_settings(state["settings"], file)
    fingerprint = state["tokenizer_fingerprint"]
    _need(
        fingerprint is None or (isinstance(fingerprint, str) and len(fingerprint) <= 128),
        file,
        f"`tokenizer_fingerprint` must be null or a string of at most 128 characters, got {fingerprint!r}.",
    )
    counters = state["counters"]
    _need(isinstance(counters, dict), file, "`counters` must be an object.")
    _fields(counters, COUNTERS, file, "`counters`")
    for key in COUNTERS:
        _need(_int(counters, key, file, "counters.") < 2**62, file, f"`counters.{key}` must be below 2**62.")
    _check_file_entry(state["tasks"], file, "tasks", "tasks", TASKS_FIELDS)
    shards = state["shards"]
    _need(isinstance(shards, list), file, "`shards` must be a list.")
    names = set()
    for i, entry in enumerate(shards):
        where = f"shards[{i}]"
        _check_file_entry(entry, file, where, "trajectories", SHARD_FIELDS)
        _need(entry["name"] not in names, file, f"`{where}.name` {entry['name']!r} is listed twice.")
        names.add(entry["name"])
        live = _int(entry, "live", file, f"{where}.")
        _need(live <= _int(entry, "rows", file, f"{where}."), file, f"`{where}.live` exceeds `{where}.rows`.")
    return state


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class PoolFolder:
    """The files of the pool saved at `path`: names confined to it, sizes and checksums checked on request.

    A folder ``<repo>/snapshots/<revision>`` of the Hugging Face cache (what `snapshot_download` returns) holds
    symlinks into ``<repo>/blobs/``: exactly that folder is also accepted as a place the files may resolve to, found
    from the folder's real path and only when it is a directory, not a link (a ``blobs`` link to ``/`` would make every
    file "within" the pool).
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        real = os.path.realpath(self.path)
        self.roots = [real]
        blobs = os.path.join(os.path.dirname(os.path.dirname(real)), "blobs")
        try:
            is_folder = stat.S_ISDIR(os.lstat(blobs).st_mode)  # lstat: a link is not followed
        except OSError:
            is_folder = False
        if os.path.basename(os.path.dirname(real)) == "snapshots" and is_folder:
            self.roots.append(blobs)  # every part above it is real (`real`'s), and it is no link: its real path

    def file(self, name: str) -> str:
        """The path of pool file `name` (a plain name: `parse_state` checked it), refused when it resolves outside the
        pool folder (or its cache's blobs)."""
        path = os.path.join(self.path, name)
        real = os.path.realpath(path)
        _need(
            any(_within(real, root) for root in self.roots),
            path,
            f"resolves to {real!r}, outside the pool folder {self.path}: a pool's files must stay in its folder.",
        )
        return path

    def verify(self, entry: dict, checksum: bool = True) -> str:
        """Path of the file of a state's `entry` after checking that it is a regular file of the recorded size (and,
        with `checksum`, bytes). A hard link cannot be told from its target, so files are checked by content."""
        path = self.file(entry["name"])
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise PoolFormatError(path, f"cannot be read ({e.strerror}).") from None
        _need(os.path.isfile(path), path, "is not a regular file.")
        _need(size == entry["size"], path, f"has {size} bytes; the pool recorded {entry['size']}.")
        if checksum:
            found = file_checksum(path)
            _need(found == entry[CHECKSUM], path, f"checksum mismatch ({found} != {entry[CHECKSUM]}): damaged.")
        return path


def check_arrow(table: pa.Table, schema: pa.Schema, file: str, full: bool = True) -> None:
    """The table of an Arrow file must have exactly `schema`'s columns and types, and (`full`) valid offsets and
    strings (checked before any column is read: a bad offset would otherwise be followed out of the file)."""
    expected = [(f.name, str(f.type)) for f in schema]
    try:
        found = [(f.name, str(f.type)) for f in table.schema]  # (a nested name that is not UTF-8 reads as U+FFFD)
    except UnicodeDecodeError:
        raise PoolFormatError(file, f"a column name is not UTF-8; the columns must be {expected}.") from None
    _need(found == expected, file, f"columns {found} are not the expected {expected}.")
    if full:
        try:
            table.validate(full=True)
        except (pa.ArrowInvalid, pa.ArrowException) as e:
            raise PoolFormatError(file, f"invalid Arrow data ({e}).") from None


def compressed(metadata: pa.Buffer) -> bool:
    """Whether the metadata of an Arrow IPC message (a flatbuffer ``Message``, which Arrow verified when it read it)
    declares compressed body buffers: its ``RecordBatch`` header has field 3, ``compression``. pyarrow does not say,
    and it decompresses in ``read_record_batch``, before any size could be checked (8.7 KB of zstd holds 256 MiB of
    zeros)."""
    data = metadata.to_pybytes()

    def at(pos: int, size: int, signed: bool = False) -> int:
        return int.from_bytes(data[pos : pos + size], "little", signed=signed)

    def field(table: int, i: int) -> int:
        """Where field `i` of the flatbuffer table at `table` is, relative to it (0: absent)."""
        vtable = table - at(table, 4, signed=True)
        return at(vtable + 4 + 2 * i, 2) if 4 + 2 * i < at(vtable, 2) else 0

    message = at(0, 4)
    header = field(message, 2)  # Message: version, header_type, header, bodyLength, custom_metadata
    if not header:
        return False
    batch = message + header + at(message + header, 4)  # RecordBatch: length, nodes, buffers, compression, ...
    return field(batch, 3) != 0


def check_no_nulls(table: pa.Table, file: str, nullable: tuple[str, ...] = ()) -> None:
    """No null in `table`, in a column or inside a list, but in the `nullable` columns (a pool never writes one)."""
    for name, column in zip(table.column_names, table.columns):
        values = [c.values for c in column.chunks] if pa.types.is_list(column.type) else []
        nulls = column.null_count * (name not in nullable) + sum(v.null_count for v in values)
        _need(nulls == 0, file, f"column `{name}` holds a null value.")


def check_tasks_table(tasks: pa.Table, state: dict, file: str) -> None:
    """A save's tasks table must be one a pool could have written: its schema, no null (but the row of a task that has
    none), task ids and trajectory ids unique, orders within the state's counters, no task above the capacity. Damage
    here is an error, not a rejected row: the table is the pool's index itself."""
    check_arrow(tasks, TASKS_SCHEMA, file)
    check_no_nulls(tasks, file, nullable=("task_row",))
    _need(len(set(tasks.column("task_id").to_pylist())) == tasks.num_rows, file, "lists a task id twice.")
    counters = state["counters"]
    for name in ("difficulty", "difficulty_order", "skip_order", "store_order"):
        values = tasks.column(name).to_numpy()
        high = np.iinfo(np.int32).max if name == "difficulty" else counters["stamp"]
        _need(((values >= -1) & (values <= high)).all(), file, f"`{name}` holds a value outside [-1, {high}].")
    ids = tasks.column("traj_ids").combine_chunks()
    capacity = state["settings"]["replay_max_trajectories_per_task"]
    _need(
        (np.diff(ids.offsets.to_numpy()) <= capacity).all(), file, f"a task holds more than {capacity} trajectories."
    )
    ids = np.sort(ids.values.to_numpy())  # (np.unique is 10x slower here: 0.6 s for 1M ids)
    _need(not (ids[1:] == ids[:-1]).any(), file, "lists a trajectory id twice.")
    _need(((ids >= 0) & (ids < counters["next_traj_id"])).all(), file, "`traj_ids` outside [0, next_traj_id).")


def bad_trajectory_rows(table: pa.Table, rows: np.ndarray, vocab_size: int | None) -> tuple[np.ndarray, Counter]:
    """Which of `rows` (row numbers of a checked trajectory table without nulls) a model cannot be trained on, and the
    count of each reason (each row counted once).

    Refused: ``completion_ids``, ``completion_mask`` and ``logps`` of unequal lengths; a non-finite ``logps``,
    ``rewards``, ``reward`` or ``entropy``; a ``completion_mask`` value other than 0 or 1; a negative token id, or one
    >= `vocab_size` (when known). Vectorised: a shard of 1k trajectories of 1k tokens takes a few ms.
    """
    rows = np.asarray(rows, np.int64)
    bad = np.zeros(len(rows), bool)
    reasons: Counter = Counter()

    def flag(mask: np.ndarray, reason: str) -> None:
        new = mask & ~bad
        if new.any():
            reasons[reason] += int(new.sum())
            bad[:] |= new

    def in_rows(name: str, test) -> np.ndarray:
        """Whether each of `rows` has a value of list column `name` for which `test` is True."""
        column = table.column(name).combine_chunks()
        hit = test(column.values.to_numpy(zero_copy_only=False))
        if not hit.any():  # the usual case: no prefix sum over every value
            return np.zeros(len(rows), bool)
        hits = np.concatenate([[0], np.cumsum(hit, dtype=np.int64)])
        offsets = column.offsets.to_numpy()
        return hits[offsets[rows + 1]] > hits[offsets[rows]]

    lengths = [
        pc.list_value_length(table.column(n)).to_numpy()[rows] for n in ("completion_ids", "completion_mask", "logps")
    ]
    flag((lengths[1] != lengths[0]) | (lengths[2] != lengths[0]), "lists of unequal length")
    for name in ("reward", "entropy"):
        flag(~np.isfinite(table.column(name).to_numpy()[rows]), f"non-finite {name}")
    for name in ("logps", "rewards"):
        flag(in_rows(name, lambda v: ~np.isfinite(v)), f"non-finite {name}")
    flag(in_rows("completion_mask", lambda v: (v != 0) & (v != 1)), "completion_mask not 0/1")
    high = np.iinfo(np.int64).max if vocab_size is None else vocab_size
    for name in ("prompt_ids", "completion_ids"):
        flag(in_rows(name, lambda v: (v < 0) | (v >= high)), "token id outside the vocabulary")
    return bad, reasons
