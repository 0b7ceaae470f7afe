"""Summarisation off the training step: successful rollouts wait in a backlog; every `guidance_update_freq` steps
the backlog goes to the provider's `summarize` in a background thread (one job at a time); the records it returns
are collected at a later step boundary, when the job is done (`collect` never waits).

Nothing is lost to a failure or a kill: a job's inputs stay `pending()` until its records are collected (a checkpoint
saves them and a resumed run summarises them again), and a failed job's inputs go back to the backlog, counted in
`failures`. The backlog is bounded (`max_backlog`, oldest dropped first, counted): a provider that always fails
cannot grow it without bound.

Example:

```python
from trl_exreplay.guidance import SummaryInput
from trl_exreplay.guidance.offline import OfflineExperienceProvider
from trl_exreplay.guidance.summarizer import BackgroundSummarizer

summarizer = BackgroundSummarizer(OfflineExperienceProvider())
summarizer.offer([SummaryInput("a:1", "a", "open the door", ["open door"], 1.0, step=0)])
summarizer.submit()
summarizer.wait()
records = summarizer.collect()
assert [r.source for r in records] == ["a:1"] and summarizer.pending() == []
summarizer.close()
```
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait

from .provider import ExperienceProvider, ExperienceRecord, PartialSummaryError, SummaryInput

logger = logging.getLogger(__name__)


class BackgroundSummarizer:
    """The backlog of successful rollouts and the one summarisation job in flight for an `ExperienceProvider`."""

    def __init__(self, provider: ExperienceProvider, max_backlog: int = 4096):
        self.provider = provider
        self.max_backlog = max_backlog
        self.backlog: list[SummaryInput] = []
        self.failures = 0  # jobs whose `summarize` raised (their inputs were offered again)
        self.dropped = 0  # inputs dropped from a full backlog, oldest first
        self.summarized = 0  # inputs whose records were collected
        self._job: Future | None = None
        self._job_inputs: list[SummaryInput] = []

    def offer(self, inputs: list[SummaryInput]) -> None:
        """Add successful rollouts to the backlog."""
        self.backlog.extend(inputs)
        self._bound()

    def _bound(self) -> None:
        excess = len(self.backlog) - self.max_backlog
        if excess > 0:
            self.dropped += excess
            del self.backlog[:excess]
            logger.warning("trl_exreplay: the summariser's backlog is full; %d oldest rollouts dropped.", excess)

    def submit(self) -> bool:
        """Hand the backlog to the provider in the background, unless a job is in flight or there is nothing to do."""
        if self._job is not None or not self.backlog:
            return False
        self._job_inputs, self.backlog = self.backlog, []
        self._job = _run_in_daemon_thread(self.provider.summarize, list(self._job_inputs))
        return True

    def done(self) -> bool:
        """Whether there is no job in flight, or it has finished (records to collect)."""
        return self._job is None or self._job.done()

    def wait(self, timeout: float | None = None) -> bool:
        if self._job is not None:
            wait([self._job], timeout=timeout)
        return self.done()

    def collect(self) -> list[ExperienceRecord]:
        """The records of a finished job ([] while it runs, or when none ran). A failed job's inputs return to the
        backlog, counted."""
        if self._job is None or not self._job.done():
            return []
        job, inputs = self._job, self._job_inputs
        self._job, self._job_inputs = None, []
        error = job.exception()
        if isinstance(error, PartialSummaryError):  # keep what was summarised; offer only the rest again
            self.failures += 1
            message = "trl_exreplay: experience summarisation failed in part (%r); the rest is offered again."
            logger.warning(message, error.cause)
            self.backlog = error.failed + self.backlog
            self._bound()
            self.summarized += len(inputs) - len(error.failed)
            return error.records
        if error is not None:
            self.failures += 1
            message = "trl_exreplay: experience summarisation failed (%r); its rollouts are offered again."
            logger.warning(message, error)
            self.backlog = inputs + self.backlog
            self._bound()
            return []
        records = job.result()
        if not isinstance(records, list) or not all(isinstance(r, ExperienceRecord) for r in records):
            self.failures += 1
            logger.warning("trl_exreplay: the experience provider's summarize returned no list of ExperienceRecord.")
            return []
        self.summarized += len(inputs)
        return records

    def pending(self) -> list[SummaryInput]:
        """Rollouts not summarised yet: the job in flight's, then the backlog's (what a checkpoint saves)."""
        return list(self._job_inputs) + list(self.backlog)

    def restore(self, pending: list[SummaryInput]) -> None:
        """Take the rollouts a checkpoint saved as pending (a resumed run summarises them at its next update)."""
        self.backlog = []
        self.offer(pending)

    def close(self, wait_for_job: bool = False) -> None:
        """Wait for the job in flight when `wait_for_job` (it can still be collected either way). Without waiting, a
        job that never returns (a stuck service) is left to its daemon thread: it never holds the process at exit."""
        if wait_for_job:
            self.wait()


def _run_in_daemon_thread(function, *args) -> Future:
    """`function(*args)` in a daemon thread, as a Future. Not an executor: the interpreter joins an executor's threads
    at exit, so one stuck request would keep a finished run's process alive for ever."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args))
        except BaseException as error:  # noqa: BLE001 - handed to `collect`, which counts it
            future.set_exception(error)

    threading.Thread(target=run, name="exreplay-summarizer", daemon=True).start()
    return future
