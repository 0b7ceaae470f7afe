"""When replay starts, and which questions stay in the fresh stream: ExGRPO's two run-level rules.

* **Start by capability** (``replay_start="solved"``): replay, and the pool's collection with it, start at the first
  generation batch whose fresh rollouts succeed more often than ``replay_start_solved_fraction`` (`starts_replay`),
  and stay on. The library's default rule (``"steps"``: at ``replay_start_ratio`` of the steps) needs no state.
* **Retired questions** (``replay_retire_solved``): a task in the skip set (every fresh rollout of it succeeded) is
  retired: a group whose task is retired takes another dataset row instead, drawn from the rows whose task is not
  (`redirect_retired_groups`), so no fresh rollout goes to a question that is already solved, and every batch keeps
  its size. A retired task is not sampled nor replayed again, so it does not leave the skip set: the retired set only
  grows, unless ``replay_revisit_ratio`` lets a share of its draws through (`revisited_groups`): a revisit that fails
  returns the task to the fresh stream. (ExGRPO drops skip-set questions from its data at each epoch, an epoch drawing
  each question once: a solved question is never drawn again. Here the rule acts from the next generation batch, so
  that it holds too where a dataset repeats its questions within one epoch, as the evidence harness's do.)

Both are decided on the gathered batch, identically on every rank, and depend on no data loader: the retired set is
read after the pool has taken the previous batch's outcomes, so a run resumed from a checkpoint (whose pool has them)
reads the same set as the run that was not stopped. The rows a resumed run draws are those of the run that was not
stopped too: `EpochSeededSampler` makes TRL's sampler draw epoch e's order from the epoch's number, not from how many
epochs this process has iterated (TRL's own sampler starts again from the first epoch's order on resume). What the
start rule needs to survive a resume (the step replay started at) is `ReplaySchedule`, saved beside the pool in every
checkpoint as `exreplay_schedule.json`; the retired set is the pool's skip set, saved with the pool.

Example:

```python
from trl_exreplay.schedule import redirect_retired_groups, starts_replay

assert starts_replay([True, False, True, False], fresh_rows=[0, 1, 2, 3], threshold=0.35)  # 0.5 > 0.35
# group 1's task "b" is retired: it takes dataset row 2 ("d"; rows 0 and 3 hold "a", a task the batch has already)
assert redirect_retired_groups(["a", "b"], {"b"}, ["a", "b", "d", "a"], seed=0) == {1: 2}
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from torch.utils.data import Sampler

from .trl_seam import rewind_repeat_sampler

SCHEDULE_FILE = "exreplay_schedule.json"


def starts_replay(success: Sequence[bool], fresh_rows: Sequence[int], threshold: float) -> bool:
    """ExGRPO's start: the batch's fresh rollouts succeed strictly more often than `threshold`."""
    return bool(fresh_rows) and sum(bool(success[r]) for r in fresh_rows) / len(fresh_rows) > threshold


def redirect_retired_groups(
    group_keys: Sequence[str],
    retired: Collection[str],
    dataset_keys: Sequence[str],
    seed: int | Sequence[int],
    attempts: int = 64,
) -> dict[int, int]:
    """For each group whose task is `retired`, the dataset row (an index into `dataset_keys`, each row's task) that
    replaces it: drawn uniformly among the rows whose task is neither retired nor in the batch, each row once; when
    too few are left, among the rows whose task is not retired, repeats allowed (a small dataset repeats a task rather
    than replay a retired one). Empty when no group is retired or every row's task is.

    The draw costs O(groups) while such rows are common: rows are drawn at random and the ones that do not qualify
    are drawn again (at most `attempts` draws a group); only a dataset almost all retired is scanned, so a step over a
    dataset of a million rows does not walk it."""
    groups = [g for g, key in enumerate(group_keys) if key in retired]
    if not groups or not dataset_keys:
        return {}
    rng = np.random.default_rng(seed)
    in_batch = set(group_keys)
    chosen: list[int] = []
    for _ in range(attempts * len(groups)):
        if len(chosen) == len(groups):
            break
        row = int(rng.integers(len(dataset_keys)))
        if row not in chosen and dataset_keys[row] not in retired and dataset_keys[row] not in in_batch:
            chosen.append(row)
    if len(chosen) < len(groups):  # few rows qualify: every one of them, in random order
        order = rng.permutation(len(dataset_keys)).tolist()
        chosen += [
            row
            for row in order
            if row not in chosen and dataset_keys[row] not in retired and dataset_keys[row] not in in_batch
        ][: len(groups) - len(chosen)]
    if len(chosen) < len(groups):  # fewer tasks left than retired groups: any row whose task is not retired
        active = [row for row, key in enumerate(dataset_keys) if key not in retired]
        if not active:
            return {}
        chosen += [active[int(i)] for i in rng.integers(len(active), size=len(groups) - len(chosen))]
    return dict(zip(groups, chosen))


def revisited_groups(group_keys: Sequence[str], retired: Collection[str], revisit_ratio: float, seed) -> list[int]:
    """The groups of retired tasks let through as revisits: each with probability `revisit_ratio`, drawn from `seed`
    (the same on every rank, and on a resumed run). A revisit every fresh rollout wins keeps its task retired; one
    that any fails takes the task out of the skip set, back into the fresh stream."""
    groups = [g for g, key in enumerate(group_keys) if key in retired]
    if not groups or revisit_ratio <= 0:
        return []
    draws = np.random.default_rng(seed).random(len(groups))
    return [g for g, u in zip(groups, draws.tolist()) if u < revisit_ratio]


class EpochSeededSampler(Sampler):
    """TRL's `RepeatSampler` (`inner`), its epoch e drawing TRL's e-th shuffle whatever came before.

    The Trainer calls `set_epoch(e)` before each epoch, resumed or not. A run that is not stopped draws exactly what
    `inner` draws alone (the e-th permutation of a generator seeded with the run's seed); a run resumed in epoch e
    draws the same, where `inner` would draw the first epoch's order again."""

    def __init__(self, inner):
        self.inner = inner
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        rewind_repeat_sampler(self.inner, self.epoch)
        return iter(self.inner)


@dataclass
class ReplaySchedule:
    """The run-level state of ExGRPO's start rule (see the module docstring)."""

    started_at: int | None = None  # the global step replay started at (replay_start="solved")

    def save(self, folder: str) -> None:
        """Write `exreplay_schedule.json` in `folder`, whole or not at all (`write_atomic`: no temporary left on
        failure)."""
        from .pool.store import write_json_atomic  # the package's one atomic writer

        write_json_atomic(os.path.join(folder, SCHEDULE_FILE), {"format_version": 1, **asdict(self)})

    @classmethod
    def load(cls, folder: str) -> ReplaySchedule:
        """Read `exreplay_schedule.json` from `folder` (a checkpoint); a checkpoint without one (saved by a run that
        used neither rule) gives the initial state. Raises `ValueError` naming the file and the field on bad
        content."""
        path = os.path.join(folder, SCHEDULE_FILE)
        if not os.path.isfile(path):
            return cls()
        if os.path.getsize(path) > 4096:
            raise ValueError(f"{path}: {os.path.getsize(path)} bytes; a replay schedule is a few dozen")
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(state, dict) or state.get("format_version") != 1:
            raise ValueError(f"{path}: expected a JSON object with format_version 1")
        values = {}
        for name in ("started_at",):
            value = state.get(name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{path}: `{name}` is {value!r}; allowed: null or an integer >= 0")
            values[name] = value
        return cls(**values)
