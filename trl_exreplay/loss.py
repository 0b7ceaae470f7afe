"""Mixed on-policy / replayed-experience policy loss.

Pure tensor functions in the style of verl's ``core_algos.py``: it takes per-token log-probabilities, advantages and
masks and return the scalar loss (plus a few detached metrics). They know nothing about trainers, processes or
gradient accumulation; the caller (the trainer) supplies the normalizer and divides by the accumulation steps.

Fresh tokens follow TRL's GRPO clipped surrogate exactly, so with no replayed token the loss equals
``trl.GRPOTrainer._compute_loss`` (TRL 1.16, token-level importance sampling, ``beta=0``) before its
gradient-accumulation division. Replayed tokens use either verl's dual-clip PPO surrogate (``"clip"``) or ExGRPO's
policy shaping ``w / (w + beta)`` (``"exgrpo"``).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
OFF_POLICY_SHAPINGS = ("clip", "exgrpo")

# Replayed tokens can come from a policy many steps old: bound their log-ratio before `exp` (as verl does) so the
# ratio, the ExGRPO shaping and their gradients stay finite.
_OFF_LOG_RATIO_BOUND = 20.0


def _check_loss_type(loss_type: str, max_completion_length: int | None) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss_type {loss_type!r}: expected one of {', '.join(map(repr, LOSS_TYPES))}.")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' requires `max_completion_length` (the per-sequence token budget).")


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar the way TRL 1.16's ``GRPOTrainer`` does for ``loss_type``.

    ``mask`` is the ``(B, T)`` loss mask (1 = token counts). Positions where it is 0 contribute exactly 0, even if
    ``per_token_loss`` holds inf/NaN there. The reductions, before TRL's gradient-accumulation division:

    - ``"grpo"``: ``((L * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()``
    - ``"bnpo"``: ``(L * mask).sum() / mask.sum().clamp(min=1)``
    - ``"dr_grpo"``: ``(L * mask).sum() / (B * max_completion_length)``
    - ``"dapo"``: ``(L * mask).sum() / loss_normalizer`` (default ``mask.sum().clamp(min=1)``)

    Being linear in ``L``, it also serves for extra per-token terms (e.g. a KL penalty) added to the policy loss.
    Raises ``ValueError`` for an unknown ``loss_type`` or ``"dr_grpo"`` without ``max_completion_length``.
    """
    _check_loss_type(loss_type, max_completion_length)
    mask = mask.to(per_token_loss.dtype)
    masked_loss = torch.where(mask != 0, per_token_loss * mask, 0.0)
    if loss_type == "grpo":
        return (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked_loss.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked_loss.sum() / (per_token_loss.size(0) * max_completion_length)
    normalizer = mask.sum().clamp(min=1.0) if loss_normalizer is None else loss_normalizer
    return masked_loss.sum() / normalizer


def compute_exreplay_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    exp_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    off_cliprange_high: float = 1.0,
    off_clip_ratio_c: float = 3.0,
    off_policy_shaping: str = "clip",
    off_policy_shaping_beta: float = 0.1,
    max_completion_length: int | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy loss over a batch that mixes fresh (on-policy) and replayed (off-policy) completions.

    Args:
        per_token_logps: ``(B, T)`` log-probabilities of the completion tokens under the current policy (with grad).
        old_per_token_logps: ``(B, T)`` log-probabilities under the behaviour policy: the policy that sampled the
            fresh rows, and the (stored) policy that produced the replayed rows. ``None`` means
            ``per_token_logps.detach()`` (TRL's shortcut when generation and optimisation policies coincide).
            Values at positions where ``completion_mask`` is 0 are never read (they may be 0, ``-inf``, huge, NaN).
        advantages: ``(B,)`` or ``(B, 1)`` sequence advantages (a ``(B, T)`` per-token tensor also broadcasts).
        completion_mask: ``(B, T)`` loss mask, 1 for a model token that is trained. Only these tokens count.
        exp_mask: ``(B, T)``, 1 for a replayed (off-policy) model token, 0 for a fresh one. Positions with
            ``exp_mask`` 1 and ``completion_mask`` 0 are ignored.
        loss_type: aggregation of the per-token loss matrix ``L`` with ``mask = completion_mask``, as TRL 1.16:

            - ``"grpo"``: ``((L * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()``
            - ``"bnpo"``: ``(L * mask).sum() / mask.sum().clamp(min=1)``
            - ``"dr_grpo"``: ``(L * mask).sum() / (B * max_completion_length)``
            - ``"dapo"``: ``(L * mask).sum() / loss_normalizer``

        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` of fresh tokens (TRL's
            ``epsilon`` / ``epsilon_high``). ``epsilon_low`` is also the lower clip of replayed tokens.
        off_cliprange_high: upper clip ``1 + off_cliprange_high`` of replayed tokens (``"clip"`` shaping).
        off_clip_ratio_c: dual-clip constant ``c``: a replayed token with negative advantage loses at most
            ``-A * c`` (``"clip"`` shaping).
        off_policy_shaping: ``"clip"`` (verl dual-clip PPO) or ``"exgrpo"`` (ExGRPO shaping
            ``-A * w / (w + off_policy_shaping_beta)``, no clip).
        off_policy_shaping_beta: the ``beta`` of the ExGRPO shaping.
        max_completion_length: required for ``"dr_grpo"``.
        loss_normalizer: ``"dapo"`` only: the token count to divide by (float or 0-dim tensor). TRL uses
            ``num_items_in_batch / num_processes * gradient_accumulation_steps / steps_per_generation``. Defaults
            to ``completion_mask.sum().clamp(min=1)``.
        importance_sampling_ratio: ``(B, T)`` or ``(B, 1)`` truncated-IS correction for the vLLM sampler
            mismatch; multiplies the per-token loss of fresh tokens only.
        token_mask: ``(B, T)``, the tokens whose policy loss counts (TRL's ``top_entropy_quantile`` selection);
            the others add 0, and the loss is still normalized over ``completion_mask``, as TRL does. ``None``: all.

    Per-token losses (``A`` the advantage, ``r = exp(logp - old)``):

    - fresh tokens: ``-min(r * A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) * A)`` (times the IS ratio);
    - replayed tokens, ``"clip"``: ``pg1 = -A * r``, ``pg2 = -A * clamp(r, 1 - epsilon_low, 1 + off_cliprange_high)``,
      ``clip1 = max(pg1, pg2)``, and for ``A < 0`` the dual clip ``min(-A * off_clip_ratio_c, clip1)``;
    - replayed tokens, ``"exgrpo"``: ``-A * r / (r + off_policy_shaping_beta)``.

    Log-ratios are computed with ``torch.where`` on the masks (0 elsewhere), so garbage at masked positions never
    reaches the loss or its gradient. The log-ratio of replayed tokens is clamped to ``[-20, 20]`` before ``exp``;
    that of fresh tokens is not (as in TRL).

    Returns:
        ``(loss, metrics)``: the scalar loss (not divided by gradient-accumulation steps) and a dict of detached
        0-dim float32 tensors:

        - ``on_policy_loss`` / ``off_policy_loss``: mean per-token loss over fresh / replayed tokens (0.0 if none);
        - ``on_clip_fraction``: fraction of fresh tokens whose clip is active, i.e. ``r < 1 - epsilon_low`` with
          ``A < 0`` or ``r > 1 + epsilon_high`` with ``A > 0`` (0.0 if none);
        - ``off_clip_fraction``: fraction of replayed tokens where a clipped branch is used (``pg2 > pg1``, or the
          dual clip with ``A < 0`` and ``clip1 > -A * c``); always 0.0 for ``"exgrpo"`` and when there is none;
        - ``importance_ratio_min`` / ``importance_ratio_mean`` / ``importance_ratio_max``: the (clamped) ratio
          ``r`` over replayed tokens; with no replayed token they are ``+inf`` / ``0.0`` / ``-inf`` (the neutral
          elements of min / sum / max, so they reduce correctly across processes);
        - ``logp_drift``: mean ``|logp - old|`` over replayed tokens (unclamped; 0.0 if none);
        - ``fresh_tokens`` / ``replayed_tokens``: token counts, to weight the means across processes.
    """
    _check_loss_type(loss_type, max_completion_length)
    if off_policy_shaping not in OFF_POLICY_SHAPINGS:
        raise ValueError(
            f"Unknown off_policy_shaping {off_policy_shaping!r}: expected one of "
            f"{', '.join(map(repr, OFF_POLICY_SHAPINGS))}."
        )
    if per_token_logps.dim() != 2:
        raise ValueError(f"per_token_logps must be (B, T), got shape {tuple(per_token_logps.shape)}.")
    shape = per_token_logps.shape
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    for name, tensor in (
        ("old_per_token_logps", old_per_token_logps),
        ("completion_mask", completion_mask),
        ("exp_mask", exp_mask),
    ):
        if tensor.shape != shape:
            raise ValueError(
                f"{name} must have the shape of per_token_logps {tuple(shape)}, got {tuple(tensor.shape)}."
            )

    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(per_token_logps.dtype)

    trained = completion_mask.bool()
    replayed = trained & exp_mask.bool()
    fresh = trained & ~replayed
    mask = completion_mask.to(per_token_logps.dtype)

    raw_log_ratio = per_token_logps - old_per_token_logps
    zero = torch.zeros((), dtype=per_token_logps.dtype, device=per_token_logps.device)
    one = torch.ones((), dtype=per_token_logps.dtype, device=per_token_logps.device)

    # Fresh tokens: TRL's two-sided clipped surrogate. Every other position sees log-ratio 0 (ratio 1).
    on_log_ratio = torch.where(fresh, raw_log_ratio, zero)
    coef_1 = torch.exp(on_log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    on_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if importance_sampling_ratio is not None:
        is_ratio = importance_sampling_ratio.to(per_token_logps.dtype)
        on_loss = on_loss * torch.where(fresh, is_ratio, one)

    # Replayed tokens: bounded log-ratio, 0 elsewhere.
    off_log_ratio = torch.where(replayed, raw_log_ratio.clamp(-_OFF_LOG_RATIO_BOUND, _OFF_LOG_RATIO_BOUND), zero)
    ratio = torch.exp(off_log_ratio)
    if off_policy_shaping == "clip":
        pg1 = -advantages * ratio
        pg2 = -advantages * torch.clamp(ratio, 1 - epsilon_low, 1 + off_cliprange_high)
        clip1 = torch.maximum(pg1, pg2)
        pg3 = -advantages * off_clip_ratio_c
        clip2 = torch.minimum(pg3, clip1)
        negative = advantages < 0
        off_loss = torch.where(negative, clip2, clip1)
        off_clipped = (pg2 > pg1) | (negative & (clip1 > pg3))
    else:  # "exgrpo"
        off_loss = -advantages * ratio / (ratio + off_policy_shaping_beta)
        off_clipped = torch.zeros(shape, dtype=torch.bool, device=per_token_logps.device)

    per_token_loss = torch.where(replayed, off_loss, on_loss)
    if token_mask is not None:
        per_token_loss = torch.where(token_mask.bool(), per_token_loss, zero)
    loss = aggregate_loss(
        per_token_loss,
        mask,
        loss_type=loss_type,
        max_completion_length=max_completion_length,
        loss_normalizer=loss_normalizer,
    )

    with torch.no_grad():
        fresh_f = fresh.float()
        replayed_f = replayed.float()
        n_fresh = fresh_f.sum()
        n_replayed = replayed_f.sum()
        fresh_den = n_fresh.clamp(min=1.0)
        replayed_den = n_replayed.clamp(min=1.0)
        token_loss = per_token_loss.detach().float()
        adv = advantages.detach()
        coef_1_f = coef_1.detach()
        on_clipped = ((coef_1_f < 1 - epsilon_low) & (adv < 0)) | ((coef_1_f > 1 + epsilon_high) & (adv > 0))
        ratio_f = ratio.detach().float()
        inf = torch.tensor(float("inf"), device=per_token_logps.device)
        metrics = {
            "on_policy_loss": (token_loss * fresh_f).sum() / fresh_den,
            "off_policy_loss": (token_loss * replayed_f).sum() / replayed_den,
            "on_clip_fraction": (on_clipped & fresh).float().sum() / fresh_den,
            "off_clip_fraction": (off_clipped & replayed).float().sum() / replayed_den,
            # The appended neutral element keeps min/max defined on an empty (B * T == 0) batch too.
            "importance_ratio_min": torch.cat([torch.where(replayed, ratio_f, inf).flatten(), inf.view(1)]).min(),
            "importance_ratio_mean": (ratio_f * replayed_f).sum() / replayed_den,
            "importance_ratio_max": torch.cat([torch.where(replayed, ratio_f, -inf).flatten(), -inf.view(1)]).max(),
            "logp_drift": torch.where(replayed, raw_log_ratio.detach().float().abs(), 0.0).sum() / replayed_den,
            "fresh_tokens": n_fresh,
            "replayed_tokens": n_replayed,
        }
    return loss, metrics
