"""The `replay/*` metrics, appended to TRL's metric lists (`GRPOTrainer._metrics[mode]`), which TRL averages and
logs with its own. The replayed tokens' figures are reduced over ranks (sums and extremes), so every rank logs the
same values; the generation ones are computed from the global replay plan and the rank-identical pool.

And TRL's own figures of a generation batch (`reward`, `reward_std`, per-function rewards, `frac_reward_zero_std`,
completion lengths), taken again over the fresh rows (`trl_reward_metrics`, `log_fresh_completions`): TRL takes them
over every row of the batch, stored ones included, and a curve of `reward` against a `GRPOTrainer` run then compares
the pool with the policy. The values TRL took, over the batch as trained, go to `replay/trained_reward` and
`replay/zero_std_trained`.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch

from .planner import ReplayPlan
from .trl_seam import nanstd

logger = logging.getLogger(__name__)

OFF_POLICY_SUMS = ("replayed_tokens", "loss_sum", "clipped_tokens", "ratio_sum", "logp_drift_sum")


def log_off_policy(metrics: dict[str, list], accelerator, m: dict[str, torch.Tensor]) -> None:
    """Log the replayed tokens' figures of `trl_exreplay.loss.off_policy_loss` over all ranks, with one gather.
    Collective: every rank calls it for the same micro-batches. Nothing is logged for a micro-batch without replayed
    tokens on any rank."""
    local = torch.stack([*(m[name] for name in OFF_POLICY_SUMS), m["ratio_min"], m["ratio_max"]]).float()
    ranks = accelerator.gather(local.to(accelerator.device).view(1, -1)).view(-1, local.numel())
    sums = dict(zip(OFF_POLICY_SUMS, ranks[:, : len(OFF_POLICY_SUMS)].sum(dim=0).tolist()))
    ratio_min, ratio_max = ranks[:, -2].min().item(), ranks[:, -1].max().item()
    tokens = sums["replayed_tokens"]
    if tokens > 0:
        metrics["replay/off_policy_loss"].append(sums["loss_sum"] / tokens)
        metrics["replay/off_clip_fraction"].append(sums["clipped_tokens"] / tokens)
        metrics["replay/importance_ratio_mean"].append(sums["ratio_sum"] / tokens)
        metrics["replay/logp_drift"].append(sums["logp_drift_sum"] / tokens)
        metrics["replay/importance_ratio_min"].append(ratio_min)
        metrics["replay/importance_ratio_max"].append(ratio_max)


def log_generation(
    metrics: dict[str, list],
    plan: ReplayPlan,
    total_rows: int,
    ages: list[int],
    pool_stats: dict[str, float],
    counts: Counter,
) -> None:
    """A generation step's replay figures: rows and tasks replayed, rows generated, the replayed trajectories' mean
    policy age (steps since they were sampled), the pool's statistics, and the running totals of counted faults."""
    replayed_rows = len(plan.replayed_rows())
    metrics["replay/rows_fraction"].append(replayed_rows / total_rows)
    metrics["replay/tasks"].append(float(plan.num_tasks))
    metrics["replay/generated_rows"].append(float(total_rows - replayed_rows))
    if ages:
        metrics["replay/policy_age"].append(float(np.mean(ages)))
    for name, value in pool_stats.items():
        metrics[f"replay/{name}"].append(value)
    for name, count in counts.items():
        metrics[f"replay/{name}"] = [float(count)]  # running totals


def trl_reward_metrics(
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    reward_func_names: list[str],
    num_generations: int,
    scale_rewards: str,
    aggregation: str,
) -> dict[str, float]:
    """The reward figures `GRPOTrainer._generate_and_score_completions` logs for a generation batch
    (`rewards/<name>/mean` and `/std`, `reward`, `reward_std`, `frac_reward_zero_std`), computed as TRL computes them
    from the gathered `rewards_per_func` (rows x reward functions; a row that is NaN for every function is one TRL
    counts as unscorable). To take them over some rows only, give the others NaN: each figure then leaves them out as
    TRL leaves out an unscorable row, and `frac_reward_zero_std` is, per group (TRL's `scale_rewards` "group" and
    "none"), whether the group's remaining rows all have the same reward. `tests/integration/test_fresh_metrics.py`
    holds this to TRL's own values over its options."""
    figures = {}
    for i, name in enumerate(reward_func_names):
        figures[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        figures[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    totals = (rewards_per_func * weights).nansum(dim=1)
    totals[unscorable] = torch.nan
    figures["reward"] = torch.nanmean(totals).item()
    figures["reward_std"] = nanstd(totals).item()
    G = num_generations
    if aggregation == "normalize_then_sum":  # each function normalized in its group, then summed: the sum's spread
        grouped = rewards_per_func.view(-1, G, rewards_per_func.size(1))
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        std = nanstd(grouped, dim=1, keepdim=True) if G > 1 else torch.zeros_like(mean)
        normalized = ((grouped - mean) / (std + 1e-4)).view(-1, rewards_per_func.size(1))
        summed = (normalized * weights).nansum(dim=1)
        summed[unscorable] = torch.nan
        spread = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
    elif scale_rewards == "batch":
        spread = nanstd(totals).expand_as(totals) if totals.numel() > 1 else torch.zeros_like(totals)
    elif G > 1:  # "group" and "none": each group's spread, one value per row as TRL has it
        spread = nanstd(totals.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        spread = torch.zeros_like(totals)
    figures["frac_reward_zero_std"] = torch.isclose(spread, torch.zeros_like(spread)).float().mean().item()
    return figures


COMPLETION_FIGURES = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


def log_fresh_completions(
    metrics: dict[str, list],
    accelerator,
    completion_ids: list[list[int]],
    tool_mask: list[list[int]] | None,
    fresh: list[bool],
    eos_and_pad: list[int],
) -> None:
    """Replace the completion figures TRL's `_generate` has just appended (lengths, clipped ratio, terminated lengths;
    and, with tools, `tools/call_frequency`) by the same figures over the fresh rows only (`fresh`: this rank's rows).
    TRL counts a completion's model tokens (`tool_mask`) when there is a mask, its tokens otherwise, and calls it
    clipped when its last token is neither end-of-sequence nor padding. Collective: one gather, on every rank, for the
    same generation batches (those that replay)."""
    lengths = [sum(mask) for mask in tool_mask] if tool_mask is not None else [len(ids) for ids in completion_ids]
    clipped = [ids[-1] not in eos_and_pad for ids in completion_ids]
    local = torch.tensor([lengths, clipped, fresh], dtype=torch.long, device=accelerator.device).T.contiguous()
    rows = accelerator.gather(local)
    kept = rows[:, 2].bool()
    lengths, clipped = rows[kept, 0].float(), rows[kept, 1].bool()
    terminated = lengths[~clipped]
    if len(terminated) == 0:  # TRL's figure when no completion ended
        terminated = torch.zeros(1, device=lengths.device)
    values = (
        lengths.mean(),
        lengths.min(),
        lengths.max(),
        clipped.float().mean(),
        terminated.mean(),
        terminated.min(),
        terminated.max(),
    )
    for name, value in zip(COMPLETION_FIGURES, values):
        metrics[name][-1] = value.item()
    if metrics.get("tools/call_frequency"):
        # TRL's calls per row, over every row; replayed rows make no call (their episodes are not played again), so the
        # calls are all fresh rows'. The count is recovered from TRL's figure (an exact integer count over the rows).
        calls = round(metrics["tools/call_frequency"][-1] * len(rows))
        metrics["tools/call_frequency"][-1] = (torch.tensor(calls) / int(kept.sum())).item()


class FaultCounts:
    """A run's counted faults and mismatches (`totals`, logged as the running totals `replay/<kind>`), each kind
    warned about once."""

    def __init__(self):
        self.totals: Counter = Counter()
        self._warned: set[str] = set()

    def count(self, kind: str, message: str, number: int = 1) -> None:
        self.totals[kind] += number
        self.warn_once(kind, "trl_exreplay: %s (counted in replay/%s; logged once).", message, kind)

    def warn_once(self, key: str, message: str, *args) -> None:
        """`logger.warning(message, *args)`, the first time `key` is given."""
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)
