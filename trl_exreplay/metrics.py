"""The `replay/*` metrics, appended to TRL's metric lists (`GRPOTrainer._metrics[mode]`), which TRL averages and
logs with its own. The replayed tokens' figures are reduced over ranks (sums and extremes), so every rank logs the
same values; the generation ones are computed from the global replay plan and the rank-identical pool."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch

from .planner import ReplayPlan

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
