"""`Writer`: the one background thread per pool that runs its storage jobs (shard writes, compactions) in order, so
that the training thread never waits on disk."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Writer:
    """One background thread that runs a pool's storage jobs in order (shard writes, compactions).

    `submit` blocks only when `max_queued` jobs are already waiting, which bounds the rows held in RAM. A job's
    exception is re-raised by the next `submit` or `wait` on the caller's thread, never lost.
    """

    def __init__(self, max_queued: int = 16):
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pid = os.getpid()

    def submit(self, job: Callable[[], None], check: bool = True) -> None:
        """Queue `job`; with `check`, first raise the error of an earlier job (else it waits for the next check)."""
        if check:
            self.raise_error()
        if self._pid != os.getpid():  # a forked child: the parent's thread and queue are not its own
            self._queue, self._thread, self._pid = queue.Queue(maxsize=self._queue.maxsize), None, os.getpid()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="exreplay-pool-writer", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def wait(self) -> None:
        """Block until every submitted job ran; raise the first error of one."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()
        self.raise_error()

    def raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"An experience pool storage job failed: {error!r}") from error

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
            self._queue.put(None)
            self._thread.join()
        self._thread = None

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                job()
            except BaseException as e:  # surfaced on the caller's thread by the next checked submit / wait
                logger.error(
                    "trl_exreplay: experience pool storage job failed (%r); its rows stay buffered and the "
                    "error is raised by the next save or flush.",
                    e,
                )
                self._error = self._error or e
            finally:
                self._queue.task_done()
