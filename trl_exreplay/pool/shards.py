"""Where a pool's rows live: immutable, memory-mapped Arrow shards written off the training thread.

Why: a pool of a million trajectories of a thousand tokens with their log-probs is ~10 GB. Only an index of it may
live in RAM; the rows go to Arrow IPC stream files (the format `datasets` writes and memory-maps) of ~1k rows each.
A shard is never modified once it has its name, so a saved pool shares shards with the live pool and with the other
checkpoints through hard links, and a save only writes what is new. Rows are read back with `os.pread` at offsets
known from the shard's layout, so reading maps no page of the pool into the process either.

`ShardLog`: rows addressed by small integer keys. A key's row is pending (the caller's objects, a few dozen at most),
in the open shard (compact Arrow columns in RAM, converted off-thread by the pool's `Writer`) or at (shard, row) of a
shard file. Deleting a key leaves a tombstone in its shard; compaction rewrites shards that are mostly tombstones and
drops shards with no live row.

Example:

```python
import pyarrow as pa
from trl_exreplay.pool.folder import Scratch
from trl_exreplay.pool.shards import ShardLog
from trl_exreplay.pool.writer import Writer

schema = pa.schema([("text", pa.string())])
log = ShardLog("notes", "note", schema, lambda items: pa.record_batch([pa.array(items)], schema=schema),
               Writer(), Scratch(), shard_rows=2, stage_rows=1)
keys = [log.append(text) for text in ("a", "b", "c")]  # each append is handed to the writer thread
log.flush(seal=True, wait=True)  # "a", "b" filled one shard file; sealing writes "c" to a second one
assert log.read(keys, ("text",)) == [{"text": "a"}, {"text": "b"}, {"text": "c"}] and log.stats()["shards"] == 2
```
"""

from __future__ import annotations

import array
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .check import bytes_checksum, file_checksum
from .folder import Scratch, link_or_copy, write_atomic
from .index import grow
from .writer import Writer

_BURST_GAP, _MAX_DEFER = 0.003, 0.5
PENDING = -1  # location of a row still in RAM
FREE = -2  # location of an unused key
_ROW_BITS = 32
_ROW_MASK = (1 << _ROW_BITS) - 1


def _value(dtype: str) -> dict:
    return {"dtype": dtype, "_type": "Value"}


def _list(dtype: str) -> dict:
    return {"feature": _value(dtype), "_type": "List"}


# `datasets` features of a trajectory shard, written into the Arrow schema's metadata as `datasets` does, so
# `datasets.Dataset.from_file` / `load_dataset` read the shards with these features (and no import of `datasets` is
# needed to write them).
TRAJECTORY_FEATURES = {
    "task_id": _value("string"),
    "prompt_ids": _list("int32"),
    "completion_ids": _list("int32"),
    "completion_mask": _list("int8"),
    "logps": _list("float32"),
    "rewards": _list("float32"),
    "reward": _value("float32"),
    "entropy": _value("float32"),
    "policy_version": _value("int64"),
    "traj_id": _value("int64"),
    "store_seq": _value("int64"),  # rank of the trajectory among all ever stored in the pool (replay_window)
}
TASK_ROW_FEATURES = {"task_id": _value("string"), "task_row": _value("string")}


def arrow_schema(features: dict) -> pa.Schema:
    """The Arrow schema `datasets` gives `features` (same types and the same ``huggingface`` metadata)."""
    arrow_types = {
        "string": pa.string(),
        "int8": pa.int8(),
        "int32": pa.int32(),
        "int64": pa.int64(),
        "float32": pa.float32(),
    }
    fields = []
    for name, spec in features.items():
        if spec["_type"] == "List":
            fields.append(pa.field(name, pa.list_(arrow_types[spec["feature"]["dtype"]])))
        else:
            fields.append(pa.field(name, arrow_types[spec["dtype"]]))
    metadata = {"huggingface": json.dumps({"info": {"features": features}})}
    return pa.schema(fields, metadata=metadata)


TRAJECTORY_SCHEMA = arrow_schema(TRAJECTORY_FEATURES)
TASK_ROW_SCHEMA = arrow_schema(TASK_ROW_FEATURES)


def write_arrow(path: str, table: pa.Table | pa.RecordBatch) -> None:
    """An Arrow IPC stream file, as `datasets` writes them (`Dataset.from_file` memory-maps it)."""
    with pa.OSFile(path, "wb") as sink:
        _write_stream(sink, table)


def _write_stream(sink, table: pa.Table | pa.RecordBatch) -> None:
    with pa.ipc.new_stream(sink, table.schema) as writer:
        if isinstance(table, pa.RecordBatch):
            writer.write_batch(table)
        else:
            writer.write_table(table)


def arrow_bytes(table: pa.Table) -> pa.Buffer:
    """The bytes `write_arrow` writes for `table`, in memory."""
    sink = pa.BufferOutputStream()
    _write_stream(sink, table)
    return sink.getvalue()


def write_buffer(path: str, data: pa.Buffer) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(data))


def read_arrow(path: str) -> pa.Table:
    """An Arrow stream (or file-format) file as a table, memory-mapped: no data is read until used."""
    return map_arrow(path)[0]


def map_arrow(path: str) -> tuple[pa.Table, tuple[int, int]]:
    """`read_arrow`, plus the (address, size) of the whole mapping, for `release_pages`."""
    source = pa.memory_map(path)
    try:
        whole = source.read_buffer()  # a zero-copy view of the entire mapping
    finally:
        source.close()  # the buffers keep the mapping alive; the file descriptor is not needed any more
    try:
        table = pa.ipc.open_stream(pa.BufferReader(whole)).read_all()
    except pa.ArrowInvalid:
        table = pa.ipc.open_file(pa.BufferReader(whole)).read_all()
    return table, (whole.address, whole.size)


def _madvise():
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.madvise
    except (OSError, AttributeError):
        return None


_MADVISE = _madvise() if os.name == "posix" else None
_MADV_DONTNEED = 4  # Linux


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise): called after loading, whose temporaries
    would else stay counted in the process's RSS."""
    pa.default_memory_pool().release_unused()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_pages(span: tuple[int, int] | None) -> None:
    """Unmap the resident pages of a read-only file mapping from this process (they stay in the page cache and come
    back on the next access). A read through a mapping faults in whole page-cache folios (up to MBs) around it:
    without this, validating or compacting shards would leave most of the pool's files counted in the RSS."""
    if span is None or _MADVISE is None or not sys.platform.startswith("linux"):
        return
    address, size = span
    if size:
        _MADVISE(address, size, _MADV_DONTNEED)  # the exact span of a MAP_SHARED read-only mapping: always safe


# ----------------------------------------------------------------------------------------------------------- shards
class Shard:
    """One shard: the open one, whose rows are still in RAM, or an immutable Arrow file at `path`.

    A file is read with `os.pread` at byte offsets known from its layout, so no page of it is mapped into the process.
    A file the log owns (its copy in the scratch folder, `owned`) needs no mapping; any other (a loaded file no hard
    link could keep) stays mapped too, and is read through its mapping once its folder is gone. `live` counts its
    rows without a tombstone (those in `dead`).
    """

    __slots__ = ("sid", "name", "rows", "nbytes", "live", "dead", "path", "owned", "digest", "_table", "_span",
                 "_layout", "_inode", "copies")  # fmt: skip

    def __init__(self, sid: int, name: str, rows: int, path: str | None = None, owned: bool = False):
        self.sid = sid
        self.name = name
        self.rows = rows
        self.nbytes = 0
        self.live = 0
        self.dead: set[int] = set()
        self.path = path
        self.owned = owned
        self.copies: list[str] = []  # the copies the last saves made, newest first (on the checkpoints' file system)
        self.digest: tuple[int, str] | None = None  # (size, xxh3-64) of the file: computed once, it never changes
        self._table: pa.Table | None = None
        self._span: tuple[int, int] | None = None  # (address, size) of the file mapping
        self._layout: tuple | None = None  # (names, where they are in the file): see `prepare`
        self._inode: tuple[int, int] | None = None  # (device, inode) of the mapped file

    @property
    def is_open(self) -> bool:
        return self.path is None

    def table(self) -> pa.Table:
        """The shard's rows, memory-mapped (mapped now if not yet)."""
        if self._table is None:
            self.map(self.path)
        return self._table

    def map(self, path: str) -> None:
        """Memory-map the file at `path` as this shard's rows."""
        info = os.stat(path)
        self._table, self._span = map_arrow(path)
        self._inode = (info.st_dev, info.st_ino)
        self.rows = self._table.num_rows

    def prepare(self, names: tuple[str, ...]) -> None:
        """Compute where columns `names` are in the file, so that reads need no mapping, then `release` it. Done
        once, by the writer thread for the shards it writes and at load for the others."""
        if self._layout is None:
            layout = _layout(self.table(), names, self._span)
            self._layout = None if layout is None else (names, layout)
        self.release()

    def release(self) -> None:
        """Drop this process's resident pages of the mapped file (see `release_pages`), and, for an owned file read
        with `pread`, the mapping itself (~30 KB of Arrow objects)."""
        release_pages(self._span)
        if self.owned and self._layout is not None:
            self._table = self._span = None

    def read(self, names: tuple[str, ...], rows: Sequence[int]) -> list[dict]:
        """Columns `names` of `rows`, as Python objects."""
        fd = self._open_file() if self._layout is not None and self._layout[0] == names else None
        if fd is None:
            table = self.table().select(list(names))
            out = [table.slice(row, 1).to_pylist()[0] for row in rows]  # a `take` would join the open shard's chunks
            self.release()
            return out
        try:
            return _pread_rows(fd, self._layout[1], rows)
        finally:
            os.close(fd)

    def _open_file(self) -> int | None:
        """A descriptor of `path`, or None once `path` is gone or not the mapped file (a loaded folder deleted)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) == self._inode:
            return fd
        os.close(fd)
        return None

    def save_into(self, folder: str) -> tuple[int, str]:
        """Make this shard a file of `folder`: a hard link from its own file or a copy a save made, whichever shares
        the folder's file system, else a copy. Returns the file's (size, xxh3-64): known from when it was written or
        verified, else computed now (once: a shard file never changes)."""
        dest = os.path.join(folder, self.name)
        if not os.path.exists(dest):
            try:
                link_or_copy([self.path, *self.copies], dest)
            except FileNotFoundError:  # a loaded file whose folders are all gone: written again from its mapping
                write_atomic(dest, lambda tmp: write_arrow(tmp, self.table()))
                if self.digest is not None and (os.path.getsize(dest), file_checksum(dest)) != self.digest:
                    os.remove(dest)
                    raise RuntimeError(
                        f"Shard {self.name}: no copy of its file is left, and its rows written again are other bytes "
                        "than the pool recorded. Save the pool while a folder it was loaded or saved to still holds it."
                    ) from None
        if self.digest is None:
            self.digest = (os.path.getsize(dest), file_checksum(dest))
        self.copies = [dest, *(copy for copy in self.copies if copy != dest)][:2]
        return self.digest


# `array` typecodes of the Arrow types read back (`_pread_rows` converts with `array`, which is faster than numpy for
# small reads); strings are decoded as UTF-8.
_TYPECODES = {pa.int8(): "b", pa.int32(): "i", pa.int64(): "q", pa.float32(): "f"}


def _layout(table: pa.Table, names: tuple[str, ...], span: tuple[int, int]) -> list | None:
    """Per column of `names`: (name, offsets, byte offset of the values in the file, item size, typecode); a scalar
    column is kept whole in RAM (offsets holds its values, byte offset -1). None when the file is not one record
    batch of lists, strings and non-null scalars inside the mapping `span`: it is then read through the mapping."""
    if any(column.num_chunks != 1 for column in table.columns):
        return None
    base, size = span
    layout, shared = [], {}
    for name in names:
        chunk = table.column(name).chunks[0]
        if pa.types.is_list(chunk.type):
            child, raw = chunk.values, chunk.offsets.to_numpy().tobytes()
            code = _TYPECODES.get(child.type)
            if code is None or child.null_count:
                return None
            data, itemsize = child.buffers()[1], child.type.bit_width // 8
            start = data.address - base + child.offset * itemsize
        elif pa.types.is_string(chunk.type):
            data, itemsize, code = chunk.buffers()[2], 1, None
            start = data.address - base
            raw = np.frombuffer(chunk.buffers()[1], np.int32)[chunk.offset : chunk.offset + len(chunk) + 1].tobytes()
        elif chunk.type in _TYPECODES and chunk.null_count == 0:
            layout.append((name, array.array(_TYPECODES[chunk.type], chunk.to_numpy().tobytes()), -1, 0, None))
            continue
        else:
            return None
        if not (0 <= start and data.address + data.size <= base + size):
            return None  # not inside the mapping (a copy)
        offsets = shared.setdefault(raw, array.array("i", raw))  # compact, fast to index; shared by equal columns
        layout.append((name, offsets, start, itemsize, code))
    return layout


def _pread_rows(fd: int, layout: list, rows: Sequence[int]) -> list[dict]:
    """Columns of `rows` read from the file `fd` at the offsets of `layout`, one `pread` per row and list column."""
    out = []
    pread = os.pread
    for row in rows:
        values = {}
        for name, offsets, start, itemsize, code in layout:
            if start < 0:
                values[name] = offsets[row]
                continue
            first = offsets[row]
            data = pread(fd, (offsets[row + 1] - first) * itemsize, start + first * itemsize)
            values[name] = data.decode() if code is None else array.array(code, data).tolist()
        out.append(values)
    return out


class ShardLog:
    """Rows addressed by integer keys, stored in shards of a scratch folder, written by a `Writer`.

    A row goes through three places: pending (the caller's Python objects, held until `stage_rows` rows or
    `stage_size` units are pending), the open shard (converted by the writer thread into compact Arrow columns in
    RAM) and a shard file (the open shard, written and memory-mapped once it holds `shard_rows` rows or
    `shard_bytes` bytes, or when a save seals it). So RAM holds at most a few small batches of Python objects and one
    open shard, while shard files stay large (few files per million rows).

    Args:
        kind: folder name of these shards in a saved pool.
        prefix: shard file name prefix.
        schema: Arrow schema of a row.
        build: ``items -> RecordBatch`` of the given schema; runs on the writer thread.
        writer, scratch: the pool's `Writer` and `Scratch`.
        shard_rows, shard_bytes: size of a shard file.
        stage_rows, stage_size: when pending rows are handed to the writer (`append`'s `size` adds up to the latter).
        compact_dead_fraction: a shard is rewritten once this fraction of its rows are tombstones.
        read_columns: the columns rows are read back with: their layout is prepared when a shard is written.
    """

    def __init__(
        self,
        kind: str,
        prefix: str,
        schema: pa.Schema,
        build: Callable[[list], pa.RecordBatch],
        writer: Writer,
        scratch: Scratch,
        shard_rows: int = 1024,
        shard_bytes: int = 16 << 20,
        stage_rows: int = 64,
        stage_size: int = 1 << 16,
        compact_dead_fraction: float = 0.5,
        read_columns: tuple[str, ...] = (),
    ):
        self.kind = kind
        self.read_columns = read_columns or tuple(schema.names)
        self.prefix = prefix
        self.schema = schema
        self._build = build
        self._writer = writer
        self._scratch = scratch
        self.shard_rows = shard_rows
        self.shard_bytes = shard_bytes
        self.stage_rows = min(stage_rows, shard_rows)
        self.stage_size = stage_size
        self.compact_dead_fraction = compact_dead_fraction
        self._lock = threading.Lock()  # the writer thread publishes locations while the caller reads them
        self._loc = np.empty(0, np.int64)
        self._gen = np.empty(0, np.int32)  # bumped on delete: a row written for an old use of a key is not its row
        self._size = 0
        self._free: list[int] = []  # freed keys, reused last freed first
        self._pending: dict[int, object] = {}
        self._unflushed: list[tuple[int, int]] = []  # (key, generation) in append order
        self._unflushed_size = 0
        self.shards: dict[int, Shard] = {}
        self._open: Shard | None = None  # (writer thread) the shard receiving rows, in RAM
        self._next_sid = 0
        self._files_written = 0  # the number in the next shard file's name
        self._last_append = 0.0
        # Compaction looks only at what changed (a pool has thousands of shards): shards that lost rows, small ones.
        self._dirty: set[int] = set()
        self._small: set[int] = set()

    # ---------------------------------------------------------------------------------------------- keys
    def _new_keys(self, count: int) -> np.ndarray:
        """`count` keys never used before (the freed ones are reused one at a time, by `_new_key`)."""
        if self._size + count > len(self._loc):
            grown = max(1024, 2 * len(self._loc), self._size + count)
            self._loc = grow(self._loc, grown, None)  # entries past _size are set when first used
            self._gen = grow(self._gen, grown, None)
        keys = np.arange(self._size, self._size + count, dtype=np.int64)
        self._gen[keys] = 0
        self._size += count
        return keys

    def _new_key(self) -> int:
        return self._free.pop() if self._free else int(self._new_keys(1)[0])

    def _release_key(self, key: int) -> None:
        self._gen[key] += 1
        self._loc[key] = FREE
        self._free.append(int(key))

    def append(self, item, size: int = 1) -> int:
        """Buffer a row; returns its key. Hands the buffer to the writer thread when it is big enough."""
        self._last_append = time.monotonic()
        with self._lock:
            key = self._new_key()
            self._loc[key] = PENDING
            self._pending[key] = item
            self._unflushed.append((key, int(self._gen[key])))
            self._unflushed_size += size
            full = len(self._unflushed) >= self.stage_rows or self._unflushed_size >= self.stage_size
        if full:
            self._flush(seal=False, check=False)  # never raises here: an outcome is never half recorded
        return key

    def delete(self, key: int) -> None:
        """Free `key`: drop its row from the buffer, or leave a tombstone in its shard (compaction removes it)."""
        with self._lock:
            loc = int(self._loc[key])
            if loc == PENDING:
                self._pending.pop(key, None)  # a row being staged meanwhile is found dead there (`_stage`)
            elif loc >= 0:
                self._tombstone(loc)
            else:
                raise KeyError(f"{self.kind}: key {key} is not in use.")
            self._release_key(key)

    def _tombstone(self, loc: int) -> None:
        """(Lock held.) The row at `loc` is dead."""
        shard = self.shards[loc >> _ROW_BITS]
        shard.live -= 1
        shard.dead.add(loc & _ROW_MASK)
        self._dirty.add(shard.sid)

    def read(self, keys: Sequence[int], names: tuple[str, ...]) -> list:
        """For each of `keys`: its pending item, or the columns `names` of its row as a dict. Under the log's lock,
        so that no shard file goes away (a compaction) while it is read."""
        out: list = [None] * len(keys)
        with self._lock:
            by_shard: dict[int, list[tuple[int, int]]] = {}
            for i, key in enumerate(keys):
                loc = int(self._loc[key])
                if loc == PENDING:
                    out[i] = self._pending[key]
                elif loc < 0:
                    raise KeyError(f"{self.kind}: key {key} is not in use.")
                else:
                    by_shard.setdefault(loc >> _ROW_BITS, []).append((i, loc & _ROW_MASK))
            for sid, wanted in by_shard.items():
                for (i, _), row in zip(wanted, self.shards[sid].read(names, [row for _, row in wanted])):
                    out[i] = row
        return out

    def locations(self, keys: np.ndarray) -> np.ndarray:
        with self._lock:
            return self._loc[keys]

    # ------------------------------------------------------------------------------------------ flush
    def flush(self, seal: bool = False, wait: bool = False) -> None:
        """Hand the pending rows to the writer thread; `seal` also writes the open shard to its file (a save needs
        every row in a file); `wait` blocks until done. Then maybe start a compaction. Raises the error of a failed
        background job (its rows are still pending, and retried)."""
        self._flush(seal, check=True)
        if wait:
            self._writer.wait()

    def _flush(self, seal: bool, check: bool) -> None:
        """Hand the writer thread one job: stage the pending rows, seal if asked, then maybe compact."""
        if check:
            self._writer.raise_error()
        with self._lock:
            batch = [(k, g, self._pending[k]) for k, g in self._unflushed if self._gen[k] == g and k in self._pending]
            self._unflushed, self._unflushed_size = [], 0
        try:
            self._writer.submit(lambda: self._write_step(batch, seal), check)
        except BaseException:
            with self._lock:
                self._unflushed[:0] = [(k, g) for k, g, _ in batch]
            raise

    def _write_step(self, batch: list, seal: bool) -> None:
        """Writer thread: one flush's work, in order."""
        if batch:
            self._stage(batch)
        if seal:
            self._seal()
        self._maybe_compact()

    def _new_sid(self) -> int:
        with self._lock:
            sid = self._next_sid
            self._next_sid += 1
        return sid

    def _stage(self, batch: list) -> None:
        """Writer thread: convert `batch` into Arrow columns and add them to the open shard."""
        # Converting Python lists holds the GIL: while the caller is in a burst of appends (the trainer recording a
        # step's outcomes), wait for the burst to end (3 ms without an append; 0.5 s at most, and a caller whose
        # appends fill the queue blocks, which ends its burst).
        deadline = time.monotonic() + _MAX_DEFER
        while time.monotonic() < deadline and time.monotonic() - self._last_append < _BURST_GAP:
            time.sleep(_BURST_GAP)
        try:
            record_batch = self._build([item for _, _, item in batch])
        except BaseException:
            with self._lock:  # still pending: retried by the next flush
                self._unflushed[:0] = [(k, g) for k, g, _ in batch]
            raise
        if self._open is None:
            sid, chunks = self._new_sid(), []
        else:
            sid, chunks = self._open.sid, self._open.table().to_batches()
        # A new object for the grown shard: a reader holding the previous one keeps a consistent view. Its file's name
        # comes with its bytes, when it is sealed.
        grown = Shard(sid, f"{self.prefix}-{sid:06d}-open", sum(len(c) for c in chunks) + len(batch))
        grown._table = pa.Table.from_batches([*chunks, record_batch], schema=self.schema)
        grown.nbytes = (self._open.nbytes if self._open is not None else 0) + record_batch.nbytes
        first = grown.rows - len(batch)
        with self._lock:
            grown.live = (self._open.live if self._open is not None else 0) + len(batch)
            grown.dead = self._open.dead if self._open is not None else set()
            self.shards[sid] = self._open = grown
            for row, (key, gen, _) in enumerate(batch, start=first):
                if self._gen[key] == gen and self._loc[key] == PENDING:
                    self._loc[key] = (sid << _ROW_BITS) | row
                    self._pending.pop(key, None)
                else:  # deleted since it was handed over
                    self._tombstone((sid << _ROW_BITS) | row)
        if grown.rows >= self.shard_rows or grown.nbytes >= self.shard_bytes:
            self._seal()

    def _write_shard(self, sid: int, rows: int, table: pa.Table) -> Shard:
        """Writer thread: the file of shard `sid`, named by its place in the order of this log's files and by its
        checksum, returned as a `Shard` read from that file."""
        data = arrow_bytes(table)
        checksum = bytes_checksum(data)
        name = f"{self.prefix}-{self._files_written:06d}-{checksum[:12]}.arrow"
        self._files_written += 1
        path = os.path.join(self._scratch.folder(self.kind), name)
        write_atomic(path, lambda tmp: write_buffer(tmp, data))
        shard = Shard(sid, name, rows, path, owned=True)
        shard.digest = (data.size, checksum)
        shard.prepare(self.read_columns)
        return shard

    def _seal(self) -> None:
        """Writer thread: write the open shard to its file and read it from there from now on."""
        shard = self._open
        if shard is None:
            return
        with self._lock:
            if not shard.live:  # every row deleted while it was open: no file
                self._open = None
                self.shards.pop(shard.sid, None)
                return
        table = shard.table().combine_chunks()  # one record batch per file: the fast path of row reads
        sealed = self._write_shard(shard.sid, shard.rows, table)
        with self._lock:  # deletes meanwhile left their tombstones in `shard`
            sealed.live, sealed.dead = shard.live, shard.dead
            self._open = None
            self.shards[shard.sid] = sealed
            self._note_size(sealed)
            if sealed.live < sealed.rows:  # rows deleted while it was open: weigh it for compaction
                self._dirty.add(sealed.sid)

    # ------------------------------------------------------------------------------------------ compaction
    def _note_size(self, shard: Shard) -> None:
        """(Lock held.)"""
        if shard.rows < max(1, self.shard_rows // 4):
            self._small.add(shard.sid)

    def _drop_empty(self, sids=None) -> None:
        """(Lock held.) Forget written shards without live rows (among `sids`, default: those that lost rows);
        their scratch files go, saved copies stay."""
        for sid in list(self._dirty if sids is None else sids):
            shard = self.shards.get(sid)
            if shard is None or (shard.live == 0 and shard is not self._open):
                self._dirty.discard(sid)
                self._small.discard(sid)
            if shard is None or shard.live or shard is self._open:
                continue
            del self.shards[sid]
            if shard.owned and os.path.exists(shard.path):
                os.remove(shard.path)

    def _maybe_compact(self, everything: bool = False) -> None:
        """Writer thread: rewrite the shards that are mostly tombstones (`everything`: all that hold one), and merge
        small ones."""
        with self._lock:
            self._drop_empty(list(self.shards) if everything else None)
            seen = list(self.shards) if everything else self._dirty
            keep = 1.0 if everything else 1.0 - self.compact_dead_fraction
            victims = [self.shards[sid] for sid in seen if sid in self.shards]
            victims = [s for s in victims if not s.is_open and s.live < s.rows and s.live <= s.rows * keep]
            self._dirty.clear()  # the others are looked at again when they lose more rows
            small = [self.shards[sid] for sid in self._small if sid in self.shards]
            if len(small) >= 4:  # many small shards (frequent saves seal them early): merge them
                victims += [s for s in small if s not in victims]
        if victims:
            self._compact(victims)

    def compact(self, wait: bool = True) -> None:
        """Rewrite every written shard holding tombstones, and merge small ones, now; the index moves to the new shards
        when done."""
        self.flush(seal=True)
        self._writer.submit(lambda: self._maybe_compact(everything=True))
        if wait:
            self._writer.wait()

    def _compact(self, victims: list[Shard]) -> None:
        """Writer thread: rewrite the live rows of `victims` into new shards, then move their keys there; a row whose
        key is deleted meanwhile is a tombstone of its new shard."""
        with self._lock:
            old = np.asarray(
                [
                    (victim.sid << _ROW_BITS) | row
                    for victim in sorted(victims, key=lambda v: v.sid)  # by shard, then row: the order is kept
                    for row in range(victim.rows)
                    if row not in victim.dead
                ],
                dtype=np.int64,
            )
            # the keys that may live in the victims: one pass over the index, not one per new shard
            candidates = np.nonzero(np.isin(self._loc[: self._size] >> _ROW_BITS, [v.sid for v in victims]))[0]
        tables = {victim.sid: victim.table() for victim in victims}
        for start in range(0, len(old), self.shard_rows):
            part = old[start : start + self.shard_rows]
            sources = part >> _ROW_BITS
            pieces = [tables[int(s)].take(pa.array(part[sources == s] & _ROW_MASK)) for s in np.unique(sources)]
            sid = self._new_sid()
            shard = self._write_shard(sid, len(part), pa.concat_tables(pieces).combine_chunks())
            with self._lock:  # a key leaves the victims only by a delete (no other thread moves keys): check again
                keys = candidates[np.isin(self._loc[candidates], part)]
                at = np.searchsorted(part, self._loc[keys])  # `part` is sorted
                self._loc[keys] = (sid << _ROW_BITS) | at
                shard.live, shard.dead = len(at), set(range(len(part))) - set(at.tolist())
                self.shards[sid] = shard
                self._note_size(shard)
                if shard.dead:
                    self._dirty.add(sid)
                for source, count in zip(*np.unique(part[at] >> _ROW_BITS, return_counts=True)):
                    self.shards[int(source)].live -= int(count)  # the dead ones were counted by their delete
        with self._lock:
            self._drop_empty([victim.sid for victim in victims])
        for victim in victims:
            victim.release()

    # ------------------------------------------------------------------------------------------ persistence
    def save_into(self, folder: str) -> list[dict]:
        """(Everything sealed.) Put every shard with live rows into `folder`; returns their manifest entries."""
        if self._pending or self._open is not None:
            raise RuntimeError(f"{self.kind}: rows are not written yet; flush(seal=True, wait=True) first.")
        os.makedirs(folder, exist_ok=True)
        with self._lock:
            shards = sorted((s for s in self.shards.values() if s.live > 0), key=lambda s: s.sid)
        entries = [{"name": s.name, "rows": s.rows, "live": s.live, "sid": s.sid} for s in shards]
        for entry, shard in zip(entries, shards):
            entry["digest"] = shard.save_into(folder)
        return entries

    def keep(self, shard: Shard) -> None:
        """Give a loaded shard a hard link in the scratch folder, so that it outlives the folder it was loaded from
        (a checkpoint that TRL rotates away) without staying mapped; on another file system it stays mapped. Then
        prepare its reads."""
        dest = os.path.join(self._scratch.folder(self.kind), shard.name)
        try:
            os.link(os.path.realpath(shard.path), dest)  # link(2) would link a symlink (the Hub cache's) itself
        except OSError:
            dest = None
        if dest is not None:
            info = os.lstat(dest)  # the link itself: it must be the mapped file, not a symlink to it
            if (info.st_dev, info.st_ino) == shard._inode:
                shard.path, shard.owned = dest, True
            else:
                os.remove(dest)
        shard.prepare(self.read_columns)

    def adopt(self, shard: Shard, rows: np.ndarray) -> np.ndarray:
        """Register a loaded shard whose `rows` are live; returns their new keys (in the order of `rows`)."""
        with self._lock:
            shard.sid = self._next_sid
            self._next_sid += 1
            self.shards[shard.sid] = shard
            keys = self._new_keys(len(rows))
            self._loc[keys] = (shard.sid << _ROW_BITS) | rows.astype(np.int64)
            shard.live = len(rows)
            shard.dead = set(range(shard.rows)) - set(rows.tolist())
            number = shard.name.split("-")[1] if shard.name.count("-") >= 2 else ""
            if number.isdigit():  # new files are numbered after the loaded ones: their names never meet
                self._files_written = max(self._files_written, int(number) + 1)
            self._note_size(shard)
            if shard.live < shard.rows:
                self._dirty.add(shard.sid)
        return keys

    def key_state(self) -> tuple[int, list[int]]:
        """(keys ever handed out, the freed ones in the order they are reused): what an `IndexOnlyLog` needs to hand
        out the same keys as this log."""
        with self._lock:
            return self._size, list(self._free)

    def stats(self) -> dict[str, int]:
        with self._lock:
            written = [s for s in self.shards.values() if not s.is_open]
            open_rows = self._open.rows if self._open is not None else 0
            return {
                "shards": len(written),
                "rows": sum(s.rows for s in written),
                "dead_rows": sum(s.rows - s.live for s in written),
                "open_rows": open_rows,
                "pending_rows": len(self._pending),
            }


class IndexOnlyLog(ShardLog):
    """The keys of a `ShardLog` whose rows another process holds: handed out and freed exactly as that log does
    (the same keys for the same appends and deletes), with no row stored, written or readable here."""

    def __init__(self, kind: str, size: int, free: Sequence[int]):
        self.kind, self.shards, self._lock = kind, {}, threading.Lock()
        self._size, self._free = size, list(free)
        self._loc = np.full(max(size, 1024), FREE, np.int64)
        self._gen = np.zeros(len(self._loc), np.int32)

    def append(self, item, size: int = 1) -> int:
        with self._lock:
            key = self._new_key()
            self._loc[key] = PENDING
        return key

    def delete(self, key: int) -> None:
        with self._lock:
            self._release_key(key)

    def flush(self, seal: bool = False, wait: bool = False) -> None:
        pass

    def compact(self, wait: bool = True) -> None:
        pass

    def read(self, *args, **kwargs):
        raise RuntimeError(
            f"{self.kind}: this pool holds its index only; its rows are read where they are held (rank 0 of a run)."
        )

    locations = save_into = read  # every other access to the rows

    def stats(self) -> dict[str, int]:
        return {}


def column_or_none(table: pa.Table | pa.RecordBatch, name: str):
    return table.column(name) if name in table.schema.names else None


def invalid_rows(table: pa.Table, rows: np.ndarray, required: Sequence[str], same_length: Sequence[str]) -> np.ndarray:
    """Which of `rows` are bad: beyond the table, a null in a `required` column (or inside a list of one), or lists
    of unequal length among `same_length`. Reads only offsets and validity bitmaps (no row data)."""
    bad = rows >= table.num_rows
    rows = np.where(bad, 0, rows)
    if table.num_rows == 0:
        return np.ones(len(rows), bool)
    for name in required:
        column = column_or_none(table, name)
        if column is None:
            return np.ones(len(rows), bool)
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
