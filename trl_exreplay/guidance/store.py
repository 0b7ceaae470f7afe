"""The offline experience store: records retrieved by BM25 over their task text, and saved to a folder as Arrow tables.

* `ExperienceStore`: an in-memory list of `ExperienceRecord`s. `retrieve(query, k)` ranks the records by BM25 (the
  `bm25s` library, English stop words removed) of `query` against each record's `query` and returns the contents of
  the best `k`, each content once. The index is rebuilt on the first `retrieve` after an `add`, not on every call.
* `save_experience` / `load_experience`: the records and the summariser's backlog (`SummaryInput`s not summarised
  yet) in a folder, saved with a checkpoint. Arrow via `datasets`, like the pool; no pickle. A saved folder is
  untrusted input on load (checkpoints are shared), checked as `trl_exreplay.pool.check` checks a pool.

The folder::

    manifest.json                          the commit: format version, every file's size and xxh3-64 checksum,
                                           each table's rows and data files
    v-<16 hex>/records/                    `datasets.Dataset.save_to_disk` of the records
    v-<16 hex>/backlog/                    ... and of the backlog (`datasets.load_from_disk` reads both)

A save is atomic, as a pool's (`trl_exreplay.pool.persistence`): the new version folder is written complete and fsynced
beside the committed one, then ``manifest.json`` is replaced (the commit), then what the manifest does not name is
removed. A process killed at any instant of a save leaves the previous save loadable, or the new one once committed,
never a mixture; before a folder's first commit it holds no manifest, hence no saved experience. What a killed save
leaves (a version folder the manifest does not name, a temporary manifest) is removed by the next save to the same
folder. One save to a folder at a time.

Example:

```python
import tempfile

from trl_exreplay.guidance import ExperienceRecord, SummaryInput
from trl_exreplay.guidance.store import ExperienceStore, load_experience, save_experience

store = ExperienceStore()
store.add([
    ExperienceRecord("t1", "put a mug in the sink", "Take the mug from the table first.", "t1:a", step=1),
    ExperienceRecord("t2", "heat an egg", "Use the microwave.", "t2:b", step=1),
])
assert store.retrieve("put a clean mug in the sink", k=3) == ["Take the mug from the table first."]
assert store.retrieve("the a of", k=3) == []  # stop words only: nothing to match

backlog = [SummaryInput("t3:c", "t3", "cool a bottle", ["go to fridge 1", "cool bottle 1"], reward=1.0, step=2)]
folder = tempfile.mkdtemp() + "/experience"
save_experience(folder, store.records(), backlog)
loaded = load_experience(folder)
assert loaded.records == store.records() and loaded.backlog == backlog and loaded.skipped == 0
```
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..pool.check import CHECKSUM, PoolFormatError, _is_int, _within, check_arrow, file_checksum
from ..pool.store import fsync_path, write_json_atomic
from .provider import ExperienceRecord, SummaryInput

__all__ = [
    "ExperienceFormatError",
    "ExperienceStore",
    "LoadedExperience",
    "load_experience",
    "save_experience",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RECORDS, BACKLOG = "records", "backlog"
_MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a handful of files: a few hundred bytes
_MAX_FILES = 64
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # no '..', no hidden file, no separator
_VERSION = re.compile(r"v-[0-9a-f]{16}")
# An uncompressed stream's columns take about its size in memory; more than this many times it is refused.
_MAX_EXPANSION, _MAX_EXPANSION_SLACK = 8, 1 << 20
_HEX = re.compile(r"[0-9a-f]{16}")
_TEMPORARY_MANIFEST = re.compile(rf"\.{re.escape(MANIFEST)}\.tmp-[0-9a-f]{{12}}")  # `write_json_atomic`'s

# Column names and types, in the dataclasses' field order. Load requires exactly these (`pool.check.check_arrow`).
RECORD_SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("query", pa.string()),
        ("content", pa.string()),
        ("source", pa.string()),
        ("step", pa.int64()),
    ]
)
BACKLOG_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("task_id", pa.string()),
        ("query", pa.string()),
        ("actions", pa.list_(pa.string())),
        ("reward", pa.float64()),
        ("step", pa.int64()),
        ("observations", pa.list_(pa.string())),
    ]
)
SCHEMAS = {RECORDS: RECORD_SCHEMA, BACKLOG: BACKLOG_SCHEMA}


class ExperienceFormatError(ValueError):
    """A saved experience folder that cannot be used as it is; the message names the file and what is wrong."""

    def __init__(self, file: str, problem: str):
        self.file, self.problem = file, problem
        super().__init__(f"Experience file {file}: {problem}")


# ------------------------------------------------------------------------------------------------------- the store
class ExperienceStore:
    """Experience records in memory, retrieved by BM25 over each record's `query` (the task text it was made for).

    `add` skips a record whose (query, content) the store already holds, counted in `duplicates`; beyond
    `max_records` the oldest records are dropped, counted in `dropped` (the index is rebuilt after each add, so a store
    without bound would cost more every step). `retrieve` is deterministic: the same records, added in the same
    order, give the same answer to the same query (equal scores rank in insertion order). Safe to call from several
    threads (one lock; the index is rebuilt under it).
    """

    def __init__(self, records: Iterable[ExperienceRecord] = (), max_records: int = 20_000):
        if not isinstance(max_records, int) or isinstance(max_records, bool) or max_records < 1:
            raise ValueError(f"max_records must be an integer >= 1, got {max_records!r}.")
        self.max_records = max_records
        self._records: list[ExperienceRecord] = []
        self._keys: set[tuple[str, str]] = set()
        self.duplicates = 0  # records `add` skipped: same query and content as one held
        self.dropped = 0  # the oldest records dropped beyond max_records
        self._lock = threading.Lock()
        self._index = None  # the bm25s.BM25 of the records as of version `_indexed`; None when no record has a word
        self._version = 0  # changes with every add that changes the records
        self._indexed = 0
        self.add(records)

    def add(self, records: Iterable[ExperienceRecord]) -> None:
        """Append `records`, skipping exact duplicates (same query and content as a record held or added before)."""
        records = list(records)  # checked before any is added: all or none
        for record in records:
            if not isinstance(record, ExperienceRecord):
                raise TypeError(f"ExperienceStore.add takes ExperienceRecord objects, got {type(record).__name__}.")
        with self._lock:
            for record in records:
                key = (record.query, record.content)
                if key in self._keys:
                    self.duplicates += 1
                    continue
                self._keys.add(key)
                self._records.append(record)
                self._version += 1
            excess = len(self._records) - self.max_records
            if excess > 0:
                for old in self._records[:excess]:
                    self._keys.discard((old.query, old.content))
                del self._records[:excess]
                self.dropped += excess

    def retrieve(self, query: str, k: int) -> list[str]:
        """The contents of the (at most) `k` records whose `query` best matches `query` by BM25, best first; each
        content once. Records that share no word with `query` (score 0) are never returned; an empty store, or a
        query of stop words only, gives []."""
        if not isinstance(query, str):
            raise TypeError(f"query must be a str, got {type(query).__name__}.")
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}.")
        if k == 0:
            return []
        import bm25s

        words = bm25s.tokenize(query, stopwords="en", show_progress=False, return_ids=False)[0]
        if not words:
            return []
        with self._lock:
            index, records = self._current_index()
            if index is None:
                return []
            # All scores, not `BM25.retrieve`'s top k: its top k breaks ties in no stated order, and k records can
            # share fewer than k contents. One query costs ~0.1 ms for 10k records.
            scores = index.get_scores(words)
        order = np.argsort(-scores, kind="stable")  # stable: equal scores stay in insertion order
        contents: list[str] = []
        seen: set[str] = set()
        for i in order:
            if scores[i] <= 0:  # sorted: the rest share no word with the query either
                break
            content = records[i].content
            if content not in seen:
                seen.add(content)
                contents.append(content)
                if len(contents) == k:
                    break
        return contents

    def _current_index(self):
        """The index of all records (rebuilt when records were added since it was built) and those records."""
        if self._indexed != self._version:
            import bm25s

            corpus = bm25s.tokenize([r.query for r in self._records], stopwords="en", show_progress=False)
            if corpus.vocab:
                self._index = bm25s.BM25()
                self._index.index(corpus, show_progress=False)
            else:  # no record has a word that is not a stop word (bm25s cannot index an empty vocabulary)
                self._index = None
            self._indexed = self._version
        return self._index, self._records

    def records(self) -> list[ExperienceRecord]:
        """A copy of the records, in insertion order."""
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)


# ------------------------------------------------------------------------------------------------------- saving
def _check_strings(value, what: str) -> None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{what} must be a list of str, got {value!r}.")


def _record_columns(records: Sequence[ExperienceRecord]) -> dict[str, list]:
    """Columns of the records table, refused (before anything is written) where load would refuse them."""
    for i, record in enumerate(records):
        if not isinstance(record, ExperienceRecord):
            raise TypeError(f"records[{i}] must be an ExperienceRecord, got {type(record).__name__}.")
        for name in ("task_id", "query", "content", "source"):
            if not isinstance(getattr(record, name), str):
                raise TypeError(f"records[{i}].{name} must be a str, got {getattr(record, name)!r}.")
        if not _is_int(record.step) or record.step < 0:
            raise ValueError(f"records[{i}].step must be an integer >= 0, got {record.step!r}.")
    return {name: [getattr(r, name) for r in records] for name in RECORD_SCHEMA.names}


def _backlog_columns(backlog: Sequence[SummaryInput]) -> dict[str, list]:
    for i, item in enumerate(backlog):
        if not isinstance(item, SummaryInput):
            raise TypeError(f"backlog[{i}] must be a SummaryInput, got {type(item).__name__}.")
        for name in ("source", "task_id", "query"):
            if not isinstance(getattr(item, name), str):
                raise TypeError(f"backlog[{i}].{name} must be a str, got {getattr(item, name)!r}.")
        _check_strings(item.actions, f"backlog[{i}].actions")
        _check_strings(item.observations, f"backlog[{i}].observations")
        if not isinstance(item.reward, (int, float)) or isinstance(item.reward, bool):
            raise TypeError(f"backlog[{i}].reward must be a number, got {item.reward!r}.")
        if not _is_int(item.step) or item.step < 0:
            raise ValueError(f"backlog[{i}].step must be an integer >= 0, got {item.step!r}.")
    # A non-finite reward is written as it is; load leaves such rows out, counted (`LoadedExperience.skipped`).
    columns = {name: [getattr(b, name) for b in backlog] for name in BACKLOG_SCHEMA.names}
    columns["reward"] = [float(r) for r in columns["reward"]]
    return columns


def _features(schema: pa.Schema):
    """The `datasets.Features` whose Arrow schema is `schema` (strings, int64, float64 and lists of strings)."""
    import datasets

    dtypes = {pa.string(): "string", pa.int64(): "int64", pa.float64(): "float64"}
    return datasets.Features(
        {
            f.name: datasets.List(datasets.Value(dtypes[f.type.value_type]))
            if pa.types.is_list(f.type)
            else datasets.Value(dtypes[f.type])
            for f in schema
        }
    )


@contextlib.contextmanager
def _no_progress_bars():
    """`save_to_disk` draws a progress bar per table; a checkpoint save should not print two of them."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not disabled:
            enable_progress_bars()


def _write_table(root: str, version: str, table: str, columns: dict[str, list]) -> tuple[dict, dict]:
    """`datasets` writes table `table` into ``root/version/table``; returns its manifest entry and its files'."""
    import datasets

    folder = os.path.join(root, version, table)
    dataset = datasets.Dataset.from_dict(columns, features=_features(SCHEMAS[table]))
    with _no_progress_bars():
        dataset.save_to_disk(folder, num_shards=1)
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        fsync_path(path)  # `datasets` does not: a power cut after the commit could lose the bytes
        files[f"{version}/{table}/{name}"] = {"size": os.path.getsize(path), CHECKSUM: file_checksum(path)}
    fsync_path(folder)
    data_files = [name for name in files if name.endswith(".arrow")]
    return {"rows": dataset.num_rows, "data_files": data_files}, files


def _ours(folder: str, name: str) -> bool:
    """Whether `name` in `folder` is something a save writes there: the manifest, a version folder, a temporary
    manifest."""
    path = os.path.join(folder, name)
    if name == MANIFEST:
        return os.path.isfile(path)
    if _VERSION.fullmatch(name):
        return os.path.isdir(path) and not os.path.islink(path)
    return _TEMPORARY_MANIFEST.fullmatch(name) is not None and os.path.isfile(path)


def save_experience(folder: str, records: Sequence[ExperienceRecord], backlog: Sequence[SummaryInput]) -> None:
    """Save `records` and `backlog` to `folder`, atomically (see the module docstring), replacing what it held.

    `folder` must not exist, or hold only what saves write there (none at all, a saved experience, what a killed save
    left): anything else is refused (`ValueError`) rather than written into. Values load would refuse (a negative
    step, a str field that is not a str) raise before anything is written.
    """
    columns = {RECORDS: _record_columns(records), BACKLOG: _backlog_columns(backlog)}
    folder = os.path.abspath(folder)
    if os.path.lexists(folder) and not (
        os.path.isdir(folder) and not os.path.islink(folder) and all(_ours(folder, n) for n in os.listdir(folder))
    ):
        raise ValueError(
            f"Not saving experience into {folder}: it holds something other than a saved experience (a "
            f"{MANIFEST} and its version folder). Save to another folder, or remove this one first."
        )
    os.makedirs(folder, exist_ok=True)
    version = f"v-{uuid.uuid4().hex[:16]}"
    committed = False
    try:
        tables, files = {}, {}
        for table in (RECORDS, BACKLOG):
            tables[table], table_files = _write_table(folder, version, table, columns[table])
            files.update(table_files)
        fsync_path(os.path.join(folder, version))
        fsync_path(folder)
        write_json_atomic(
            os.path.join(folder, MANIFEST), {"format_version": FORMAT_VERSION, "tables": tables, "files": files}
        )  # the commit
        committed = True
        fsync_path(folder)
    except BaseException:
        if not committed:  # remove what this save wrote; the committed save is untouched
            shutil.rmtree(os.path.join(folder, version), ignore_errors=True)
        raise
    for name in os.listdir(folder):  # the previous save's version, and what killed saves left
        if name not in (MANIFEST, version) and _ours(folder, name):
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


# ------------------------------------------------------------------------------------------------------- loading
@dataclass
class LoadedExperience:
    """What `load_experience` read: the records, the backlog, and the backlog rows left out (`skipped`: a
    non-finite reward, which no trajectory that was summarised can have)."""

    records: list[ExperienceRecord] = field(default_factory=list)
    backlog: list[SummaryInput] = field(default_factory=list)
    skipped: int = 0


def _need(condition: bool, file: str, problem: str) -> None:
    if not condition:
        raise ExperienceFormatError(file, problem)


def _regular_file(folder: str, name: str, file: str) -> tuple[str, os.stat_result]:
    """Path and stat of `name` in `folder`, refused unless it resolves (through symlinks) to a regular file inside
    the folder. Checked before the file is opened: a FIFO would block the open, a link could reach anything."""
    path = os.path.join(folder, *name.split("/"))
    real = os.path.realpath(path)
    _need(
        _within(real, os.path.realpath(folder)),
        path,
        f"resolves to {real}, outside the experience folder {folder}: its files must stay in it.",
    )
    try:
        info = os.stat(path)
    except OSError as e:
        raise ExperienceFormatError(path, f"cannot be read ({e.strerror}); {file} lists it.") from None
    _need(stat.S_ISREG(info.st_mode), path, "is not a regular file.")
    return path, info


def _check_name(name, table: str | None, file: str) -> str:
    """`name` must be ``<version>/<table>/<file>``: plain parts (letters, digits, '.', '_', '-', not first '.')."""
    parts = name.split("/") if isinstance(name, str) else []
    _need(
        len(parts) == 3
        and all(_PART.fullmatch(part) for part in parts)
        and (parts[1] == table if table else parts[1] in SCHEMAS),
        file,
        f"file name {name!r} is not allowed (allowed: <version>/<{'|'.join(SCHEMAS) if table is None else table}>/"
        "<name>, each part letters, digits, '.', '_', '-' and not starting with '.'; no '..', no absolute path).",
    )
    return name


def _read_manifest(folder: str) -> dict:
    """The manifest, parsed and validated: every key known, every name plain, every size and checksum well formed."""
    path, info = _regular_file(folder, MANIFEST, MANIFEST)
    _need(
        info.st_size <= _MAX_MANIFEST_BYTES,
        path,
        f"is larger than {_MAX_MANIFEST_BYTES} bytes; a manifest is far smaller.",
    )
    with open(path, "rb") as f:
        text = f.read(_MAX_MANIFEST_BYTES + 1)
    _need(len(text) <= _MAX_MANIFEST_BYTES, path, f"is larger than {_MAX_MANIFEST_BYTES} bytes.")
    try:
        manifest = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ExperienceFormatError(path, f"not valid JSON ({e}).") from None
    _need(isinstance(manifest, dict), path, f"must hold a JSON object, got {type(manifest).__name__}.")
    _need(
        sorted(manifest) == ["files", "format_version", "tables"],
        path,
        f"must have exactly the keys ['files', 'format_version', 'tables'], got {sorted(manifest)}.",
    )
    version = manifest["format_version"]
    _need(
        _is_int(version) and version == FORMAT_VERSION,
        path,
        f"format_version {version!r} is not one this version of trl_exreplay reads ({FORMAT_VERSION})"
        + ("; upgrade trl_exreplay." if _is_int(version) and version > FORMAT_VERSION else "."),
    )
    files = manifest["files"]
    _need(isinstance(files, dict) and len(files) <= _MAX_FILES, path, f"`files` must be an object of <= {_MAX_FILES}.")
    for name, entry in files.items():
        _check_name(name, None, path)
        _need(
            isinstance(entry, dict) and sorted(entry) == sorted(["size", CHECKSUM]),
            path,
            f"`files[{name!r}]` must be an object with exactly `size` and `{CHECKSUM}`.",
        )
        _need(
            _is_int(entry["size"]) and entry["size"] >= 0,
            path,
            f"`files[{name!r}].size` must be an integer >= 0, got {entry['size']!r}.",
        )
        _need(
            isinstance(entry[CHECKSUM], str) and _HEX.fullmatch(entry[CHECKSUM]) is not None,
            path,
            f"`files[{name!r}].{CHECKSUM}` must be 16 hex digits, got {entry[CHECKSUM]!r}.",
        )
    tables = manifest["tables"]
    _need(
        isinstance(tables, dict) and sorted(tables) == sorted(SCHEMAS),
        path,
        f"`tables` must be an object with exactly the keys {sorted(SCHEMAS)}.",
    )
    for table, entry in tables.items():
        _need(
            isinstance(entry, dict) and sorted(entry) == ["data_files", "rows"],
            path,
            f"`tables.{table}` must be an object with exactly `rows` and `data_files`.",
        )
        _need(
            _is_int(entry["rows"]) and entry["rows"] >= 0,
            path,
            f"`tables.{table}.rows` must be an integer >= 0, got {entry['rows']!r}.",
        )
        data = entry["data_files"]
        _need(
            isinstance(data, list) and data and len(set(map(str, data))) == len(data),
            path,
            f"`tables.{table}.data_files` must be a non-empty list of distinct names.",
        )
        for name in data:
            _check_name(name, table, path)
            _need(name.endswith(".arrow"), path, f"`tables.{table}.data_files` entry {name!r} is not an .arrow file.")
            _need(name in files, path, f"`tables.{table}.data_files` entry {name!r} is not listed in `files`.")
    return manifest


def _read_rows(path: str, table: str) -> list[tuple]:
    """The rows of the Arrow stream at `path` (size and checksum already verified), as tuples in the schema's field
    order, after its schema, layout, nulls and steps are checked."""
    try:
        with pa.memory_map(path) as source:
            # Batch by batch, bounded: an IPC stream may hold compressed buffers, and a small file must not expand
            # into gigabytes (the checksums say nothing: whoever edits a file can rewrite the manifest too).
            reader, batches, expanded = pa.ipc.open_stream(source), [], 0
            for batch in reader:
                expanded += batch.nbytes
                _need(
                    expanded <= _MAX_EXPANSION * max(source.size(), 1) + _MAX_EXPANSION_SLACK,
                    path,
                    f"expands to more than {_MAX_EXPANSION}x its size in memory (compressed buffers?); refused.",
                )
                batches.append(batch)
            data = pa.Table.from_batches(batches, schema=reader.schema)
            try:
                check_arrow(data, SCHEMAS[table], path)  # exact columns and types, valid offsets and UTF-8
            except PoolFormatError as e:
                raise ExperienceFormatError(path, e.problem) from None
            for name in data.column_names:
                column = data.column(name)
                nulls = column.null_count
                if pa.types.is_list(column.type):
                    nulls += pc.list_flatten(column).null_count
                _need(nulls == 0, path, f"column `{name}` holds {nulls} null value(s); every value must be set.")
            lowest = pc.min(data.column("step")).as_py()
            _need(lowest is None or lowest >= 0, path, f"column `step` holds {lowest}; a step is >= 0.")
            rows = list(zip(*(data.column(name).to_pylist() for name in data.column_names)))  # Python objects
    except (OSError, pa.ArrowException) as e:
        raise ExperienceFormatError(path, f"is not an Arrow stream file ({e}).") from None
    return rows


def load_experience(folder: str) -> LoadedExperience:
    """The records and backlog saved in `folder` by `save_experience`.

    The folder is untrusted input. In this order, before any Arrow file is mapped: ``manifest.json`` (a regular file
    of at most 1 MiB, valid JSON, a known format version, every key and type as written); every file it lists (a
    plain name ``<version>/<table>/<file>`` that resolves, through symlinks, to a regular file inside the folder, of
    the recorded size and xxh3-64 checksum). Then each table: exactly its columns and types, a valid Arrow layout, the
    recorded row count, no null value, no negative step. Every refusal is an `ExperienceFormatError` (a `ValueError`)
    naming the file. A backlog row with a non-finite reward is left out, logged and counted in
    `LoadedExperience.skipped`. A folder without ``manifest.json`` raises `FileNotFoundError`.
    """
    folder = os.path.abspath(folder)
    if not os.path.lexists(os.path.join(folder, MANIFEST)):
        raise FileNotFoundError(f"No saved experience at {folder} (missing {MANIFEST}).")
    manifest = _read_manifest(folder)
    manifest_path = os.path.join(folder, MANIFEST)
    paths = {}
    for name, entry in manifest["files"].items():  # every file, before any is mapped
        path, info = _regular_file(folder, name, manifest_path)
        _need(info.st_size == entry["size"], path, f"has {info.st_size} bytes; the manifest recorded {entry['size']}.")
        found = file_checksum(path)
        _need(found == entry[CHECKSUM], path, f"checksum mismatch ({found} != {entry[CHECKSUM]}): damaged or edited.")
        paths[name] = path
    rows = {}
    for table, entry in manifest["tables"].items():
        rows[table] = [row for name in entry["data_files"] for row in _read_rows(paths[name], table)]
        _need(
            len(rows[table]) == entry["rows"],
            manifest_path,
            f"`tables.{table}.rows` is {entry['rows']}, but its data files hold {len(rows[table])} rows.",
        )
    loaded = LoadedExperience(records=[ExperienceRecord(*row) for row in rows[RECORDS]])
    reward = BACKLOG_SCHEMA.names.index("reward")
    for row in rows[BACKLOG]:
        if math.isfinite(row[reward]):
            loaded.backlog.append(SummaryInput(*row))
        else:
            loaded.skipped += 1
    if loaded.skipped:
        logger.warning(
            "trl_exreplay: %d backlog row(s) of the experience saved at %s have a "
            "non-finite reward and were left out.",
            loaded.skipped,
            folder,
        )
    return loaded
