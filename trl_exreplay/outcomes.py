"""What a generation step tells the pool: each task's outcome over its fresh rollouts, and the successful rollouts
as trajectories, recorded once TRL's loss forward has given them log-probs and entropies (no extra forward).

`task_outcomes` is a pure function of the gathered batch; `PendingOutcomes` holds this rank's records between the
generation step and the loss forward; `trajectory_records` reads them from TRL's generation output.

A task's difficulty is counted per group of G rollouts: a task drawn into two groups of one batch (a dataset that
repeats its tasks, a small dataset, `steps_per_generation` spanning an epoch) gives two outcomes of at most G, one
per group in batch order, never one of 2G, which would put it in a bucket above G and keep the pool's bound
``successes < rbound`` from ever storing it.

Example:

```python
from trl_exreplay.outcomes import task_outcomes

# two groups of 2: task "a" then task "b"; task -> successes, rollouts counted, winning rows, per group
outcomes = task_outcomes(["a", "a", "b", "b"], fresh_rows=[0, 1, 2], success=[True, False, True, True], group_size=2)
assert outcomes == [("a", 1, 2, [0]), ("b", 1, 1, [2])]
# row 3 replayed, counted as ExGRPO counts a replayed task: 2 successes of 2 for "b", its fresh success alone wins
assert task_outcomes(["a", "a", "b", "b"], [0, 1, 2], [True, False, True, True], 2, replayed_rows=[3])[1] == (
    "b", 2, 2, [2]
)
# one task in both groups: two outcomes of 2, not one of 4
assert task_outcomes(["a"] * 4, [0, 1, 2, 3], [True] * 4, group_size=2) == [("a", 2, 2, [0, 1]), ("a", 2, 2, [2, 3])]
```
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .pool import TaskOutcome, Trajectory


def task_outcomes(
    row_tasks: list[str], fresh_rows: list[int], success: list[bool], group_size: int, replayed_rows: list[int] = ()
) -> list[tuple[str, int, int, list[int]]]:
    """One outcome per group of `group_size` consecutive rows that counts any row, in batch order: (task, successes,
    rollouts counted, winning global rows). Fresh rows count and win; `replayed_rows` (ExGRPO's bucket of a replayed
    task, ``(s + k) / G``) count in the successes and rollouts but never win: they are in the pool already."""
    groups: dict[int, list] = {}
    replayed = set(replayed_rows)
    for row in sorted({*fresh_rows, *replayed}):
        outcome = groups.setdefault(row // group_size, [row_tasks[row], 0, 0, []])
        outcome[2] += 1
        if success[row]:
            outcome[1] += 1
            if row not in replayed:
                outcome[3].append(row)
    return [tuple(outcome) for _, outcome in sorted(groups.items())]


def zero_spread_share(totals: torch.Tensor, fresh_rows: list[int], group_size: int) -> float:
    """The share of the groups with a row in `fresh_rows` (not empty) whose rows there have equal total rewards: the
    groups that teach nothing by those rows alone (`replay/zero_std_rescued` gives it the rescued rows' stored
    rewards). A group with one such row has no spread."""
    groups: dict[int, list[float]] = {}
    for row, total in zip(fresh_rows, totals[fresh_rows].tolist()):
        groups.setdefault(row // group_size, []).append(total)
    return sum(max(values) - min(values) <= 1e-6 for values in groups.values()) / len(groups)


def trajectory_records(
    output: dict,
    rows: list[int],
    *,
    task_rows: list[dict],
    row_tasks: list[str],
    rewards_per_func: torch.Tensor,
    totals: torch.Tensor,
    entropies: torch.Tensor | None,
    offset: int,
    policy_version: int,
    count: Callable[[str, str], None],
) -> dict[int, dict]:
    """The fields of a `Trajectory` for each of this rank's local `rows` of TRL's generation `output`, keyed by
    global row. Log-probs are TRL's old log-probs when it computed them; otherwise (and entropies, when `entropies`
    is None) the loss forward fills them (`PendingOutcomes.capture`). A row with no trainable token is left out."""
    old = output.get("old_per_token_logps")
    model_mask = output["completion_mask"] * output.get("tool_mask", 1)
    records = {}
    for i in rows:
        n = int(output["completion_mask"][i].sum())
        if int(model_mask[i, :n].sum()) == 0:
            continue  # nothing trainable (e.g. a truncated completion masked by mask_truncated_completions)
        try:
            task_row = json.dumps(task_rows[i], sort_keys=True)
        except (TypeError, ValueError):
            task_row = None
            count("unserializable_task_rows", "a dataset row is not JSON-serializable, so it cannot replay")
        records[offset + i] = {
            "task_id": row_tasks[offset + i],
            "prompt_ids": output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist(),
            "completion_ids": output["completion_ids"][i, :n].tolist(),
            "completion_mask": model_mask[i, :n].tolist(),
            "logps": None if old is None else (old[i, :n] * model_mask[i, :n]).tolist(),
            "entropy": None if entropies is None else masked_mean(entropies[i, :n], model_mask[i, :n]),
            "rewards": rewards_per_func[offset + i].tolist(),
            "reward": float(totals[offset + i]),
            "policy_version": policy_version,
            "task_row": task_row,
        }
    return records


@dataclass
class PendingOutcomes:
    """A step's task outcomes and this rank's successful fresh rows, kept until the loss forward has given the rows
    their log-probs and entropies, then recorded in the pool at the next generation step."""

    outcomes: list[tuple]  # (task id, successes, fresh rollouts, winning global rows)
    records: dict[int, dict]  # global row -> the trajectory's fields
    offset: int  # this rank's first global row

    def capture(self, rows: list[int], per_token_logps: torch.Tensor, entropies: torch.Tensor, mask) -> None:
        """Fill the records of local `rows` (the loss batch's rows, in order) from the loss forward's outputs."""
        entropies = entropies.detach()
        for j, local_row in enumerate(rows):
            record = self.records.get(self.offset + local_row)
            if record is None or record["entropy"] is not None:
                continue
            n = len(record["completion_ids"])
            row_mask = mask[j, :n].float()
            record["entropy"] = masked_mean(entropies[j, :n], row_mask)
            if record["logps"] is None:
                record["logps"] = (per_token_logps[j, :n].detach().float() * row_mask).tolist()

    def captured(self) -> tuple[list[tuple[int, dict]], int]:
        """The records ready to store, and how many rows the loss never saw (they cannot be stored)."""
        ready = [(row, record) for row, record in self.records.items() if record["entropy"] is not None]
        return ready, len(self.records) - len(ready)

    def task_outcomes(self, records: dict[int, dict]) -> list[TaskOutcome]:
        """The pool's outcomes, given every rank's captured `records` (global row -> fields)."""
        result = []
        for task_id, successes, num_fresh, winners in self.outcomes:
            trajectories, task_row = [], None
            for row in winners:
                if row not in records:
                    continue
                record = dict(records[row])
                task_row = record.pop("task_row") or task_row
                trajectories.append(Trajectory(**record))
            result.append(TaskOutcome(task_id, successes, num_fresh, trajectories, task_row))
        return result


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.to(values.dtype)
    return float((values * mask).sum() / mask.sum().clamp(min=1))
