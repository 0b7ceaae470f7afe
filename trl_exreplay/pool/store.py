"""Where a live pool's rows are: Arrow files in a scratch folder, read back through `datasets`.

RAM holds only the index (`index.PoolIndex`): the rows go to Arrow IPC stream files of `shard_rows` rows, the format
`datasets` memory-maps (`Dataset.from_file`, which also reads the features written in the schema's metadata). A file
never changes once written, so a checkpoint shares it with the live pool through a hard link (`persistence.py`).

`Log`: the rows of one schema under the integer keys the index hands out. A row waits as a one-row table until
`shard_rows` of them are written as one file, on the calling thread. A deleted row stays in its file until compaction
rewrites the files that hold more dead rows than live ones, and merges small files (after each write, and before a
save): the files stay within about twice the live rows.

Example:

```python
import pyarrow as pa
from trl_exreplay.pool.store import Log, Scratch

schema = pa.schema([("text", pa.string())])
log = Log("notes", schema, Scratch(), shard_rows=2)
for key, text in enumerate(["a", "b", "c"]):
    log.put(key, pa.table({"text": [text]}, schema=schema))
    log.write(if_full=True)  # "a" and "b" fill one file; "c" waits
assert log.read([2, 0], ("text",)) == [{"text": "c"}, {"text": "a"}] and len(log.shards) == 1
```
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import datasets
import numpy as np
import pyarrow as pa

from .check import CHECKSUM, PoolFormatError, check_arrow, compressed, file_checksum
from .index import grow

__all__ = [
    "Log",
    "Scratch",
    "Shard",
    "TRAJECTORY_FEATURES",
    "TRAJECTORY_SCHEMA",
    "fsync_path",
    "read_arrow",
    "write_arrow",
    "write_atomic",
    "write_json_atomic",
]

TRAJECTORY_FEATURES = datasets.Features(
    {
        "task_id": datasets.Value("string"),
        "prompt_ids": datasets.List(datasets.Value("int32")),
        "completion_ids": datasets.List(datasets.Value("int32")),
        "completion_mask": datasets.List(datasets.Value("int8")),
        "logps": datasets.List(datasets.Value("float32")),
        "rewards": datasets.List(datasets.Value("float32")),
        "reward": datasets.Value("float32"),
        "entropy": datasets.Value("float32"),
        "policy_version": datasets.Value("int64"),
        "traj_id": datasets.Value("int64"),
    }
)
# The features in the schema's metadata, as `datasets` writes them: `load_dataset` and the Hub viewer read them back.
TRAJECTORY_SCHEMA = TRAJECTORY_FEATURES.arrow_schema
_PENDING, _FREE = -1, -2  # `Log.where` of a key whose row waits to be written, and of a key that holds no row


def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)`, then fsync and rename to `path`: `path` appears complete or not at all, and a failure leaves
    neither a half-written `path` nor the temporary. `write` may write a file or a folder (a saved model) at `tmp`; a
    folder's files are fsynced with it, and `path` must then not be a folder already (no rename replaces a non-empty
    one).

    The package's one atomic writer (the pool is a library of its own, so it lives here and the rest imports it). The
    temporary is hidden, beside `path` (a rename within one filesystem), and never taken for a pool's file; a pool's
    next save (`persistence._prune`) removes those a killed process left."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        write(tmp)
        if os.path.isdir(tmp):
            for root, _, names in os.walk(tmp):
                for name in names:
                    fsync_path(os.path.join(root, name))
                fsync_path(root)  # the names in it
        else:
            fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.remove(tmp)
        raise


def write_json_atomic(path: str, data: dict) -> None:
    """`data` as JSON at `path`, through `write_atomic`."""

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(data, f)

    write_atomic(path, write)


def write_arrow(path: str, table: pa.Table) -> None:
    """`table` as an Arrow IPC stream file, the format `datasets.Dataset.from_file` memory-maps."""
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def read_arrow(path: str) -> pa.Table:
    """The table of an Arrow IPC stream file, read into memory: a load checks a file this way before it maps it, so
    that its checks leave no page of the file counted in the process's resident memory. Refused: a message other than
    a record batch, and compressed buffers, before they are decompressed (a pool writes neither; the file's size,
    checked against the state, then bounds what the table holds)."""
    with pa.OSFile(path) as source:
        data = source.read_buffer()
    messages = list(pa.ipc.MessageReader.open_stream(data))  # slices of `data`: nothing is decoded yet
    if not messages or messages[0].type != "schema":
        raise PoolFormatError(path, "is not an Arrow stream: it does not start with a schema.")
    schema = pa.ipc.read_schema(messages[0])
    batches = []
    for message in messages[1:]:
        if message.type != "record batch" or compressed(message.metadata):
            raise PoolFormatError(
                path,
                f"holds a {message.type} message that is compressed or not a record batch; "
                "the pool writes uncompressed record batches only.",
            )
        batches.append(pa.ipc.read_record_batch(message, schema))
    return pa.Table.from_batches(batches, schema)


@dataclass(eq=False)
class Shard:
    """One Arrow file of a log, memory-mapped by `datasets`; `live` counts its rows that a key still holds.

    Never edit a saved pool's files in place (truncate, or `cp` over them): a live pool maps the same files, through
    the hard links that make saves cheap, and a truncated mapping is a bus error. Replace a file instead (a new file,
    then a rename): the live pool keeps the one it mapped.
    """

    name: str
    path: str
    rows: int
    dataset: datasets.Dataset  # formatted as Arrow tables
    inode: tuple[int, int]  # of the mapped file: `path` may later name another file
    live: int = 0
    digests: dict = field(default_factory=dict)  # inode -> (size, xxh3-64) of a copy (the same bytes, or rewritten)
    saved_copy: tuple[str, tuple[int, int]] | None = None  # (path, inode) of its file in the last save's folder

    @classmethod
    def open(cls, name: str, path: str, schema: pa.Schema, rows: int | None = None) -> Shard:
        """Map the file at `path`, refused (`PoolFormatError`) unless its schema is `schema` (and it has `rows` rows).
        Its data is not read: a file from a saved folder is checked before (`persistence.load_index`), and the log
        writes the others."""
        inode = _inode(path)
        try:
            dataset = datasets.Dataset.from_file(path).with_format("arrow")
        except Exception as e:  # noqa: BLE001 - a damaged file can fail in pyarrow or in `datasets`' metadata
            raise PoolFormatError(path, f"is not an Arrow file of the pool ({type(e).__name__}: {e}).") from None
        check_arrow(dataset.data.table, schema, path, full=False)
        if _inode(path) != inode or (rows is not None and dataset.num_rows != rows):
            raise PoolFormatError(path, "changed while it was loaded.")
        return cls(name, path, dataset.num_rows, dataset, inode)

    def table(self, rows: Sequence[int] | None = None) -> pa.Table:
        return self.dataset[:] if rows is None else self.dataset[list(rows)]

    def save_into(self, folder: str) -> tuple[int, str]:
        """Make this shard a file of `folder`: a hard link to its own file, or to its copy in the last save's folder
        (on the checkpoints' file system when the scratch folder is not), when one is still the file it was; else the
        mapped rows written again. Returns the file's (size, xxh3-64), computed once per file."""
        dest = os.path.join(folder, self.name)
        if not os.path.exists(dest):
            copies = [(self.path, self.inode), self.saved_copy]
            if not any(copy and _link(*copy, dest) for copy in copies):
                write_atomic(dest, lambda tmp: write_arrow(tmp, self.table()))
        inode = _inode(dest)
        if inode not in self.digests:
            self.digests[inode] = (os.path.getsize(dest), file_checksum(dest))
        self.saved_copy = (dest, inode)
        return self.digests[inode]


def _link(source: str, inode: tuple[int, int], dest: str) -> bool:
    """Hard-link `source` to `dest` if it is still the file of `inode`; False where it cannot (gone, replaced, another
    file system)."""
    try:
        if _inode(source) != inode:
            return False
        os.link(source, dest)
        return True
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            return False
        raise


def _inode(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


@dataclass
class Log:
    """Rows of one Arrow `schema` under integer keys (see the module docstring). A row is given as a one-row table
    (compact Arrow columns, not Python lists, while it waits)."""

    kind: str
    schema: pa.Schema
    scratch: Scratch
    shard_rows: int = 1024
    shards: dict[int, Shard] = field(default_factory=dict)  # by shard number, in the order they were written
    where: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # key -> shard << 32 | row
    pending: dict[int, pa.Table] = field(default_factory=dict)
    next_shard: int = 0

    def _grow(self, size: int) -> None:
        if size > len(self.where):
            self.where = grow(self.where, max(1024, 2 * len(self.where), size), _FREE)

    def put(self, key: int, row: pa.Table) -> None:
        self._grow(key + 1)
        self.where[key] = _PENDING
        self.pending[key] = row

    def delete(self, key: int) -> None:
        at = int(self.where[key])
        if at == _PENDING:
            del self.pending[key]
        else:
            self.shards[at >> 32].live -= 1
        self.where[key] = _FREE

    def read(self, keys: Sequence[int], names: tuple[str, ...]) -> list[dict]:
        """Columns `names` of each key's row, as a dict of Python values (one read a shard)."""
        out: list = [
            self.pending[key].select(list(names)).to_pylist()[0] if key in self.pending else None for key in keys
        ]
        at = self.where[np.asarray(keys, np.int64)]
        written = np.nonzero(at >= 0)[0]
        for shard in np.unique(at[written] >> 32).tolist():
            mine = written[(at[written] >> 32) == shard]
            rows = self.shards[shard].table((at[mine] & 0xFFFFFFFF).tolist()).select(list(names)).to_pylist()
            for i, row in zip(mine.tolist(), rows):
                out[i] = row
        return out

    def add_shard(self, shard: Shard, keys: np.ndarray, rows: np.ndarray) -> None:
        """Give `keys` the rows `rows` of `shard`, a new shard of this log."""
        number = self.next_shard
        self.next_shard += 1
        self.shards[number] = shard
        if len(keys):
            self._grow(int(keys.max()) + 1)
            moved = self.where[keys]  # rows a compaction rewrites leave their old shards
            for old, count in zip(*np.unique(moved[moved >= 0] >> 32, return_counts=True)):
                self.shards[int(old)].live -= int(count)
            self.where[keys] = (number << 32) | rows.astype(np.int64)
        shard.live = len(keys)

    def _new_shard(self, table: pa.Table, keys: np.ndarray) -> None:
        name = f"{self.kind}-{uuid.uuid4().hex[:16]}.arrow"
        path = os.path.join(self.scratch.folder(), name)
        try:
            write_arrow(path, table.combine_chunks())  # one record batch (a compaction's rows come one a chunk)
            shard = Shard.open(name, path, self.schema)
        except BaseException:
            if os.path.exists(path):
                os.remove(path)  # a full disk must not leave a partial file a retry
            raise
        self.add_shard(shard, keys, np.arange(len(keys)))

    def write(self, if_full: bool = False) -> None:
        """Write the pending rows as one shard, then compact (see the module docstring); with `if_full`, only once
        `shard_rows` rows wait. If it fails (a full disk), the rows stay pending and the next write tries again."""
        if if_full and len(self.pending) < self.shard_rows:
            return
        if self.pending:
            keys = np.fromiter(self.pending, np.int64, len(self.pending))
            self._new_shard(pa.concat_tables(self.pending.values()), keys)
            self.pending = {}
        self.compact(everything=False)

    def compact(self, everything: bool = True) -> None:
        """Rewrite the live rows of the shards that hold dead ones (`everything`), or of those with more dead than live
        rows and of the small ones (a save writes what is pending, however few rows) once there are 4, then drop their
        files. The live rows keep their order; a failed write leaves each row in the shard it was in."""
        small = [n for n, s in self.shards.items() if s.rows < self.shard_rows // 4]
        victims = [n for n, s in self.shards.items() if s.live < s.rows and (everything or 2 * s.live < s.rows)]
        victims = sorted(set(victims) | set(small if len(small) >= 4 else []))
        if not victims:
            return
        at = self.where
        keys = np.nonzero(np.isin(at >> 32, victims) & (at >= 0))[0]
        keys = keys[np.argsort(at[keys], kind="stable")]  # by shard, then row
        table = pa.concat_tables(
            [self.shards[n].table((at[keys[(at[keys] >> 32) == n]] & 0xFFFFFFFF).tolist()) for n in victims]
        )
        for start in range(0, len(keys), self.shard_rows):
            self._new_shard(table.slice(start, self.shard_rows), keys[start : start + self.shard_rows])
        for number in victims:
            shard = self.shards.pop(number)
            if self.scratch.path is not None and shard.path.startswith(self.scratch.path + os.sep):
                os.remove(shard.path)  # the mapping stays readable; saved copies keep their links

    def save_into(self, folder: str) -> list[dict]:
        """Write what is pending, compact, and put every shard that holds a live row in `folder`; returns their entries
        in a saved state (name, rows, live rows, size, checksum)."""
        self.write()
        entries = []
        for shard in self.shards.values():
            if shard.live:
                size, checksum = shard.save_into(folder)
                entries.append(
                    {"name": shard.name, "rows": shard.rows, "live": shard.live, "size": size, CHECKSUM: checksum}
                )
        return entries

    def adopt(self, shard: Shard) -> None:
        """Give a loaded shard a hard link in the scratch folder, so that it outlives the folder it came from (a
        checkpoint TRL rotates away); on another file system it stays mapped, and a save writes it from the mapping."""
        dest = os.path.join(self.scratch.folder(), shard.name)
        try:
            os.link(os.path.realpath(shard.path), dest)  # link(2) would link a symlink (the Hub cache's) itself
        except OSError:
            return
        if _inode(dest) == shard.inode:
            shard.path = dest
        else:
            os.remove(dest)

    def stats(self) -> dict[str, int]:
        rows = sum(s.rows for s in self.shards.values())
        live = sum(s.live for s in self.shards.values())
        return {"shards": len(self.shards), "rows": rows, "dead_rows": rows - live, "pending_rows": len(self.pending)}


class Scratch:
    """The folder where a live pool writes its shards (a new one under `parent`, made on first use), deleted with the
    pool. Put it on the disk of the checkpoints (saves then hard-link instead of copying), never on a tmpfs. A killed
    process leaves it behind: the trainer empties its own folder of them when it starts (`keeper.PoolKeeper`)."""

    PREFIX = "exreplay-pool-"

    def __init__(self, parent: str | None = None):
        self.parent = parent or tempfile.gettempdir()
        self.path: str | None = None
        self._made_parent = False  # then removed with the pool's folder, when no other pool (rank) uses it

    def folder(self) -> str:
        if self.path is None:
            if not os.path.isdir(self.parent):
                os.makedirs(self.parent, exist_ok=True)
                self._made_parent = True
            self.path = tempfile.mkdtemp(prefix=self.PREFIX, dir=self.parent)
        return self.path

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
            if self._made_parent:
                try:
                    os.rmdir(self.parent)  # only if empty
                except OSError:
                    pass
