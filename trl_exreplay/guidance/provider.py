"""What an experience provider is: `retrieve(task, k)` the texts of at most `k` records relevant to a task, and
`summarize(trajectories)` records made from successful trajectories. The trainer calls `retrieve` while it builds
guided rollouts and `summarize` from a background thread (`summarizer.BackgroundSummarizer`).

Example:

```python
from trl_exreplay.guidance import ExperienceRecord, SummaryInput

trajectory = SummaryInput(source="t1:9f2c", task_id="t1", query="put a mug in the sink", actions=["go to sink 1"],
                          reward=1.0, step=3)
record = ExperienceRecord(task_id="t1", query=trajectory.query, content="go to sink 1", source=trajectory.source,
                          step=3)
assert record.as_dict()["content"] == "go to sink 1"
```
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SummaryInput:
    """One successful trajectory, as text, handed to `ExperienceProvider.summarize`."""

    source: str  # a stable key of the trajectory (task id and a hash of its tokens): summarised once
    task_id: str
    query: str  # the task as the policy saw it without guidance (the first user message): what retrieval matches
    actions: list[str]  # the model's turns, in order (one for a single-turn completion)
    reward: float
    step: int  # the training step that produced it
    observations: list[str] = field(default_factory=list)  # the environment's turns between them (multi-turn)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExperienceRecord:
    """One piece of experience: `content` is what a guided prompt receives; `query` is what retrieval matches."""

    task_id: str
    query: str
    content: str
    source: str  # the `SummaryInput.source` it was made from ("" when the provider does not say)
    step: int

    def as_dict(self) -> dict:
        return asdict(self)


class PartialSummaryError(RuntimeError):
    """Raised by `ExperienceProvider.summarize` when only part of the trajectories could be summarised (e.g. a service
    that took some requests and failed others): `records` are kept, and only `failed` is offered again, so that a
    service does not store the same experience twice."""

    def __init__(self, records: list[ExperienceRecord], failed: list[SummaryInput], cause: BaseException):
        super().__init__(f"{len(failed)} trajectories could not be summarised: {cause}")
        self.records, self.failed, self.cause = list(records), list(failed), cause


@runtime_checkable
class ExperienceProvider(Protocol):
    """Where experience comes from and goes to.

    * `retrieve(task, k)`: the contents of at most `k` records relevant to the task text `task`, best first (may be
      empty). Called on every process for its own guided rows; it must not block for long (it runs in the step).
    * `summarize(trajectories)`: records made from `SummaryInput`s. Called from a background thread, never in the
      step; an exception is counted (`guide/summarizer_failures`) and the trajectories are offered again at the next
      update (a `PartialSummaryError` keeps its records and offers only its failed trajectories again).
    * `add(records)`: make records retrievable. The trainer calls it at a step boundary, on every process alike, with
      what `summarize` returned (and, on resume, with the records saved in the checkpoint).
    * `records()`: the records this process holds, saved with every checkpoint (a service that keeps its own returns
      an empty list).
    * `shared`: True when the provider keeps its records elsewhere, shared by every process (a service): then only
      the main process summarises. False (an in-process store): every process summarises the same trajectories and
      adds the records at the same step, so every process retrieves alike.
    """

    shared: bool

    def retrieve(self, task: str, k: int) -> list[str]: ...

    def summarize(self, trajectories: list[SummaryInput]) -> list[ExperienceRecord]: ...

    def add(self, records: list[ExperienceRecord]) -> None: ...

    def records(self) -> list[ExperienceRecord]: ...
