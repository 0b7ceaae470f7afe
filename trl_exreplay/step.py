"""What one training step of `ExReplayGRPOTrainer` carries between the TRL hooks it runs through.

TRL's `_generate_and_score_completions` calls, in turn, generation (`_generate_single_turn`, or a `rollout_func`),
the reward functions (`_calculate_rewards`) and the old-log-probs forward (`_get_per_token_logps_and_entropies`).
The trainer overrides each to replay; what they share is one `GenerationStep`, made before TRL's method runs and
dropped after it. What outlives the step, the outcomes waiting for the loss forward's log-probs and entropies before
they enter the pool, is one `PendingOutcomes`. In the loss, TRL's policy forward is kept in one `LossForward`.

Example:

```python
from trl_exreplay.planner import ReplayPlan
from trl_exreplay.step import GenerationStep

step = GenerationStep(rows=[{"prompt": "hi"}], plan=ReplayPlan(4, 1, {0: "t"}), replayed_local={})
assert step.take_replay() == {} and step.take_replay() is None  # generation takes the replayed rows once
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .planner import ReplayPlan


@dataclass
class GenerationStep:
    """One generation batch in the making (this rank's view of it)."""

    rows: list[dict]  # the dataset rows the rollouts are made from (a replayed group's task row substituted)
    plan: ReplayPlan | None = None  # None: nothing is replayed in this step (evaluation, replay off)
    selected: dict[str, list[Any]] = field(default_factory=dict)  # replayed task -> its chosen trajectories
    replayed_local: dict[int, Any] = field(default_factory=dict)  # this rank's replayed rows -> their trajectory
    fresh_per_rank: list[int] = field(default_factory=list)  # rows each rank generates
    wants_entropies: bool = False  # TRL runs its old-log-probs forward: keep its entropies (the generating policy's)
    entropies: Any = None  # those entropies, (rows, tokens)
    rewards: Any = None  # rewards per function, the replayed rows' being their recorded ones
    faulted_rows: set[int] = field(default_factory=set)  # this rank's rows whose episode the environment failed
    _replay_taken: bool = False

    def take_replay(self) -> dict[int, Any] | None:
        """The replayed rows for generation, once (a later generation call in the same step generates normally).
        Every rank takes them when any rank replays, even with none of its own, so their calls stay aligned."""
        if self._replay_taken or self.plan is None or not self.plan.replay_groups:
            return None
        self._replay_taken = True
        return self.replayed_local


@dataclass
class PendingOutcomes:
    """A step's task outcomes and this rank's successful fresh rows, kept until the loss forward has given the rows
    their log-probs and entropies (no extra forward), then recorded in the pool at the next generation step."""

    outcomes: list[tuple]  # (task id, successes, fresh rollouts, winning global rows)
    records: dict[int, dict]  # global row -> the trajectory's fields
    offset: int  # this rank's first global row


@dataclass
class LossForward:
    """TRL's loss forward in progress: the batch TRL's `_compute_loss` was given, and the log-probs (with grad) and
    entropies its one policy forward returned, kept for the replayed tokens' term and the pool's records."""

    inputs: dict
    logps: Any = None
    entropies: Any = None
