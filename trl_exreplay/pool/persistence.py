"""Saving an `ExperiencePool` to a folder and loading it back: incremental, atomic, checked.

A save writes only what the folder lacks (shards new since the last save, hard-linked from the live pool when on the
same file system) and the per-task table of the snapshot, then commits by replacing ``state.json`` (layout and
atomicity: `store.py`). A load treats the folder as untrusted input (`check.py`): the state, every file's name,
size, checksum and Arrow layout are checked before anything is mapped; rows a model cannot train on are counted and
left out. RAM receives the index only: the shards stay memory-mapped files.

These are `ExperiencePool.save` and `ExperiencePool.load` (the class takes them as its methods); they read and write
the pool's index, so they live beside it in this package.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import TYPE_CHECKING

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
from .records import tokenizer_fingerprint
from .store import (
    FORMAT_VERSION,
    STATE_FILE,
    TASK_ROW_SCHEMA,
    TASK_ROWS_DIR,
    TASKS_DIR,
    TRAJECTORIES_DIR,
    TRAJECTORY_SCHEMA,
    Shard,
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

if TYPE_CHECKING:  # for annotations only: the pool class is passed in, so this module does not import it
    from .experience_pool import ExperiencePool

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


def save_pool(pool, path: str) -> None:
    """Save the pool to folder `path`: incrementally and atomically.

    Only what the folder lacks is written: shards new since the last save to it (hard links to the live pool's
    files when on the same file system, so no trajectory is ever written twice) and the small per-task state.
    The commit is the atomic replacement of ``state.json``; a process killed at any instant of a save leaves
    the previous snapshot complete and loadable. The files only the previous snapshot used are deleted after the
    commit (a checkpoint keeps one snapshot; TRL's `save_total_limit` rotates whole checkpoints).
    """
    pool.flush(wait=True)
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    previous = _committed_state(path)
    snapshot = previous["snapshot"] + 1 if previous else 1
    try:
        entries = {
            TRAJECTORIES_DIR: pool._trajectories.save_into(os.path.join(path, TRAJECTORIES_DIR)),
            TASK_ROWS_DIR: pool._task_rows.save_into(os.path.join(path, TASK_ROWS_DIR)),
        }
        tasks_file = f"{TASKS_DIR}/{snapshot:08d}-{uuid.uuid4().hex[:12]}.arrow"
        os.makedirs(os.path.join(path, TASKS_DIR), exist_ok=True)
        table = _tasks_table(pool, entries)
        write_atomic(os.path.join(path, tasks_file), lambda tmp: write_arrow(tmp, table))
        files = {tasks_file: _file_entry(*_digest(os.path.join(path, tasks_file)))}
        for kind, es in entries.items():
            files.update({f"{kind}/{e['name']}": _file_entry(*e["digest"]) for e in es})
        for folder in (TRAJECTORIES_DIR, TASK_ROWS_DIR, TASKS_DIR):
            fsync_path(os.path.join(path, folder))
        state = {
            "format_version": FORMAT_VERSION,
            "snapshot": snapshot,
            "settings": pool._settings(),
            "tokenizer_fingerprint": pool.tokenizer_fingerprint,
            "counters": {
                "next_traj_id": pool._next_traj_id,
                "num_outcomes": pool._num_outcomes,
                "stored_count": pool._stored_count,
                "stamp": pool._stamp,
            },
            "num_trajectories": pool.num_trajectories,
            "num_tasks": len(pool._task_ids),
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


def _tasks_table(pool, entries: dict[str, list[dict]]):
    """The per-task table of a snapshot: task state and where its rows are (shard number in the state, row)."""
    import pyarrow as pa

    n = len(pool._task_ids)
    counts = pool._count[:n]
    slots = pool._slots[:n]
    keys = slots[slots >= 0]  # task by task, in store order
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])

    def where(log, keys, kind):
        index = np.full(log._next_sid + 1, -1, np.int32)
        for i, entry in enumerate(entries[kind]):
            index[entry["sid"]] = i
        locations = log.locations(keys)
        return index[locations >> 32], (locations & 0xFFFFFFFF).astype(np.int32)

    traj_shard, traj_row = where(pool._trajectories, keys, TRAJECTORIES_DIR)
    row_keys = pool._row_key[:n]
    has_row = row_keys >= 0
    row_shard = np.full(n, -1, np.int32)
    row_index = np.full(n, -1, np.int32)
    row_shard[has_row], row_index[has_row] = where(pool._task_rows, row_keys[has_row], TASK_ROWS_DIR)

    def lists(values):
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    return pa.table(
        {
            "task_id": pa.array(pool._task_ids, pa.string()),
            "difficulty": pool._difficulty[:n],
            "difficulty_order": pool._difficulty_order[:n],
            "bucket_pos": pool._bucket_pos[:n],
            "skip_order": pool._skip_order[:n],
            "store_order": pool._store_order[:n],
            "row_shard": row_shard,
            "row_index": row_index,
            "traj_shard": lists(traj_shard),
            "traj_row": lists(traj_row),
            "traj_id": lists(pool._key_traj_id[keys]),
        },
        schema=TASKS_SCHEMA,
    )


def load_pool(
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
    """Load the pool saved at `path`.

    The folder is untrusted input (`trl_exreplay.pool.check`): ``state.json`` is validated, every file must be
    named inside the folder and resolve inside it, have its recorded size and (with `verify`, the default) its
    recorded xxh3-64 checksum, and a valid Arrow layout, before anything is mapped. Any damage raises one
    `PoolFormatError` (a `ValueError`) naming the file. Shards are then memory-mapped, not read: RAM receives the
    index only. A row a model cannot train on (null field, lists of unequal length, wrong trajectory id,
    non-finite log-prob or reward, a mask value other than 0/1, a token id < 0 or >= `vocab_size`) is left out,
    counted in `rejected_rows` (by reason in `rejected_reasons`) and logged.

    Given a `tokenizer`, a pool recorded with another one is refused (`ValueError`), and so is a pool recorded
    with none, unless `allow_missing_fingerprint`. ``verify=False`` skips the checksums (sizes, names, layouts
    and row values are still checked): for a local pool on a trusted disk (`benchmarks/pool_scale.py` measures
    both). `pool.hub.pool_from_hub` always verifies.
    """
    path = os.path.abspath(path)
    if not os.path.lexists(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"No experience pool at {path} (missing {STATE_FILE}).")
    state = read_state(path)
    pool = _load_snapshot(cls, path, state, work_dir, shard_rows, vocab_size, verify)
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
        _fill_from_snapshot(pool, folder, state, tasks, vocab_size, verify)
    except BaseException:
        pool.close()
        raise
    return pool


def _fill_from_snapshot(pool, folder: PoolFolder, state: dict, tasks, vocab_size, verify) -> None:
    import pyarrow as pa

    pool.tokenizer_fingerprint = state.get("tokenizer_fingerprint")
    counters = state["counters"]
    pool._next_traj_id = int(counters["next_traj_id"])
    pool._num_outcomes = int(counters["num_outcomes"])
    pool._stored_count = int(counters["stored_count"])
    pool._stamp = int(counters["stamp"])
    n = tasks.num_rows
    pool._task_ids = tasks.column("task_id").to_pylist()
    pool._task_index = {task_id: i for i, task_id in enumerate(pool._task_ids)}
    pool._ensure_tasks(n)
    for name in ("difficulty", "difficulty_order", "skip_order", "store_order"):
        getattr(pool, f"_{name}")[:n] = tasks.column(name).to_numpy()
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
            if verify:  # checked just now: a later save need not hash it again
                recorded = state["files"][f"{kind}/{entry['name']}"]
                shard.digest = (recorded["size"], recorded[CHECKSUM])
            yield i, shard

    def settle(log, shard):
        shard.layout(log.read_columns)  # so that no read pays for it
        shard.release()  # validation read offsets and ids through the mapping: unmap them again
        log.keep(shard)  # unmapped too, when a hard link in the scratch folder keeps the file

    reasons = pool.rejected_reasons
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
        pool._row_key[owners[good]] = pool._task_rows.adopt(shard, rows[good])
        placed[owners[good]] = True
        settle(pool._task_rows, shard)
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
        keys = pool._trajectories.adopt(shard, rows)
        pool._ensure_keys(int(keys.max()) + 1)
        pool._key_task[keys] = entry_task[good]
        pool._key_entropy[keys] = columns["entropy"][rows]
        pool._key_version[keys] = columns["policy_version"][rows]
        pool._key_traj_id[keys] = columns["traj_id"][rows]
        pool._key_seq[keys] = columns["store_seq"][rows]
        entry_key[good] = keys
        del table, columns
        settle(pool._trajectories, shard)
    ok = entry_key >= 0
    _place_slots(pool, entry_task[ok], entry_key[ok], n)
    pool._rebuild_buckets(places)
    pool.vocab_size = vocab_size
    trim_heap()


def _place_slots(pool, entry_task: np.ndarray, entry_key: np.ndarray, n: int) -> None:
    """Rebuild the slots from keys listed task by task, in store order."""
    counts = np.bincount(entry_task, minlength=n).astype(np.int32) if n else np.zeros(0, np.int32)
    width = max(1, pool.max_trajectories_per_task, int(counts.max(initial=0)))
    pool._slots = np.full((len(pool._difficulty), width), -1, np.int32)
    starts = np.cumsum(counts) - counts
    pool._slots[entry_task, np.arange(len(entry_key)) - starts[entry_task]] = entry_key
    pool._count[:n] = counts
    pool._store_order[:n][counts == 0] = -1
    pool._num_live = len(entry_key)
    pool._num_stored_tasks = int((counts > 0).sum())


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
