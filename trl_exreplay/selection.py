"""Which stored trajectories a replayed group gets (`select_trajectories`): the pool's selection on its index (by saved
entropy, or at random), or, with `replay_select_by_current_entropy`, the lowest entropy under the current policy,
scored by one no-grad forward sharded over ranks (`policy_forward`). Either way the rule is `pool.rules.select`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .planner import ReplayPlan
from .pool import Trajectory
from .pool.rules import select
from .trl_seam import pad


def select_trajectories(
    pool, plan: ReplayPlan, settings, step: int, seed, accelerator, policy_forward: Callable, on_main: Callable
) -> dict[str, list[Trajectory]]:
    """The trajectories of each task `plan` replays (identical on every rank), read where the pool's rows are:
    `on_main(read)` runs `read` on rank 0 and sends its result to every rank. Both ways decide by `pool.rules.select`
    under the pool's `replay_select_mode`, with one draw for ``random``. Collective when `plan` replays."""
    if not plan.replay_groups:
        return {}
    k, age = plan.num_replayed, settings.replay_max_policy_age  # `settings`: the run's ReplaySettings
    rng = np.random.default_rng([*seed, 1])
    tasks = list(plan.replay_groups.values())
    if not settings.replay_select_by_current_entropy:  # None under replay_select_mode="random"
        # By saved entropy (or at random): chosen on the pool's index; only the chosen trajectories are read.
        return on_main(lambda: pool.select(tasks, k, step, age, rng))
    # By entropy under the current policy: every candidate of a task with more than k is scored (the others are all
    # replayed, in the order of their saved entropies).
    candidates = on_main(lambda: {t: pool.trajectories(t, step, age) for t in tasks})
    ranked = [t for t in candidates if len(candidates[t]) > k]
    values = current_policy_entropies([c for t in ranked for c in candidates[t]], accelerator, policy_forward)
    entropies, start = {}, 0
    for t in ranked:
        entropies[t] = values[start : start + len(candidates[t])]
        start += len(candidates[t])
    scored = {
        t: (entropies.get(t) or [c.entropy for c in cs], [c.traj_id for c in cs]) for t, cs in candidates.items()
    }
    return {
        t: [candidates[t][i] for i in order] for t, order in select(scored, k, pool.replay_select_mode, rng).items()
    }


@torch.no_grad()
def current_policy_entropies(trajectories: list[Trajectory], accelerator, policy_forward: Callable) -> list[float]:
    """Mean entropy of each trajectory's model tokens under the current policy.

    Sharded over processes (rank r scores trajectories r, r+W, ...), every rank making the same number of forward
    calls (short shards are padded), then gathered, so all ranks see identical values and ZeRO-3 cannot deadlock.
    """
    total = len(trajectories)
    if total == 0:
        return []
    world, rank = accelerator.num_processes, accelerator.process_index
    per_rank = math.ceil(total / world)
    mine = [trajectories[i] for i in range(rank, total, world)]
    mine += [trajectories[0]] * (per_rank - len(mine))
    _, entropies, model_mask = policy_forward(
        [t.prompt_ids for t in mine], [t.completion_ids for t in mine], [t.completion_mask for t in mine], True
    )
    means = (entropies * model_mask).sum(-1) / model_mask.sum(-1).clamp(min=1)
    gathered = accelerator.gather(means.float()).view(world, per_rank).cpu()
    return [float(gathered[i % world, i // world]) for i in range(total)]


@torch.no_grad()
def policy_forward(
    forward: Callable,
    model,
    prompts: list,
    completions: list,
    model_masks: list,
    compute_entropy: bool = False,
    *,
    device,
    pad_token_id: int,
    batch_size: int,
):
    """One no-grad forward of the current policy `model` over (prompt, completion) token lists through `forward`
    (TRL's `GRPOTrainer._get_per_token_logps_and_entropies`, bound), batched as TRL batches its own: per-token
    log-probs and entropies (None unless `compute_entropy`) over the completions, (rows, tokens), and the model-token
    mask padded alike. Every process must make the same number of calls (ZeRO-3, FSDP)."""
    pad_id = pad_token_id
    prompts = [torch.tensor(list(p), dtype=torch.long) for p in prompts]
    completions = [torch.tensor(list(c), dtype=torch.long) for c in completions]
    prompt_ids = pad(prompts, padding_value=pad_id, padding_side="left").to(device)
    prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device)
    completion_ids = pad(completions, padding_value=pad_id, padding_side="right").to(device)
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    model_mask = pad([torch.tensor(list(m)) for m in model_masks], padding_value=0, padding_side="right")
    model_mask = (model_mask * completion_mask).to(device)
    logps, entropies, _ = forward(
        model,
        torch.cat([prompt_ids, completion_ids], dim=1),
        torch.cat([prompt_mask, completion_mask.to(device)], dim=1),
        completion_ids.size(1),
        batch_size=batch_size,
        compute_entropy=compute_entropy,
    )
    return logps, entropies, model_mask
