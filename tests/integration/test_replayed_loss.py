"""The loss of a replaying batch, in a trainer, two ways:

1. **The glue** (`test_replayed_term_is_loss_py_added_to_trls_loss`): under each TRL option replay supports (the "yes"
   rows of docs/support.md), each case trains 2 steps from a pool filled beforehand, so both steps replay. At every
   replaying loss call, on the very batch the trainer was given, the trainer's loss must be TRL's
   `GRPOTrainer._compute_loss` on the batch with the replayed rows at advantage 0 plus the replayed tokens' term of
   `trl_exreplay.loss.off_policy_loss`, reduced by TRL's normaliser, both recomputed from a forward of their own
   (`tests/loss_check.py`); the replayed term must not be zero, and TRL's own metrics (its `clip_ratio/*` among them)
   are logged on replaying steps.
2. **The objective by hand** (`test_replaying_loss_and_gradient_are_the_objective_by_hand`), the independent check:
   value and gradient against the objective written out here without TRL's `_compute_loss` or `trl_exreplay.loss`
   (fresh tokens get TRL 1.16's formula for the loss type, replayed tokens the formula of docs/support.md, and the loss
   type's normaliser runs over all of them). The glue check reuses `loss.py`, so a wrong sign, clip bound, missing
   `detach` or normaliser inside `loss.py` would pass there and fails here.

The formulas alone, on hand-made tensors, are `tests/unit/test_loss.py`.
"""

from __future__ import annotations

import math

import pytest
import torch
from loss_check import CheckingTrainer, assert_replaying_losses_compose, train_replaying

from trl_exreplay import ExReplayGRPOTrainer

# (name, options): every loss type, and the options that change what a replayed token gets.
GLUE_CASES = [
    *((f"loss_type={t}", {"loss_type": t}) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")),
    ("loss_type=vespo", {"loss_type": "vespo", "vespo_k_pos": 0.5, "vespo_lambda_pos": 0.5}),
    ("sequence level (GSPO)", {"importance_sampling_level": "sequence", "loss_type": "grpo"}),
    ("sequence level, cispo", {"importance_sampling_level": "sequence", "loss_type": "cispo"}),
    ("beta=0.04, bias-corrected KL", {"beta": 0.04, "use_bias_correction_kl": True}),
    ("delta=1.05", {"delta": 1.05, "replay_clip_high": 0.02}),
    ("off_policy_mask_threshold", {"off_policy_mask_threshold": 0.01}),
    ("top_entropy_quantile, entropy_coef", {"top_entropy_quantile": 0.5, "entropy_coef": 0.5}),
    ("use_adaptive_entropy", {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 5.0}),
    ("exgrpo shaping", {"replay_shaping": "exgrpo"}),
    ("exgrpo shaping, sapo", {"replay_shaping": "exgrpo", "loss_type": "sapo"}),
    ("replay_importance_sampling=False", {"replay_importance_sampling": False}),
    ("num_iterations=2", {"num_iterations": 2}),
    ("gradient_accumulation_steps=2", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 8}),
    ("steps_per_generation=2", {"steps_per_generation": 2, "per_device_train_batch_size": 8}),
    ("mask_truncated_completions", {"mask_truncated_completions": True}),
    ("scale_rewards=batch, epsilon_high", {"scale_rewards": "batch", "epsilon_high": 0.28}),
]


@pytest.mark.parametrize("name, options", GLUE_CASES, ids=[name for name, _ in GLUE_CASES])
def test_replayed_term_is_loss_py_added_to_trls_loss(tmp_path, filled_pool, name, options):
    trainer = train_replaying(tmp_path, filled_pool, CheckingTrainer, **options)
    assert len(trainer.checks) >= 2  # both steps replayed
    assert_replaying_losses_compose(trainer)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(math.isfinite(entry["loss"]) for entry in logged)
    assert logged[0]["replay/rows_fraction"] > 0  # (with num_iterations=2, step 2 reuses step 1's generation)
    assert any("replay/off_policy_loss" in entry for entry in logged)
    for entry in logged:
        if trainer.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            assert "clip_ratio/region_mean" in entry  # TRL's own metrics, replaying steps included
        assert "entropy" in entry and ("kl" in entry) == (trainer.beta != 0)


CLIP_FAMILY = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
OBJECTIVE_CASES = [
    *({"loss_type": t} for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")),
    {"loss_type": "vespo", "vespo_k_pos": 0.5, "vespo_lambda_pos": 0.5},
    {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    {"loss_type": "cispo", "importance_sampling_level": "sequence"},
    {"loss_type": "grpo", "num_iterations": 2},
    {"loss_type": "vespo", "num_iterations": 2},
    {"loss_type": "dapo", "gradient_accumulation_steps": 2, "per_device_train_batch_size": 8},
    {"loss_type": "dapo", "steps_per_generation": 2, "per_device_train_batch_size": 8},
    {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": True, "num_iterations": 2},
    {"loss_type": "grpo", "delta": 1.05, "replay_clip_high": 0.02},
    {"loss_type": "grpo", "replay_shaping": "exgrpo"},
    {"loss_type": "sapo", "replay_shaping": "exgrpo"},
    {"loss_type": "grpo", "replay_importance_sampling": False},
    {"loss_type": "grpo", "mask_truncated_completions": True},
    {"loss_type": "grpo", "off_policy_mask_threshold": 0.05},
    {"loss_type": "dapo", "top_entropy_quantile": 0.5},
]


def gamma_weight(advantages, sequence_log_ratio, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's phi(w) = e^lambda w^k e^(-lambda w) of a row's summed log-ratio, (k, lambda) by the advantage's sign."""
    log_w = sequence_log_ratio.clamp(math.log(1e-8), 20.0)
    positive = advantages >= 0
    k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(positive, lambda_pos, lambda_neg).to(log_w.dtype)
    return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(0.0, 0.0, 0.0)


def objective_by_hand(trainer, model, inputs) -> torch.Tensor:
    args, loss_type = trainer.args, trainer.loss_type
    mask = (inputs["completion_mask"] * inputs.get("tool_mask", 1)).double()
    length = inputs["completion_ids"].size(1)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1].double() / trainer.temperature
    logp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
    adv = inputs["advantages"].double().unsqueeze(1)
    replayed = inputs["exp_mask"].bool() & mask.bool()
    replayed_f = replayed.double()
    old = inputs.get("old_per_token_logps")
    old = logp.detach() if old is None else old.double()
    behaviour = inputs["recorded_per_token_logps"].double() if args.replay_importance_sampling else logp.detach()
    sequence = args.importance_sampling_level == "sequence"
    low, high = trainer.epsilon_low, trainer.epsilon_high

    def tau(a):
        return torch.where(a > 0, args.sapo_temperature_pos, args.sapo_temperature_neg).to(a.dtype)

    # Fresh tokens: TRL 1.16's formula.
    log_ratio = logp - old
    if sequence:
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = log_ratio.exp()
    if loss_type in CLIP_FAMILY:
        capped = ratio if args.delta is None else ratio.clamp(max=args.delta)
        fresh = -torch.minimum(capped * adv, ratio.clamp(1 - low, 1 + high) * adv)
    elif loss_type == "cispo":
        fresh = -ratio.clamp(max=high).detach() * adv * logp
    elif loss_type == "sapo":
        fresh = -torch.sigmoid(tau(adv) * (ratio - 1)) * 4 / tau(adv) * adv
    else:
        summed = ((logp - old).detach().clamp(-20, 20) * mask).sum(-1, keepdim=True)
        gammas = (args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg)
        fresh = -gamma_weight(adv, summed, *gammas) * adv * logp

    # Replayed tokens: docs/support.md.
    off_log = torch.where(replayed, logp - behaviour, 0.0).clamp(-20, 20)
    if sequence and loss_type != "vespo":
        off_log = (off_log * replayed_f).sum(-1, keepdim=True) / replayed_f.sum(-1, keepdim=True).clamp(min=1)
    w = off_log.exp()
    if args.replay_shaping == "exgrpo":
        off = -adv * w / (w + args.replay_shaping_beta)
    elif loss_type in CLIP_FAMILY:
        capped = w if args.delta is None else w.clamp(max=args.delta)
        clipped = torch.maximum(-adv * capped, -adv * w.clamp(1 - low, 1 + args.replay_clip_high))
        off = torch.where(adv < 0, torch.minimum(clipped, -adv * args.replay_dual_clip_c), clipped)
    elif loss_type == "cispo":
        off = -w.clamp(max=1 + args.replay_clip_high).detach() * adv * logp
    elif loss_type == "sapo":
        off = -torch.sigmoid(tau(adv) * (w - 1)) * 4 / tau(adv) * adv
    else:
        gammas = (args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg)
        off = -gamma_weight(adv, (off_log.detach() * replayed_f).sum(-1, keepdim=True), *gammas) * adv * logp
    if args.off_policy_mask_threshold is not None:  # OPSM: a row with A < 0 far from its sampling policy drops out

        def kept(sampling, tokens):
            drift = ((sampling - logp.detach()) * tokens).sum(-1, keepdim=True) / tokens.sum(-1, keepdim=True).clamp(
                min=1
            )
            return ((adv >= 0) | (drift <= args.off_policy_mask_threshold)).double()

        fresh, off = fresh * kept(old, mask), off * kept(behaviour, replayed_f)
    per_token = torch.where(replayed, off.expand_as(logp), fresh.expand_as(logp))
    if args.top_entropy_quantile < 1:  # only the highest-entropy tokens of the batch, fresh and replayed alike
        scaled = logits.float().detach()  # in float32, as TRL computes them: the cut falls between the same tokens
        entropy = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)
        cut = torch.quantile(entropy[mask.bool()], 1 - args.top_entropy_quantile)
        per_token = per_token * ((entropy >= cut) & mask.bool())
    if trainer.beta != 0:
        ref = inputs["ref_per_token_logps"].double()
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + trainer.beta * (kl * ratio if args.use_bias_correction_kl else kl)

    accumulation = trainer.current_gradient_accumulation_steps
    total = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (total.sum(-1) / mask.sum(-1).clamp(min=1)).mean() / accumulation
    if loss_type == "bnpo":
        return total.sum() / mask.sum().clamp(min=1) / accumulation
    if loss_type == "dr_grpo":
        return total.sum() / (total.size(0) * trainer.max_completion_length) / accumulation
    if loss_type == "luspo":
        return total.sum(-1).mean() / accumulation
    return total.sum() / (inputs["num_items_in_batch"].double() * accumulation / args.steps_per_generation)


def _dense(gradient, other):
    """A parameter's gradient in float64, zeros where autograd gave none (the parameter did not reach the loss)."""
    return torch.zeros_like(other, dtype=torch.float64) if gradient is None else gradient.double()


class ObjectiveTrainer(ExReplayGRPOTrainer):
    """For each replaying loss call: the trainer's loss and the objective by hand, each with its gradient."""

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self._replays(inputs):
            params = [p for p in model.parameters() if p.requires_grad]
            ours = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            hand = objective_by_hand(self, model, inputs)
            theirs = torch.autograd.grad(hand, params, allow_unused=True)
            pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None or b is not None]
            gap = math.sqrt(sum(float((_dense(a, b) - _dense(b, a)).pow(2).sum()) for a, b in pairs))
            size = math.sqrt(sum(float(_dense(b, a).pow(2).sum()) for a, b in pairs))
            self.checks.append((loss.item(), hand.item(), gap, size, int(inputs["exp_mask"].sum())))
        return loss


@pytest.mark.parametrize(
    "options", OBJECTIVE_CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in OBJECTIVE_CASES]
)
def test_replaying_loss_and_gradient_are_the_objective_by_hand(tmp_path, filled_pool, options):
    trainer = train_replaying(tmp_path, filled_pool, ObjectiveTrainer, **options)
    assert trainer.checks and sum(c[4] for c in trainer.checks) > 0
    for loss, hand, gap, size, _ in trainer.checks:
        assert loss == pytest.approx(hand, rel=1e-5, abs=1e-6)
        assert gap <= 1e-4 * max(size, 1e-3), (gap, size)
