"""The replayed tokens' term of the loss, for every TRL 1.16 loss type.

Pure tensor functions in the style of verl's ``core_algos.py``: per-token log-probabilities, advantages and masks in,
a per-token loss (plus a few detached metrics) out. They know nothing about trainers, processes or gradient
accumulation.

A replaying batch's loss is TRL's own ``GRPOTrainer._compute_loss`` over the batch with the replayed rows' advantages
set to 0 (so they add nothing to TRL's policy term, yet stay in every normaliser, the KL and the entropy terms), plus
the term below over the replayed tokens, reduced by ``aggregate_loss`` with the loss type's own normaliser. Replayed
tokens were sampled by an older policy ``mu`` whose log-probabilities were recorded; their importance ratio is
``w = exp(logp - logp_mu)`` (log-ratio bounded to ``[-20, 20]``), or, with ``importance_sampling_level="sequence"``,
one ratio per row, ``exp`` of the mean log-ratio over its replayed tokens (GSPO). With ``A`` the row's advantage:

==========================================  =================================================================================
``off_policy_shaping="exgrpo"`` (any type)  ``-A * w / (w + off_policy_shaping_beta)`` (ExGRPO's policy shaping, no clip)
grpo, bnpo, dr_grpo, dapo, luspo            ``max(-A * min(w, delta), -A * clamp(w, 1 - epsilon_low, 1 + off_cliprange_high))``,
                                            then for ``A < 0`` at most ``-A * off_clip_ratio_c`` (verl's dual clip)
cispo                                       ``-sg(min(w, 1 + off_cliprange_high)) * A * logp`` (CISPO's truncated IS weight)
sapo                                        ``-A * sigmoid(tau * (w - 1)) * 4 / tau``, ``tau`` by the sign of ``A`` (SAPO's gate)
vespo                                       ``-sg(phi(w_seq)) * A * logp``, ``phi`` TRL's gamma weights on the sequence ratio
==========================================  =================================================================================

``delta`` (TRL's two-sided clip) is ``None`` unless set. SAPO's gate and VESPO's gamma weight already vanish far from
``w = 1``, so ``off_cliprange_high`` plays no part there. Then TRL's ``off_policy_mask_threshold`` (OPSM) drops
replayed rows with ``A < 0`` whose mean ``logp_mu - logp`` exceeds it, and a ``token_mask`` (TRL's
``top_entropy_quantile`` selection) keeps only the selected tokens.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's, all of them
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO-style clipped surrogates
# Loss types that divide a token sum by TRL's `num_items_in_batch` normaliser (the caller passes it).
TOKEN_SUM_LOSS_TYPES = ("dapo", "cispo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
OFF_POLICY_SHAPINGS = ("clip", "exgrpo")

# Replayed tokens can come from a policy many steps old: bound their log-ratio before `exp` (as verl does) so the
# ratio, the shaping and their gradients stay finite.
_OFF_LOG_RATIO_BOUND = 20.0


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"Unknown {name} {value!r}: expected one of {', '.join(map(repr, allowed))}.")


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    loss_normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss to a scalar the way TRL 1.16's ``GRPOTrainer`` does for ``loss_type``.

    ``mask`` is the ``(B, T)`` loss mask (1 = the token counts). Positions where it is 0 contribute exactly 0, even if
    ``per_token_loss`` holds inf/NaN there. The reductions, before TRL's gradient-accumulation division:

    - ``"grpo"``, ``"sapo"``: ``((L * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()``
    - ``"bnpo"``: ``(L * mask).sum() / mask.sum().clamp(min=1)``
    - ``"dr_grpo"``: ``(L * mask).sum() / (B * max_completion_length)``
    - ``"dapo"``, ``"cispo"``, ``"vespo"``: ``(L * mask).sum() / loss_normalizer`` (default ``mask.sum().clamp(min=1)``)
    - ``"luspo"``: ``(L * mask).sum(-1).mean()``

    Being linear in ``L``, the reduction of a sum of terms is the sum of their reductions: this is what lets the
    replayed tokens' term be added to TRL's loss. Raises ``ValueError`` for an unknown ``loss_type`` or ``"dr_grpo"``
    without ``max_completion_length``.

    Example:

    ```python
    >>> import torch
    >>> from trl_exreplay.loss import aggregate_loss
    >>> aggregate_loss(torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]),
    ...                loss_type="grpo")
    tensor(2.2500)

    ```
    """
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' requires `max_completion_length` (the per-sequence token budget).")
    mask = mask.to(per_token_loss.dtype)
    masked_loss = torch.where(mask != 0, per_token_loss * mask, 0.0)
    if loss_type in ("grpo", "sapo"):
        return (masked_loss.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return masked_loss.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return masked_loss.sum() / (per_token_loss.size(0) * max_completion_length)
    if loss_type == "luspo":
        return masked_loss.sum(-1).mean()
    normalizer = mask.sum().clamp(min=1.0) if loss_normalizer is None else loss_normalizer
    return masked_loss.sum() / normalizer


def off_policy_loss(
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    advantages: torch.Tensor,
    exp_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    importance_sampling_level: str = "token",
    epsilon_low: float = 0.2,
    delta: float | None = None,
    off_cliprange_high: float = 1.0,
    off_clip_ratio_c: float = 3.0,
    off_policy_shaping: str = "clip",
    off_policy_shaping_beta: float = 0.1,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: float | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss of the replayed tokens (the module docstring gives each loss type's formula).

    Args:
        per_token_logps: ``(B, T)`` log-probabilities of the completion tokens under the current policy (with grad).
        behaviour_logps: ``(B, T)`` log-probabilities recorded when the replayed rows were sampled (``mu``); pass
            ``per_token_logps.detach()`` to treat them as on-policy (``replay_importance_sampling=False``: ratio 1). Values where
            ``exp_mask`` is 0 are never read (they may be 0, ``-inf``, NaN).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` advantages (TRL's, computed over each group).
        exp_mask: ``(B, T)``, 1 for a replayed model token that is trained, 0 elsewhere (fresh tokens, padding,
            environment tokens).
        loss_type: one of TRL 1.16's loss types (``LOSS_TYPES``); it picks the formula.
        importance_sampling_level: ``"token"`` (a ratio per token) or ``"sequence"`` (GSPO: one per row, the exp of
            the mean log-ratio over the row's replayed tokens). VESPO always uses its own sequence ratio (a sum).
        epsilon_low: lower clip ``1 - epsilon_low`` (TRL's ``epsilon``), clip-family types.
        delta: TRL's two-sided clip: the unclipped branch's ratio is capped at ``delta``; ``None`` for none.
        off_cliprange_high: upper clip ``1 + off_cliprange_high`` of replayed ratios (clip family), and CISPO's
            truncation of the replayed IS weight.
        off_clip_ratio_c: dual clip: a replayed token with ``A < 0`` loses at most ``-A * off_clip_ratio_c``.
        off_policy_shaping: ``"clip"`` (the loss type's own rule above) or ``"exgrpo"`` (ExGRPO's shaping
            ``-A * w / (w + off_policy_shaping_beta)`` whatever the loss type).
        off_policy_shaping_beta: the ``beta`` of the ExGRPO shaping.
        sapo_temperature_pos: SAPO's gate temperature for positive advantages (TRL's config field).
        sapo_temperature_neg: SAPO's gate temperature for negative advantages.
        vespo_k_pos: VESPO's gamma parameter k for positive advantages (TRL's field).
        vespo_lambda_pos: VESPO's lambda for positive advantages.
        vespo_k_neg: VESPO's k for negative advantages.
        vespo_lambda_neg: VESPO's lambda for negative advantages.
        off_policy_mask_threshold: TRL's OPSM threshold: a replayed row with negative advantage whose mean
            ``logp_mu - logp`` over its replayed tokens exceeds it trains nothing. ``None``: off.
        token_mask: ``(B, T)``, the tokens whose policy loss counts (TRL's ``top_entropy_quantile`` selection).

    Returns:
        ``(per_token_loss, metrics)``: a ``(B, T)`` tensor, 0 wherever ``exp_mask`` (or ``token_mask``) is 0, to be
        reduced by ``aggregate_loss`` over the whole batch's loss mask; and detached 0-dim float32 metrics over the
        replayed tokens:

        - ``loss_sum``: the per-token loss summed over replayed tokens (sums, so that they reduce across
            processes: divide by ``replayed_tokens`` for means);
        - ``clipped_tokens``: tokens where a clip binds (clip family: the clipped or the dual-clip branch is
            taken; CISPO: the weight is truncated; never for SAPO, VESPO and the ExGRPO shaping);
        - ``ratio_min`` / ``ratio_sum`` / ``ratio_max``: the ratio ``w`` the formula uses (bounded), over
            replayed tokens; with none, ``+inf`` / ``0`` / ``-inf`` (neutral elements);
        - ``logp_drift_sum``: ``|logp - logp_mu|`` summed (unbounded);
        - ``replayed_tokens``: their number.

    Example:

    ```python
    >>> import torch
    >>> from trl_exreplay.loss import off_policy_loss
    >>> logp, mu = torch.log(torch.tensor([[3.0, 1.0]])), torch.zeros(1, 2)  # ratios 3 and 1
    >>> loss, metrics = off_policy_loss(logp, mu, torch.tensor([1.0]), torch.tensor([[1, 1]]), loss_type="grpo")
    >>> loss  # -A * min(w, 1 + off_cliprange_high): the first ratio is clipped to 2
    tensor([[-2., -1.]])
    >>> int(metrics["clipped_tokens"])
    1

    ```
    """
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    _check_choice("off_policy_shaping", off_policy_shaping, OFF_POLICY_SHAPINGS)
    if per_token_logps.dim() != 2:
        raise ValueError(f"per_token_logps must be (B, T), got shape {tuple(per_token_logps.shape)}.")
    shape = per_token_logps.shape
    for name, tensor in (("behaviour_logps", behaviour_logps), ("exp_mask", exp_mask)):
        if tensor.shape != shape:
            raise ValueError(
                f"{name} must have the shape of per_token_logps {tuple(shape)}, got {tuple(tensor.shape)}."
            )
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    advantages = advantages.to(per_token_logps.dtype)
    replayed = exp_mask.bool()
    replayed_f = replayed.to(per_token_logps.dtype)
    zero = torch.zeros((), dtype=per_token_logps.dtype, device=per_token_logps.device)

    # `where`, not a product: garbage (inf, NaN) at other positions never reaches the loss or its gradient.
    raw_log_ratio = torch.where(replayed, per_token_logps - behaviour_logps, zero)
    log_ratio = raw_log_ratio.clamp(-_OFF_LOG_RATIO_BOUND, _OFF_LOG_RATIO_BOUND)
    if importance_sampling_level == "sequence" and loss_type != "vespo":
        log_ratio = (log_ratio * replayed_f).sum(-1, keepdim=True) / replayed_f.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)  # (B, T), or (B, 1) for sequence-level ratios

    clipped = torch.zeros(shape, dtype=torch.bool, device=per_token_logps.device)
    if off_policy_shaping == "exgrpo":
        per_token_loss = -advantages * ratio / (ratio + off_policy_shaping_beta)
    elif loss_type in CLIP_LOSS_TYPES:
        capped = ratio if delta is None else torch.clamp(ratio, max=delta)
        pg1 = -advantages * capped
        pg2 = -advantages * torch.clamp(ratio, 1 - epsilon_low, 1 + off_cliprange_high)
        clip1 = torch.maximum(pg1, pg2)
        pg3 = -advantages * off_clip_ratio_c
        negative = advantages < 0
        per_token_loss = torch.where(negative, torch.minimum(pg3, clip1), clip1)
        clipped = (pg2 > pg1) | (negative & (clip1 > pg3))
    elif loss_type == "cispo":
        weight = torch.clamp(ratio, max=1 + off_cliprange_high)
        per_token_loss = -weight.detach() * advantages * per_token_logps
        clipped = ratio > 1 + off_cliprange_high
    elif loss_type == "sapo":
        temperatures = torch.full_like(advantages, sapo_temperature_neg).masked_fill(
            advantages > 0, sapo_temperature_pos
        )
        per_token_loss = -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages
    else:  # "vespo": TRL's own gamma weights, on the ratio to the recorded behaviour policy
        phi = GRPOTrainer.get_gamma_weights(
            advantages=advantages,
            log_ratio_per_token=raw_log_ratio,
            mask=replayed_f,
            importance_sampling_ratio=None,
            k_pos=vespo_k_pos,
            lambda_pos=vespo_lambda_pos,
            k_neg=vespo_k_neg,
            lambda_neg=vespo_lambda_neg,
        )
        per_token_loss = -phi * advantages * per_token_logps
        ratio = torch.exp(
            (log_ratio * replayed_f).sum(-1, keepdim=True).clamp(-_OFF_LOG_RATIO_BOUND, _OFF_LOG_RATIO_BOUND)
        )

    keep = replayed
    if off_policy_mask_threshold is not None:
        keep = (
            keep
            & GRPOTrainer.get_off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=torch.where(replayed, behaviour_logps, per_token_logps.detach()),
                mask=replayed_f,
                off_policy_threshold=off_policy_mask_threshold,
            ).bool()
        )
    if token_mask is not None:
        keep = keep & token_mask.bool()
    per_token_loss = torch.where(keep, per_token_loss.expand(shape), zero)

    with torch.no_grad():
        token_ratio = ratio.expand(shape).float()
        inf = torch.tensor(float("inf"), device=per_token_logps.device)
        metrics = {
            "loss_sum": per_token_loss.detach().float().sum(),
            "clipped_tokens": (clipped.expand(shape) & keep).float().sum(),
            # The appended neutral element keeps min/max defined on an empty (B * T == 0) batch too.
            "ratio_min": torch.cat([torch.where(replayed, token_ratio, inf).flatten(), inf.view(1)]).min(),
            "ratio_sum": torch.where(replayed, token_ratio, 0.0).sum(),
            "ratio_max": torch.cat([torch.where(replayed, token_ratio, -inf).flatten(), -inf.view(1)]).max(),
            "logp_drift_sum": raw_log_ratio.detach().float().abs().sum(),
            "replayed_tokens": replayed.float().sum(),
        }
    return per_token_loss, metrics
