"""The offline experience provider: records made in this process from successful trajectories, kept in an
`ExperienceStore` and retrieved by BM25. No model and no service: the default summary is the won episode's actions
as text; an environment can give its own (`summarize_fn`, e.g. a hook that states the plan in its own words).

Every process holds its own store (`shared = False`): each summarises the same trajectories and the trainer adds the
records at the same step on every process, so every process retrieves alike.

Example:

```python
from trl_exreplay.guidance import SummaryInput
from trl_exreplay.guidance.offline import OfflineExperienceProvider

provider = OfflineExperienceProvider()
won = SummaryInput("t1:9f2c", "t1", "put a mug in the sink", ["go to  table 1", "take mug 1", "go to sink 1",
                   "put mug 1 in sink 1"], reward=1.0, step=3)
records = provider.summarize([won])  # pure: the store is unchanged until `add`
assert records[0].content == ("A successful attempt at this task took these actions: go to table 1; take mug 1; "
                              "go to sink 1; put mug 1 in sink 1")
assert provider.retrieve("put a mug in the sink", k=2) == []
provider.add(records)  # what the trainer does at a step boundary
assert provider.retrieve("put a clean mug in the sink", k=2) == [records[0].content]
```
"""

from __future__ import annotations

from collections.abc import Callable

from .provider import ExperienceRecord, SummaryInput
from .store import ExperienceStore

__all__ = ["OfflineExperienceProvider", "default_summary"]

ATTEMPT = "A successful attempt at this task took these actions: "
ANSWER = "A successful answer to this task was: "


def default_summary(trajectory: SummaryInput, max_actions: int = 30) -> str | None:
    """The won episode as text: its first `max_actions` actions, whitespace collapsed, joined by "; " (with
    "; ... (N more)" when there were more); a single action (a single-turn completion) as the answer, stripped but
    with its line breaks kept (code or a derivation keeps its layout). None when no action holds any text."""
    if len(trajectory.actions) == 1:
        answer = trajectory.actions[0].strip()
        return ANSWER + answer if answer else None
    actions = [" ".join(action.split()) for action in trajectory.actions]
    actions = [action for action in actions if action]  # an empty turn says nothing
    if not actions:
        return None
    text = ATTEMPT + "; ".join(actions[:max_actions])
    if len(actions) > max_actions:
        text += f"; ... ({len(actions) - max_actions} more)"
    return text


class OfflineExperienceProvider:
    """An `ExperienceProvider` whose records live in this process (an `ExperienceStore`, BM25 retrieval).

    `summarize` makes one `ExperienceRecord` per trajectory: its content is `summarize_fn(trajectory)` when given
    (None or "" declines: no record), else `default_summary(trajectory, max_actions)`; its query, source, task id and
    step are the trajectory's. `summarize` changes nothing (it runs in a background thread); `add` does.
    """

    shared = False

    def __init__(
        self,
        store: ExperienceStore | None = None,
        summarize_fn: Callable[[SummaryInput], str | None] | None = None,
        max_actions: int = 30,
    ):
        if not isinstance(max_actions, int) or isinstance(max_actions, bool) or max_actions < 1:
            raise ValueError(f"max_actions must be an integer >= 1, got {max_actions!r}.")
        self.store = store if store is not None else ExperienceStore()
        self.summarize_fn = summarize_fn
        self.max_actions = max_actions

    def summarize(self, trajectories: list[SummaryInput]) -> list[ExperienceRecord]:
        records = []
        for trajectory in trajectories:
            if self.summarize_fn is not None:
                content = self.summarize_fn(trajectory)
                if content is not None and not isinstance(content, str):
                    raise TypeError(f"summarize_fn must return a str or None, got {type(content).__name__}.")
            else:
                content = default_summary(trajectory, self.max_actions)
            if not content:  # the hook declined, or there was nothing to say
                continue
            records.append(
                ExperienceRecord(
                    task_id=trajectory.task_id,
                    query=trajectory.query,
                    content=content,
                    source=trajectory.source,
                    step=trajectory.step,
                )
            )
        return records

    def retrieve(self, task: str, k: int) -> list[str]:
        return self.store.retrieve(task, k)

    def add(self, records: list[ExperienceRecord]) -> None:
        self.store.add(records)

    def records(self) -> list[ExperienceRecord]:
        return self.store.records()

    def __len__(self) -> int:
        return len(self.store)
