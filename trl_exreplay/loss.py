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

- ``replay_shaping="exgrpo"`` (any type): ``-A * w / (w + replay_shaping_beta)`` (ExGRPO's policy shaping, no clip)
- grpo, bnpo, dr_grpo, dapo, luspo:
  ``max(-A * min(w, delta), -A * clamp(w, 1 - epsilon_low, 1 + replay_clip_high))``, then for ``A < 0`` at most
  ``-A * replay_dual_clip_c`` (verl's dual clip)
- cispo: ``-sg(min(w, 1 + replay_clip_high)) * A * logp`` (CISPO's truncated IS weight)
- sapo: ``-A * sigmoid(tau * (w - 1)) * 4 / tau``, ``tau`` by the sign of ``A`` (SAPO's gate)
- vespo: ``-sg(phi(w_seq)) * A * logp``, ``phi`` TRL's gamma weights on the sequence ratio

``delta`` (TRL's two-sided clip) is ``None`` unless set. SAPO's gate and VESPO's gamma weight already vanish far from
``w = 1``, so ``replay_clip_high`` plays no part there. Then TRL's ``off_policy_mask_threshold`` (OPSM) drops
replayed rows with ``A < 0`` whose mean ``logp_mu - logp`` exceeds it, and a ``token_mask`` (TRL's
``top_entropy_quantile`` selection) keeps only the selected tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from .trl_seam import gamma_weights, off_policy_mask

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's, all of them
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # PPO-style clipped surrogates
# Loss types that divide a token sum by TRL's `num_items_in_batch` normaliser (the caller passes it).
TOKEN_SUM_LOSS_TYPES = ("dapo", "cispo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

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
    - ``"dapo"``, ``"cispo"``, ``"vespo"``: ``(L * mask).sum() / loss_normalizer`` (default
      ``mask.sum().clamp(min=1)``)
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


def reduce_as_trl(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    training: bool,
    num_items_in_batch: torch.Tensor | None = None,
    num_processes: int = 1,
    accumulation: int = 1,
    steps_per_generation: int = 1,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """The scalar TRL 1.16's `GRPOTrainer._compute_loss` makes of a ``(B, T)`` per-token loss of `loss_type` in one
    micro-batch: `aggregate_loss` with TRL's normaliser, divided for gradient accumulation as TRL divides (`training`:
    by `accumulation`, TRL's `current_gradient_accumulation_steps`; evaluation divides by nothing). The token-sum types
    divide by the generation batch's token count (`num_items_in_batch`, summed over ranks) per process, per
    micro-batch; the others divide their own reduction by `accumulation`. Pinned to TRL's loss for every loss type by
    `tests/integration/test_trl_contract.py`."""
    accumulation = accumulation if training else 1
    if loss_type in TOKEN_SUM_LOSS_TYPES:
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        if training:
            normalizer = normalizer * accumulation / steps_per_generation
        return aggregate_loss(per_token_loss, mask, loss_type=loss_type, loss_normalizer=normalizer)
    term = aggregate_loss(per_token_loss, mask, loss_type=loss_type, max_completion_length=max_completion_length)
    return term / accumulation


@dataclass(frozen=True)
class OffPolicyOptions:
    """Everything `off_policy_loss` reads of a run's configuration, under the config's own names: TRL's fields, which
    pick and parametrise the formula, and the `replay_*` fields of replayed tokens. `ExReplayGRPOTrainer` builds one
    with `from_config`."""

    loss_type: str = "dapo"  # TRL's; picks the registered formula
    importance_sampling_level: str = "token"  # TRL's: "token", or "sequence" (GSPO: one ratio per row)
    epsilon_low: float = 0.2  # TRL's lower clip 1 - epsilon (clip family)
    delta: float | None = None  # TRL's two-sided clip: the unclipped branch's ratio capped at delta; None: none
    replay_clip_high: float = 1.0  # upper clip 1 + c of replayed ratios (clip family); CISPO's truncation
    replay_dual_clip_c: float = 3.0  # a replayed token with A < 0 loses at most -A * c
    replay_shaping: str = "clip"  # "clip": the loss type's rule; "exgrpo": -A * w / (w + beta) for every type
    replay_shaping_beta: float = 0.1
    sapo_temperature_pos: float = 1.0  # TRL's SAPO gate temperatures
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0  # TRL's VESPO gamma weights
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None  # TRL's OPSM threshold; None: off

    @classmethod
    def from_config(cls, args, settings, **trainer_values) -> OffPolicyOptions:
        """The options of a run: TRL's config fields from `args`, ours from `settings` (`config.ReplaySettings`: a
        field the run's shaping does not read is None there, and keeps its default here), and `trainer_values`, the
        fields TRL's trainer derives from its config (`loss_type`, `importance_sampling_level`, `epsilon_low`,
        `off_policy_mask_threshold`)."""
        ours = ("replay_clip_high", "replay_dual_clip_c", "replay_shaping", "replay_shaping_beta")
        trl = [f.name for f in fields(cls) if f.name not in ours and f.name not in trainer_values]
        read = {n: getattr(settings, n) for n in ours if getattr(settings, n) is not None}
        return cls(**{n: getattr(args, n) for n in trl}, **read, **trainer_values)


# A formula: (ratio, advantages, per_token_logps, raw_log_ratio, replayed_f, options) -> (per-token loss, clipped
# tokens, the ratio to report). `ratio` is (B, T), or (B, 1) for sequence-level ratios; the loss may broadcast.
OffPolicyFormula = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
OFF_POLICY_LOSSES: dict[str, OffPolicyFormula] = {}  # TRL loss type -> its replayed tokens' formula
OFF_POLICY_SHAPINGS: dict[str, OffPolicyFormula | None] = {"clip": None}  # None: the loss type's own formula


def off_policy_shapings() -> tuple[str, ...]:
    """The values `replay_shaping` accepts: the shapings registered when it is called, a user's included (the config
    checks its field against these, so that a shaping registered before the config is made can be selected)."""
    return tuple(OFF_POLICY_SHAPINGS)


def register_off_policy_loss(*loss_types: str, registry: dict | None = None):
    """Register the decorated formula for `loss_types` (TRL loss types; or, with `registry=OFF_POLICY_SHAPINGS`, a
    shaping that replaces every type's formula), as verl's `register_policy_loss` does."""
    target = OFF_POLICY_LOSSES if registry is None else registry

    def register(formula: OffPolicyFormula) -> OffPolicyFormula:
        for name in loss_types:
            target[name] = formula
        return formula

    return register


@register_off_policy_loss("exgrpo", registry=OFF_POLICY_SHAPINGS)
def _exgrpo_shaping(ratio, advantages, logps, raw_log_ratio, replayed_f, o: OffPolicyOptions):
    """ExGRPO's policy shaping `-A * w / (w + beta)`: no clip."""
    return -advantages * ratio / (ratio + o.replay_shaping_beta), torch.zeros_like(ratio, dtype=torch.bool), ratio


@register_off_policy_loss(*CLIP_LOSS_TYPES)
def _clipped_surrogate(ratio, advantages, logps, raw_log_ratio, replayed_f, o: OffPolicyOptions):
    """PPO's clipped surrogate with the replayed upper bound, then verl's dual clip for A < 0."""
    capped = ratio if o.delta is None else torch.clamp(ratio, max=o.delta)
    pg1 = -advantages * capped
    pg2 = -advantages * torch.clamp(ratio, 1 - o.epsilon_low, 1 + o.replay_clip_high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -advantages * o.replay_dual_clip_c
    negative = advantages < 0
    per_token_loss = torch.where(negative, torch.minimum(pg3, clip1), clip1)
    return per_token_loss, (pg2 > pg1) | (negative & (clip1 > pg3)), ratio


@register_off_policy_loss("cispo")
def _cispo(ratio, advantages, logps, raw_log_ratio, replayed_f, o: OffPolicyOptions):
    """CISPO's truncated importance weight, detached, on a REINFORCE term."""
    weight = torch.clamp(ratio, max=1 + o.replay_clip_high)
    return -weight.detach() * advantages * logps, ratio > 1 + o.replay_clip_high, ratio


@register_off_policy_loss("sapo")
def _sapo(ratio, advantages, logps, raw_log_ratio, replayed_f, o: OffPolicyOptions):
    """SAPO's soft gate, its temperature by the sign of A."""
    temperatures = torch.full_like(advantages, o.sapo_temperature_neg).masked_fill(
        advantages > 0, o.sapo_temperature_pos
    )
    per_token_loss = -torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures * advantages
    return per_token_loss, torch.zeros_like(ratio, dtype=torch.bool), ratio


@register_off_policy_loss("vespo")
def _vespo(ratio, advantages, logps, raw_log_ratio, replayed_f, o: OffPolicyOptions):
    """TRL's own gamma weights, on the sequence ratio to the recorded behaviour policy."""
    phi = gamma_weights(
        advantages=advantages,
        log_ratio_per_token=raw_log_ratio,
        mask=replayed_f,
        importance_sampling_ratio=None,
        k_pos=o.vespo_k_pos,
        lambda_pos=o.vespo_lambda_pos,
        k_neg=o.vespo_k_neg,
        lambda_neg=o.vespo_lambda_neg,
    )
    bounded = raw_log_ratio.clamp(-_OFF_LOG_RATIO_BOUND, _OFF_LOG_RATIO_BOUND)
    sequence_ratio = torch.exp(
        (bounded * replayed_f).sum(-1, keepdim=True).clamp(-_OFF_LOG_RATIO_BOUND, _OFF_LOG_RATIO_BOUND)
    )
    return -phi * advantages * logps, torch.zeros_like(logps, dtype=torch.bool), sequence_ratio


def off_policy_loss(
    per_token_logps: torch.Tensor,
    behaviour_logps: torch.Tensor,
    advantages: torch.Tensor,
    exp_mask: torch.Tensor,
    options: OffPolicyOptions | None = None,
    *,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss of the replayed tokens (the module docstring gives each loss type's formula).

    Args:
        per_token_logps: ``(B, T)`` log-probabilities of the completion tokens under the current policy (with grad).
        behaviour_logps: ``(B, T)`` log-probabilities recorded when the replayed rows were sampled (``mu``); pass
            ``per_token_logps.detach()`` to treat them as on-policy (``replay_importance_sampling=False``: ratio 1).
            Values where ``exp_mask`` is 0 are never read (they may be 0, ``-inf``, NaN).
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)`` advantages (TRL's, computed over each group).
        exp_mask: ``(B, T)``, 1 for a replayed model token that is trained, 0 elsewhere (fresh tokens, padding,
            environment tokens).
        options: the run's `OffPolicyOptions` (default: all defaults, TRL's ``"dapo"``). Its ``loss_type`` picks the
            formula registered for it (``OFF_POLICY_LOSSES``), unless ``replay_shaping`` names a shaping
            (``OFF_POLICY_SHAPINGS``). VESPO always uses its own sequence ratio (a sum).
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
    >>> from trl_exreplay.loss import OffPolicyOptions, off_policy_loss
    >>> logp, mu = torch.log(torch.tensor([[3.0, 1.0]])), torch.zeros(1, 2)  # ratios 3 and 1
    >>> loss, metrics = off_policy_loss(logp, mu, torch.tensor([1.0]), torch.tensor([[1, 1]]),
    ...                                 OffPolicyOptions(loss_type="grpo"))
    >>> loss  # -A * min(w, 1 + replay_clip_high): the first ratio is clipped to 2
    tensor([[-2., -1.]])
    >>> int(metrics["clipped_tokens"])
    1

    ```
    """
    o = OffPolicyOptions() if options is None else options
    _check_choice("loss_type", o.loss_type, LOSS_TYPES)
    _check_choice("importance_sampling_level", o.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    _check_choice("replay_shaping", o.replay_shaping, off_policy_shapings())
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
    if o.importance_sampling_level == "sequence" and o.loss_type != "vespo":
        log_ratio = (log_ratio * replayed_f).sum(-1, keepdim=True) / replayed_f.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio)  # (B, T), or (B, 1) for sequence-level ratios

    formula = OFF_POLICY_SHAPINGS[o.replay_shaping] or OFF_POLICY_LOSSES[o.loss_type]
    per_token_loss, clipped, ratio = formula(ratio, advantages, per_token_logps, raw_log_ratio, replayed_f, o)

    keep = replayed
    if o.off_policy_mask_threshold is not None:
        keep = (
            keep
            & off_policy_mask(
                advantages=advantages,
                per_token_logps=per_token_logps,
                sampling_per_token_logps=torch.where(replayed, behaviour_logps, per_token_logps.detach()),
                mask=replayed_f,
                off_policy_threshold=o.off_policy_mask_threshold,
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
