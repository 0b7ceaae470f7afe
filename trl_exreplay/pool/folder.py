"""A saved pool's folder and the live pool's scratch folder: files that appear complete or not at all.

* Atomic files: `write_atomic` writes a file under a hidden temporary name, fsyncs it and renames it into place;
  `fsync_path` makes a file's bytes or a folder's names durable. `trl_exreplay.guidance.store` saves with them too.
* The folder of a saved pool, and its atomic commit: ``state.json`` is replaced last, with `os.replace`; every file
  it names was complete and fsynced before. Files it does not name are pruned after the commit. A process killed at
  any instant leaves the previous ``state.json`` and all its files::

      state.json                     the committed snapshot: settings, counters, shard lists, its tasks table,
                                     every file's size and xxh3-64 checksum, and its own checksum
      tasks/<snapshot>-<id>.arrow    per-task state of a snapshot (difficulty, skip set, where its rows are)
      trajectories/traj-*.arrow      trajectory shards, one row per trajectory (`datasets` features)
      task_rows/rows-*.arrow         task row shards (task id, the dataset row as JSON)

* `Scratch`: the folder where a live pool writes its shards, held by a file lock for as long as its process lives;
  the folders of killed processes are removed by the next pool that starts under the same parent
  (`remove_dead_scratch`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence

from .check import PoolFolder, PoolFormatError, parse_state

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 3: every file's size and xxh3-64 checksum recorded in state.json
STATE_FILE = "state.json"
TRAJECTORIES_DIR = "trajectories"
TASK_ROWS_DIR = "task_rows"
TASKS_DIR = "tasks"
MANAGED_DIRS = (TRAJECTORIES_DIR, TASK_ROWS_DIR, TASKS_DIR)
_MAX_STATE_BYTES = 64 << 20


# ------------------------------------------------------------------------------------------------------ file helpers
def fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes the names created in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(folder: str, name: str) -> str:
    # Hidden and unique: never taken for a pool file, removed by the next save of the folder.
    return os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` then fsync and rename to `path`: `path` appears complete or not at all."""
    tmp = tmp_name(os.path.dirname(path), os.path.basename(path))
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json_atomic(path: str, data: dict) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(data, f)

    write_atomic(path, write)


def link_or_copy(sources: Sequence[str], dest: str) -> None:
    """Give `dest` the content of `sources` (copies of one file, any of which may vanish meanwhile): a hard link from
    the first that shares its file system (no data written), else a copy of the first still there."""
    for source in sources:
        try:
            os.link(os.path.realpath(source), dest)  # link(2) would link a symlink (the Hub cache's) itself
            return
        except FileExistsError:
            return
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK, errno.EACCES):
                raise
    for source in sources:
        try:
            write_atomic(dest, lambda tmp, source=source: shutil.copyfile(source, tmp))
            return
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"No copy of {os.path.basename(dest)} is left (looked at {list(sources)}).")


class Scratch:
    """The folder where a live pool writes its new shards: created on first use, deleted with the pool.

    Put it on the disk that holds the checkpoints (same file system: saves hard-link instead of copying), never on a
    tmpfs (the shards would then sit in RAM).
    """

    PREFIX = "exreplay-pool-"
    LOCK = ".owner.lock"

    def __init__(self, parent: str | None = None):
        self.parent = parent
        self.path: str | None = None
        self._made_parent = False
        self._lock = threading.Lock()
        self._owner_fd: int | None = None

    def root(self) -> str:
        """The folder itself (made now if not yet)."""
        with self._lock:
            if self.path is None:
                parent = self.parent or tempfile.gettempdir()
                if not os.path.isdir(parent):
                    os.makedirs(parent, exist_ok=True)
                    self._made_parent = True
                remove_dead_scratch(parent)
                path = tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}-", dir=parent)
                self._owner_fd = _hold_lock(os.path.join(path, self.LOCK))
                self.path = path
            return self.path

    def folder(self, kind: str) -> str:
        folder = os.path.join(self.root(), kind)
        os.makedirs(folder, exist_ok=True)
        return folder

    def remove(self) -> None:
        with self._lock:
            if self.path is not None:
                shutil.rmtree(self.path, ignore_errors=True)
                self.path = None
                if self._owner_fd is not None:
                    os.close(self._owner_fd)
                    self._owner_fd = None
                if self._made_parent:
                    try:
                        os.rmdir(self.parent)  # only if empty: other pools (ranks) may share it
                    except OSError:
                        pass


def _hold_lock(path: str) -> int | None:
    """Create `path` and hold an exclusive lock on it for as long as this process (or a child it forks) lives: the
    kernel releases it when they are gone, even after kill -9. None where file locks are not supported."""
    try:
        import fcntl
    except ImportError:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` runs (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def remove_dead_scratch(parent: str) -> list[str]:
    """Remove the scratch folders under `parent` left by processes that no longer run (a kill -9 leaves its shards
    there); returns their paths. A folder is dead when its owner lock can be taken (no process holds it any more); a
    folder without a lock file (made before it had one, or an instant ago by a live process) only when its pid runs
    no process. A live run's folder is never touched."""
    try:
        import fcntl
    except ImportError:
        return []
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    for name in names:
        if not name.startswith(Scratch.PREFIX):
            continue
        pid_text = name[len(Scratch.PREFIX) :].split("-", 1)[0]
        path = os.path.join(parent, name)
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or os.path.islink(path) or not os.path.isdir(path):
            continue
        lock = os.path.join(path, Scratch.LOCK)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            if pid_alive(int(pid_text)):
                continue
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    continue  # held: its process runs
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    if removed:
        logger.info("trl_exreplay: removed %d scratch folder(s) of pool processes that no longer run.", len(removed))
    return removed


# ------------------------------------------------------------------------------------------------ saved folders
def read_state(path: str) -> dict:
    """The committed state of the pool saved at `path` (``state.json``), parsed and validated (`check.parse_state`)."""
    file = PoolFolder(path).file(STATE_FILE)
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
    """After a commit: delete every file of the managed folders that the committed state does not name, and the
    temporary files of interrupted saves. Only files no committed state names are removed, so a crash here leaves
    garbage, never a broken pool."""
    keep = {os.path.normpath(f) for f in state_files(read_state(path))}
    for folder in MANAGED_DIRS:
        full = os.path.join(path, folder)
        if not os.path.isdir(full):
            continue
        for name in os.listdir(full):
            if os.path.normpath(f"{folder}/{name}") in keep:
                continue
            target = os.path.join(full, name)
            if os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            else:
                try:
                    os.remove(target)
                except FileNotFoundError:
                    pass
    for name in os.listdir(path):
        if name.startswith(f".{STATE_FILE}.tmp-"):
            os.remove(os.path.join(path, name))
