"""What one training step of `ExReplayGRPOTrainer` carries between the TRL hooks it runs through.

TRL's `_generate_and_score_completions` calls, in turn, generation (`_generate_single_turn`, or a `rollout_func`),
the reward functions (`_calculate_rewards`) and the old-log-probs forward (`_get_per_token_logps_and_entropies`).
The trainer overrides each to replay; what they share is one `GenerationStep`, made before TRL's method runs and
dropped after it (what outlives it, the outcomes waiting for the pool, is `trl_exreplay.outcomes.PendingOutcomes`).
In the loss, TRL's policy forward is kept in one `LossForward`.

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

import torch

from .planner import ReplayPlan
from .trl_seam import completion_token_fills


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
    tool_loop_lockstep: bool = False  # inside TRL's tool loop, each generation call is agreed on by every rank
    offset: int = 0  # this rank's first global row
    seed: list[int] = field(default_factory=list)  # the step's draws are seeded by this (run seed, step, micro-step)
    task_rows: list[dict] = field(default_factory=list)  # this rank's dataset rows as stored (before prompt rewriting)
    row_tasks: list[Any] = field(default_factory=list)  # each global row's task id (what the pool records it under)
    rescued: dict[int, Any] = field(default_factory=dict)  # global rows of all-fail groups -> the stored success
    rescued_local: dict[int, Any] = field(default_factory=dict)  # this rank's rescued rows -> their trajectory
    revisited: set[int] = field(default_factory=set)  # groups of retired tasks let through as revisits
    faulted_global: list[bool] | None = None  # every rank's rows the environment failed, once gathered
    _replay_taken: bool = False

    def put_recorded_rewards(self, rewards_per_func: torch.Tensor, compare: bool = True) -> dict[str, int]:
        """Give the replayed rows (global rows of `rewards_per_func`, rows x reward functions) their recorded rewards,
        in place; count those that differ from the recomputed ones (`compare`) and those recorded for another set of
        reward functions (left as recomputed)."""
        counts = {"reward_mismatch": 0, "reward_arity_mismatch": 0}
        plan = self.plan
        first_replayed = plan.num_generations - plan.num_replayed
        for group, task_id in plan.replay_groups.items():
            for j, trajectory in enumerate(self.selected[task_id]):
                row = group * plan.num_generations + first_replayed + j
                recorded = torch.tensor(trajectory.rewards, dtype=rewards_per_func.dtype)
                if recorded.numel() != rewards_per_func.size(1):
                    counts["reward_arity_mismatch"] += 1
                    continue
                recorded = recorded.to(rewards_per_func.device)
                if compare and not torch.allclose(rewards_per_func[row], recorded, equal_nan=True, atol=1e-4):
                    counts["reward_mismatch"] += 1
                rewards_per_func[row] = recorded
        return counts

    def take_replay(self) -> dict[int, Any] | None:
        """The replayed rows for generation, once (a later generation call in the same step generates normally).
        Every rank takes them when any rank replays, even with none of its own, so their calls stay aligned."""
        if self._replay_taken or self.plan is None or not self.plan.replay_groups:
            return None
        self._replay_taken = True
        return self.replayed_local


@dataclass
class LossForward:
    """TRL's loss forward in progress: the batch TRL's `_compute_loss` was given, and the log-probs (with grad) and
    entropies its one policy forward returned, kept for the replayed tokens' term and the pool's records."""

    inputs: dict
    logps: Any = None
    entropies: Any = None
    entropy_mask: Any = None  # the tokens TRL's `top_entropy_quantile` selection kept (None: no selection)


def splice_rescued(output: dict, rescued_local: dict[int, Any], pad_token_id: int) -> None:
    """Put each rescued row's stored trajectory into TRL's generation `output` (in place), in place of the failed
    rollout TRL generated and scored: its prompt and completion tokens, masks (`tool_mask` from the stored model-token
    mask), and its recorded log-probs as the old and sampling ones; TRL's tensors of one value per completion token
    (`trl_seam.completion_token_fills`) are widened where a stored sequence is longer. Then `attach_replay_tensors`
    marks the rows as replayed (advantage 0 in TRL's loss, the off-policy term on their recorded log-probs), as a
    replay group's rows."""
    if not rescued_local:
        return
    prompt_width = max([output["prompt_ids"].size(1), *(len(t.prompt_ids) for t in rescued_local.values())])
    width = max([output["completion_ids"].size(1), *(len(t.completion_ids) for t in rescued_local.values())])
    fills = completion_token_fills(output, pad_token_id)  # TRL's tensors of one value per completion token
    _widen(output, "prompt_ids", prompt_width, pad_token_id, left=True)
    _widen(output, "prompt_mask", prompt_width, 0, left=True)
    for key, fill in fills.items():
        _widen(output, key, width, fill)
    device = output["completion_ids"].device
    for i, trajectory in rescued_local.items():
        p, n = len(trajectory.prompt_ids), len(trajectory.completion_ids)
        output["prompt_ids"][i] = pad_token_id
        output["prompt_ids"][i, prompt_width - p :] = torch.tensor(trajectory.prompt_ids, device=device)
        output["prompt_mask"][i] = 0
        output["prompt_mask"][i, prompt_width - p :] = 1
        output["completion_ids"][i] = pad_token_id
        output["completion_ids"][i, :n] = torch.tensor(trajectory.completion_ids, device=device)
        output["completion_mask"][i] = 0
        output["completion_mask"][i, :n] = 1
        if "tool_mask" in output:
            output["tool_mask"][i] = 1
            output["tool_mask"][i, :n] = torch.tensor(trajectory.completion_mask, device=device)
        for key in ("old_per_token_logps", "sampling_per_token_logps"):
            if key in output:
                output[key][i] = 0.0
                output[key][i, :n] = torch.tensor(trajectory.logps, dtype=output[key].dtype, device=device)


def _widen(output: dict, key: str, width: int, fill, left: bool = False) -> None:
    """`output[key]` (rows x tokens) padded with `fill` to `width` tokens (on the left for prompts)."""
    tensor = output.get(key)
    if tensor is None or tensor.size(1) >= width:
        return
    pad = tensor.new_full((tensor.size(0), width - tensor.size(1)), fill)
    output[key] = torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def attach_replay_tensors(output: dict, replayed_local: dict[int, Any], replaying: bool) -> None:
    """Add to TRL's generation `output` what the loss needs to tell replayed rows apart: `exp_mask` (the replayed
    model tokens), `recorded_per_token_logps` (their behaviour log-probs), `exreplay_row` (each row's index, which
    survives TRL's shuffling into micro-batches), `exreplay_replayed` (per row) and `exreplay_replaying` (whether the
    generation batch replays); and a replayed row's `tool_mask` from its stored model-token mask."""
    completion_ids = output["completion_ids"]
    batch, length = completion_ids.shape
    device = completion_ids.device
    # One value for the whole generation batch, on every rank (the plan is global), so that every micro-batch of every
    # rank takes the same loss path (TRL's loss alone, or with the replayed term and its collective metrics).
    output["exreplay_replaying"] = torch.full((batch,), int(replaying), dtype=torch.long, device=device)
    exp_mask = torch.zeros(batch, length, dtype=torch.long, device=device)
    recorded = torch.zeros(batch, length, dtype=torch.float32, device=device)
    for i, trajectory in replayed_local.items():
        n = min(len(trajectory.completion_ids), length)
        exp_mask[i, :n] = torch.tensor(trajectory.completion_mask[:n], device=device)
        recorded[i, :n] = torch.tensor(trajectory.logps[:n], device=device)
    output["exp_mask"] = exp_mask * output["completion_mask"]
    output["recorded_per_token_logps"] = recorded
    output["exreplay_row"] = torch.arange(batch, device=device)
    replayed = torch.zeros(batch, dtype=torch.long, device=device)
    replayed[sorted(replayed_local)] = 1
    output["exreplay_replayed"] = replayed  # per row: TRL's loss must give it advantage 0, whatever its mask
    environment_tokens = exp_mask[replayed.bool()] == 0
    if "tool_mask" not in output and bool(
        (environment_tokens & output["completion_mask"][replayed.bool()].bool()).any()
    ):
        # A stored episode with environment tokens (a pool from a multi-turn or tool run) replayed in a single-turn
        # run: its environment tokens stay out of TRL's loss, its KL, entropy and normalisers, as where it was made.
        output["tool_mask"] = torch.ones_like(output["completion_mask"])
    if "tool_mask" in output:
        for i in replayed_local:
            output["tool_mask"][i] = exp_mask[i] | (1 - output["completion_mask"][i])
    if "importance_sampling_ratio" in output and replayed_local:
        # The vLLM sampler correction does not apply to replayed rows: their ratio is taken against the recorded
        # behaviour log-probs in the loss.
        rows = torch.tensor(sorted(replayed_local), device=device)
        output["importance_sampling_ratio"][rows] = 1.0
