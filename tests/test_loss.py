"""Tests for `trl_exreplay.loss.compute_exreplay_loss`.

Expected values are worked out by hand (with `math`), never by calling the function under test; the last group checks
equality with TRL 1.16's own `GRPOTrainer._compute_loss` when no token is replayed.
"""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer  # imported at collection: the one-off ~6 s import is not a test's time

from trl_exreplay.loss import aggregate_loss, compute_exreplay_loss
from trl_exreplay.tiny import build_tiny_model, build_tiny_tokenizer

DT = torch.float64  # hand-worked checks run in float64 so they can be tight


def t(values, dtype=DT):
    return torch.tensor(values, dtype=dtype)


def logps_from_ratios(ratios, old):
    """Current log-probs such that exp(logp - old) == ratio, token by token."""
    return [[o + math.log(r) for r, o in zip(row_r, row_o)] for row_r, row_o in zip(ratios, old)]


def close(actual, expected, atol=1e-10, rtol=0.0):
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=rtol)


OLD_2x3 = [[-1.0, -2.0, -0.5], [-0.7, -3.0, -1.2]]


# --------------------------------------------------------------------------------------------------------------------
# Fresh tokens (TRL's clipped surrogate)
# --------------------------------------------------------------------------------------------------------------------


def test_fresh_clip_both_sides_all_fresh_batch():
    # row 0: A = +1, ratios 1.5 (above 1 + eps_high = 1.28: clipped), 1.1 (inside), 0.5 (below, but A > 0: unclipped)
    # row 1: A = -1, ratios 0.5 (below 1 - eps_low = 0.8: clipped), 0.9 (inside), 1.5 (above, but A < 0: unclipped)
    ratios = [[1.5, 1.1, 0.5], [0.5, 0.9, 1.5]]
    logp = t(logps_from_ratios(ratios, OLD_2x3))
    loss, m = compute_exreplay_loss(
        logp, t(OLD_2x3), t([1.0, -1.0]), torch.ones(2, 3), torch.zeros(2, 3), epsilon_low=0.2, epsilon_high=0.28
    )
    per_token = [
        -min(1.5 * 1, 1.28 * 1),  # -1.28
        -min(1.1, 1.1),  # -1.1
        -min(0.5, 0.8),  # -0.5
        -min(0.5 * -1, 0.8 * -1),  # 0.8
        -min(0.9 * -1, 0.9 * -1),  # 0.9
        -min(1.5 * -1, 1.28 * -1),  # 1.5
    ]
    assert per_token == pytest.approx([-1.28, -1.1, -0.5, 0.8, 0.9, 1.5])
    close(loss, sum(per_token) / 6)  # dapo, default normaliser = 6 tokens
    close(m["on_policy_loss"], sum(per_token) / 6, atol=1e-6)
    close(m["on_clip_fraction"], 2 / 6, atol=1e-7)
    # empty replayed set: documented conventions
    assert m["fresh_tokens"].item() == 6.0 and m["replayed_tokens"].item() == 0.0
    assert m["off_policy_loss"].item() == 0.0
    assert m["off_clip_fraction"].item() == 0.0
    assert m["importance_ratio_min"].item() == math.inf
    assert m["importance_ratio_mean"].item() == 0.0
    assert m["importance_ratio_max"].item() == -math.inf
    assert m["logp_drift"].item() == 0.0


def test_advantages_shape_b1_equals_b():
    ratios = [[1.5, 1.1, 0.5], [0.5, 0.9, 1.5]]
    logp = t(logps_from_ratios(ratios, OLD_2x3))
    args = (t(OLD_2x3),)
    loss_b, _ = compute_exreplay_loss(logp, *args, t([1.0, -1.0]), torch.ones(2, 3), torch.zeros(2, 3))
    loss_b1, _ = compute_exreplay_loss(logp, *args, t([[1.0], [-1.0]]), torch.ones(2, 3), torch.zeros(2, 3))
    close(loss_b, (-1.2 - 1.1 - 0.5 + 0.8 + 0.9 + 1.5) / 6)
    close(loss_b1, (-1.2 - 1.1 - 0.5 + 0.8 + 0.9 + 1.5) / 6)


# --------------------------------------------------------------------------------------------------------------------
# Replayed tokens
# --------------------------------------------------------------------------------------------------------------------

# row 0: A = +1; row 1: A = -2. exp(5) ~ 148.4 is the "huge" ratio of the dual clip.
REPLAY_RATIOS = [[2.5, 1.5, 0.5], [math.exp(5.0), 2.5, 0.5]]
REPLAY_ADV = [1.0, -2.0]


def test_replayed_clip_and_dual_clip_all_replayed_batch():
    logp = t(logps_from_ratios(REPLAY_RATIOS, OLD_2x3))
    loss, m = compute_exreplay_loss(
        logp,
        t(OLD_2x3),
        t(REPLAY_ADV),
        torch.ones(2, 3),
        torch.ones(2, 3),
        epsilon_low=0.2,
        epsilon_high=0.2,
        off_cliprange_high=1.0,
        off_clip_ratio_c=3.0,
    )
    # A = +1: pg1 = -r, pg2 = -clamp(r, 0.8, 2.0), loss = max(pg1, pg2)
    #   r = 2.5 > 2.0 -> max(-2.5, -2.0) = -2.0 (clipped)
    #   r = 1.5 (would be clipped on-policy at 1.2, but off_cliprange_high = 1) -> -1.5
    #   r = 0.5 -> max(-0.5, -0.8) = -0.5
    # A = -2: clip1 = max(2r, 2 clamp(r)), dual clip min(-A c = 6, clip1)
    #   r = e^5 -> clip1 = 2 e^5 ~ 296.8, dual clip -> 6.0 (clipped)
    #   r = 2.5 -> max(5.0, 4.0) = 5.0 < 6 -> 5.0 (not clipped: pg2 < pg1 and clip1 < pg3)
    #   r = 0.5 -> max(1.0, 1.6) = 1.6 (clipped, pg2 > pg1)
    per_token = [-2.0, -1.5, -0.5, 6.0, 5.0, 1.6]
    close(loss, sum(per_token) / 6)
    close(m["off_policy_loss"], sum(per_token) / 6, atol=1e-6)
    close(m["off_clip_fraction"], 3 / 6, atol=1e-7)
    # empty fresh set
    assert m["fresh_tokens"].item() == 0.0 and m["replayed_tokens"].item() == 6.0
    assert m["on_policy_loss"].item() == 0.0 and m["on_clip_fraction"].item() == 0.0
    flat = [r for row in REPLAY_RATIOS for r in row]
    close(m["importance_ratio_min"], 0.5, atol=1e-6)
    close(m["importance_ratio_max"], math.exp(5.0), atol=1e-4)
    close(m["importance_ratio_mean"], sum(flat) / 6, atol=1e-5)
    close(m["logp_drift"], sum(abs(math.log(r)) for r in flat) / 6, atol=1e-6)


def test_dual_clip_caps_negative_advantage_loss_at_c():
    # A single replayed token, A = -0.5, log-ratio 8: -A * r = 0.5 e^8 ~ 1490, capped at -A * c = 0.5 * 3
    logp, old = t([[-0.1]]), t([[-8.1]])
    loss, m = compute_exreplay_loss(logp, old, t([-0.5]), torch.ones(1, 1), torch.ones(1, 1), off_clip_ratio_c=3.0)
    close(loss, 1.5)
    assert m["off_clip_fraction"].item() == 1.0
    # same token without the dual clip being reachable (c huge): plain -A * r
    loss_no_dual, _ = compute_exreplay_loss(
        logp, old, t([-0.5]), torch.ones(1, 1), torch.ones(1, 1), off_clip_ratio_c=1e9
    )
    close(loss_no_dual, 0.5 * math.exp(8.0), atol=1e-8)


def test_exgrpo_shaping():
    beta = 0.1
    logp = t(logps_from_ratios(REPLAY_RATIOS, OLD_2x3))
    loss, m = compute_exreplay_loss(
        logp,
        t(OLD_2x3),
        t(REPLAY_ADV),
        torch.ones(2, 3),
        torch.ones(2, 3),
        off_policy_shaping="exgrpo",
        off_policy_shaping_beta=beta,
    )
    per_token = [-a * r / (r + beta) for a, row in zip(REPLAY_ADV, REPLAY_RATIOS) for r in row]
    close(loss, sum(per_token) / 6)
    close(m["off_policy_loss"], sum(per_token) / 6, atol=1e-6)
    assert m["off_clip_fraction"].item() == 0.0  # no clip in exgrpo shaping


@pytest.mark.parametrize("shaping", ["clip", "exgrpo"])
def test_exp_is_correct_off_ratio_one(shaping):
    # Replayed rows scored with old == logp (importance correction off): ratio 1 everywhere.
    logp = t([[-0.3, -1.7, -2.2], [-0.9, -0.4, -5.0]])
    adv = [1.5, -0.7]
    loss, m = compute_exreplay_loss(
        logp, logp.clone(), t(adv), torch.ones(2, 3), torch.ones(2, 3), off_policy_shaping=shaping, loss_type="bnpo"
    )
    per_row = [-a * 1.0 for a in adv] if shaping == "clip" else [-a * 1.0 / (1.0 + 0.1) for a in adv]
    close(loss, (3 * per_row[0] + 3 * per_row[1]) / 6)
    assert m["importance_ratio_min"].item() == 1.0 and m["importance_ratio_max"].item() == 1.0
    assert m["logp_drift"].item() == 0.0
    assert m["off_clip_fraction"].item() == 0.0


def test_replayed_log_ratio_is_bounded():
    # A replayed token with an absurd log-ratio (old = -1e4): ratio is exp(20), loss and grad stay finite.
    logp = t([[-0.5]]).requires_grad_()
    old = t([[-1.0e4]])
    loss, m = compute_exreplay_loss(
        logp,
        old,
        t([0.8]),
        torch.ones(1, 1),
        torch.ones(1, 1),
        off_policy_shaping="exgrpo",
        off_policy_shaping_beta=0.1,
    )
    w = math.exp(20.0)
    close(loss, -0.8 * w / (w + 0.1))
    close(m["importance_ratio_max"], w, atol=0.0, rtol=1e-6)  # metrics are float32
    close(m["logp_drift"], 1.0e4 - 0.5, atol=1e-2)  # drift is reported unclamped
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all()


# --------------------------------------------------------------------------------------------------------------------
# Mixed batches, masks, aggregation, IS correction
# --------------------------------------------------------------------------------------------------------------------

GARBAGE = [-math.inf, 1.0e30, math.nan]


def mixed_batch(requires_grad=False):
    """Row 0: 3 fresh tokens (A = +1, ratios 1.5, 1.1, 0.5) + 1 pad. Row 1: 1 replayed token (A = -2, ratio e^5)
    + 3 pads whose exp_mask is 1 and whose old log-probs are garbage."""
    old = [[-1.0, -2.0, -0.5, 0.0], [-0.7, *GARBAGE]]
    logp = [
        [-1.0 + math.log(1.5), -2.0 + math.log(1.1), -0.5 + math.log(0.5), -3.0],
        [-0.7 + 5.0, -0.1, -0.2, -0.3],
    ]
    logp = t(logp).requires_grad_(requires_grad)
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    exp_mask = torch.tensor([[0, 0, 0, 1], [1, 1, 1, 1]])
    return logp, t(old), t([1.0, -2.0]), completion_mask, exp_mask


# per-token losses of mixed_batch with eps 0.2/0.2, off_cliprange_high 1, c 3
MIXED_FRESH = [-1.2, -1.1, -0.5]
MIXED_REPLAYED = 6.0


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, (sum(MIXED_FRESH) / 3 + MIXED_REPLAYED / 1) / 2),
        ("bnpo", {}, (sum(MIXED_FRESH) + MIXED_REPLAYED) / 4),
        ("dr_grpo", {"max_completion_length": 4}, (sum(MIXED_FRESH) + MIXED_REPLAYED) / (2 * 4)),
        ("dr_grpo", {"max_completion_length": 10}, (sum(MIXED_FRESH) + MIXED_REPLAYED) / (2 * 10)),
        ("dapo", {}, (sum(MIXED_FRESH) + MIXED_REPLAYED) / 4),
        ("dapo", {"loss_normalizer": 10.0}, (sum(MIXED_FRESH) + MIXED_REPLAYED) / 10),
        ("dapo", {"loss_normalizer": torch.tensor(8.0)}, (sum(MIXED_FRESH) + MIXED_REPLAYED) / 8),
    ],
)
def test_aggregation_modes_on_mixed_batch(loss_type, kwargs, expected):
    loss, m = compute_exreplay_loss(*mixed_batch(), loss_type=loss_type, **kwargs)
    assert torch.isfinite(loss)
    close(loss, expected)
    assert m["fresh_tokens"].item() == 3.0 and m["replayed_tokens"].item() == 1.0
    close(m["on_policy_loss"], sum(MIXED_FRESH) / 3, atol=1e-6)
    close(m["off_policy_loss"], MIXED_REPLAYED, atol=1e-6)
    close(m["on_clip_fraction"], 1 / 3, atol=1e-7)  # only the ratio-1.5 token (A > 0)
    assert m["off_clip_fraction"].item() == 1.0
    close(m["importance_ratio_min"], math.exp(5.0), atol=1e-4)
    close(m["importance_ratio_max"], math.exp(5.0), atol=1e-4)
    close(m["importance_ratio_mean"], math.exp(5.0), atol=1e-4)
    close(m["logp_drift"], 5.0, atol=1e-6)
    for value in m.values():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad


def test_masked_tokens_ignored_even_when_replayed():
    logp, old, adv, completion_mask, exp_mask = mixed_batch(requires_grad=True)
    loss, _ = compute_exreplay_loss(logp, old, adv, completion_mask, exp_mask, loss_type="bnpo")
    # Change everything at masked positions (log-probs, old log-probs, exp flags): nothing changes.
    logp2 = logp.detach().clone()
    old2 = old.clone()
    exp2 = exp_mask.clone()
    pad = completion_mask == 0
    logp2[pad] = 123.0
    old2[pad] = -1.0e6
    exp2[pad] = 1 - exp2[pad]
    loss2, m2 = compute_exreplay_loss(logp2, old2, adv, completion_mask, exp2, loss_type="bnpo")
    close(loss, (sum(MIXED_FRESH) + MIXED_REPLAYED) / 4)
    close(loss2, (sum(MIXED_FRESH) + MIXED_REPLAYED) / 4)
    assert m2["replayed_tokens"].item() == 1.0 and m2["fresh_tokens"].item() == 3.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all()
    assert (grad[pad] == 0).all()


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, ((1.0 + 2.0 + 3.0) / 3 + 4.0 / 1) / 2),
        ("bnpo", {}, (1.0 + 2.0 + 3.0 + 4.0) / 4),
        ("dr_grpo", {"max_completion_length": 5}, (1.0 + 2.0 + 3.0 + 4.0) / (2 * 5)),
        ("dapo", {}, (1.0 + 2.0 + 3.0 + 4.0) / 4),
        ("dapo", {"loss_normalizer": 2.5}, (1.0 + 2.0 + 3.0 + 4.0) / 2.5),
    ],
)
def test_aggregate_loss_by_hand_ignores_garbage(loss_type, kwargs, expected):
    # Masked-out positions hold inf / NaN: they contribute exactly 0, to the value and to the gradient.
    per_token = t([[1.0, 2.0, 3.0, math.inf], [4.0, math.nan, -math.inf, 7.0]]).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    loss = aggregate_loss(per_token, mask, loss_type=loss_type, **kwargs)
    close(loss, expected)
    (grad,) = torch.autograd.grad(loss, per_token)
    assert torch.isfinite(grad).all() and (grad[mask == 0] == 0).all()


def test_aggregate_loss_errors():
    with pytest.raises(ValueError, match=r"loss_type.*'grpo'.*'bnpo'.*'dr_grpo'.*'dapo'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), loss_type="luspo")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), loss_type="dr_grpo")


def test_importance_sampling_ratio_applies_to_fresh_only():
    batch = mixed_batch()
    is_bt = t([[0.5, 2.0, 3.0, 7.0], [9.0, 9.0, 9.0, 9.0]])
    loss, m = compute_exreplay_loss(*batch, loss_type="bnpo", importance_sampling_ratio=is_bt)
    fresh = [-1.2 * 0.5, -1.1 * 2.0, -0.5 * 3.0]
    close(loss, (sum(fresh) + MIXED_REPLAYED) / 4)
    close(m["on_policy_loss"], sum(fresh) / 3, atol=1e-6)
    close(m["off_policy_loss"], MIXED_REPLAYED, atol=1e-6)

    is_b1 = t([[0.5], [9.0]])
    loss_b1, _ = compute_exreplay_loss(*batch, loss_type="bnpo", importance_sampling_ratio=is_b1)
    close(loss_b1, (0.5 * sum(MIXED_FRESH) + MIXED_REPLAYED) / 4)


def test_token_mask_drops_tokens_but_keeps_the_normalizer():
    """TRL's top_entropy_quantile: unselected tokens add 0 (and no gradient); the mean is still over every token."""
    logp, old, adv, completion_mask, exp_mask = mixed_batch(requires_grad=True)
    token_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])  # drops the second fresh token; the pad stays out
    loss, _ = compute_exreplay_loss(logp, old, adv, completion_mask, exp_mask, loss_type="bnpo", token_mask=token_mask)
    close(loss, (MIXED_FRESH[0] + MIXED_FRESH[2] + MIXED_REPLAYED) / 4)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0, 1].item() == 0.0 and grad[0, 2].item() != 0.0  # (token 0 is clipped: no gradient either way)
    only_replayed = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]])
    loss, _ = compute_exreplay_loss(
        logp, old, adv, completion_mask, exp_mask, loss_type="grpo", token_mask=only_replayed
    )
    close(loss, (0.0 / 3 + MIXED_REPLAYED / 1) / 2)


def test_all_masked_batch_is_zero():
    logp = t([[-0.3, -0.4], [-0.5, -0.6]]).requires_grad_()
    old = t([[-math.inf, math.nan], [1.0e30, 0.0]])
    for loss_type in ["grpo", "bnpo", "dr_grpo", "dapo"]:
        loss, m = compute_exreplay_loss(
            logp,
            old,
            t([1.0, -1.0]),
            torch.zeros(2, 2),
            torch.ones(2, 2),
            loss_type=loss_type,
            max_completion_length=2,
        )
        assert loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, logp)
        assert (grad == 0).all()
        assert m["fresh_tokens"].item() == 0.0 and m["replayed_tokens"].item() == 0.0
        assert m["importance_ratio_min"].item() == math.inf and m["importance_ratio_max"].item() == -math.inf


# --------------------------------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shaping", ["clip", "exgrpo"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("case", ["empty_fresh", "empty_replayed", "garbage_old"])
def test_gradients_finite(case, loss_type, shaping):
    logp, old, adv, completion_mask, exp_mask = mixed_batch(requires_grad=True)
    if case == "empty_fresh":
        exp_mask = torch.ones_like(exp_mask)
    elif case == "empty_replayed":
        exp_mask = torch.zeros_like(exp_mask)
    # old log-probs carry -inf / 1e30 / NaN at masked positions in every case; garbage_old keeps the mixed masks
    loss, m = compute_exreplay_loss(
        logp,
        old,
        adv,
        completion_mask,
        exp_mask,
        loss_type=loss_type,
        off_policy_shaping=shaping,
        max_completion_length=4,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert (grad[completion_mask == 0] == 0).all()
    assert (grad[completion_mask == 1] != 0).any()
    for key in ["on_policy_loss", "off_policy_loss", "importance_ratio_mean", "logp_drift"]:
        assert torch.isfinite(m[key])


def test_exgrpo_gradient_single_token():
    a, beta, logp0, old0 = 0.8, 0.1, -0.3, -1.0
    w = math.exp(logp0 - old0)
    logp = t([[logp0]]).requires_grad_()
    loss, _ = compute_exreplay_loss(
        logp,
        t([[old0]]),
        t([a]),
        torch.ones(1, 1),
        torch.ones(1, 1),
        off_policy_shaping="exgrpo",
        off_policy_shaping_beta=beta,
    )
    close(loss, -a * w / (w + beta))
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[-a * beta * w / (w + beta) ** 2 * (1 / 1)]])


def test_exgrpo_gradient_with_count_and_fresh_neighbours():
    # One row: token 0 replayed (w = e^0.7), tokens 1-2 fresh with ratio 1; bnpo divides by 3 tokens.
    a, beta = 0.8, 0.1
    w = math.exp(0.7)
    logp = t([[-0.3, -1.0, -2.0]]).requires_grad_()
    old = t([[-1.0, -1.0, -2.0]])
    loss, _ = compute_exreplay_loss(
        logp,
        old,
        t([a]),
        torch.ones(1, 3),
        t([[1, 0, 0]]),
        loss_type="bnpo",
        off_policy_shaping="exgrpo",
        off_policy_shaping_beta=beta,
    )
    close(loss, (-a * w / (w + beta) - a - a) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    # fresh tokens: d(-A r)/dlogp = -A r = -A at r = 1 (inside the clip range)
    close(grad, [[-a * beta * w / (w + beta) ** 2 / 3, -a / 3, -a / 3]])


def test_clip_gradient_zero_when_clipped():
    # Replayed row, A = -2, ratios e^5 (dual clip), 2.5 (unclipped: -A r), 0.5 (clipped low); dapo over 3 tokens.
    logp = t([[-0.7 + 5.0, -3.0 + math.log(2.5), -1.2 + math.log(0.5)]]).requires_grad_()
    old = t([[-0.7, -3.0, -1.2]])
    loss, _ = compute_exreplay_loss(logp, old, t([-2.0]), torch.ones(1, 3), torch.ones(1, 3))
    close(loss, (6.0 + 5.0 + 1.6) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[0.0, 2.0 * 2.5 / 3, 0.0]])


# --------------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------------


def test_errors():
    batch = mixed_batch()
    with pytest.raises(ValueError, match=r"loss_type.*'grpo'.*'bnpo'.*'dr_grpo'.*'dapo'"):
        compute_exreplay_loss(*batch, loss_type="cispo")
    with pytest.raises(ValueError, match=r"off_policy_shaping.*'clip'.*'exgrpo'"):
        compute_exreplay_loss(*batch, off_policy_shaping="sapo")
    with pytest.raises(ValueError, match="max_completion_length"):
        compute_exreplay_loss(*batch, loss_type="dr_grpo")
    logp, old, adv, completion_mask, exp_mask = batch
    with pytest.raises(ValueError, match="exp_mask"):
        compute_exreplay_loss(logp, old, adv, completion_mask, exp_mask[:, :2])


# --------------------------------------------------------------------------------------------------------------------
# Equality with TRL 1.16 GRPOTrainer._compute_loss when nothing is replayed
# --------------------------------------------------------------------------------------------------------------------

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _reward(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_matches_trl_compute_loss_without_replay(loss_type, tmp_path):
    tokenizer = build_tiny_tokenizer(WORDS)
    model = build_tiny_model(tokenizer, seed=0)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        loss_type=loss_type,
        gradient_accumulation_steps=1,
        report_to="none",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=_reward,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["alpha beta", "gamma delta"]}),
        processing_class=tokenizer,
    )
    # `current_gradient_accumulation_steps` is only set by `Trainer`'s training loop; set it as the loop would.
    if not hasattr(trainer, "current_gradient_accumulation_steps"):
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    for attr in ("epsilon_low", "epsilon_high", "max_completion_length", "loss_type", "accelerator"):
        assert hasattr(trainer, attr), attr
    assert trainer.loss_type == loss_type
    assert not trainer.use_vllm and trainer.importance_sampling_level == "token"

    ids = tokenizer.convert_tokens_to_ids
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor(
        [
            [pad, ids("alpha"), ids("beta")],
            [ids("gamma"), ids("delta"), ids("eta")],
            [pad, pad, ids("theta")],
            [ids("iota"), ids("kappa"), ids("alpha")],
        ]
    )
    prompt_mask = (prompt_ids != pad).long()  # left padded
    lengths = [6, 4, 2, 5]
    completion_mask = torch.tensor([[1] * n + [0] * (6 - n) for n in lengths])  # right padded
    generator = torch.Generator().manual_seed(0)
    word_ids = torch.tensor([ids(w) for w in WORDS])
    completion_ids = word_ids[torch.randint(len(WORDS), (4, 6), generator=generator)]
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    trainer.model.train()
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 6)
    # Behaviour log-probs off by up to ~0.6 nats, so plenty of tokens fall outside [0.8, 1.28].
    old_per_token_logps = current + 0.6 * (2 * torch.rand(4, 6, generator=generator) - 1)

    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": old_per_token_logps,
        "num_items_in_batch": torch.tensor(int(completion_mask.sum())),
    }
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trl_grads = torch.autograd.grad(trl_loss, params)

    per_token_logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, 6)
    ga = trainer.current_gradient_accumulation_steps
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    normalizer = normalizer * ga / trainer.args.steps_per_generation
    loss, metrics = compute_exreplay_loss(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        torch.zeros_like(completion_mask),
        loss_type=loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        max_completion_length=trainer.max_completion_length,
        loss_normalizer=normalizer,
    )
    # TRL divides grpo / bnpo / dr_grpo by the accumulation steps inside `_compute_loss`; dapo's normaliser has it.
    expected = loss if loss_type == "dapo" else loss / ga
    torch.testing.assert_close(trl_loss, expected, atol=1e-6, rtol=0)
    ours_grads = torch.autograd.grad(expected, params)
    for g_trl, g_ours in zip(trl_grads, ours_grads):
        torch.testing.assert_close(g_trl, g_ours, atol=1e-6, rtol=1e-5)

    assert metrics["on_clip_fraction"].item() > 0  # the clip is really exercised
    assert metrics["replayed_tokens"].item() == 0 and metrics["fresh_tokens"].item() == sum(lengths)
    region = trainer._metrics["train"]["clip_ratio/region_mean"][-1]
    assert metrics["on_clip_fraction"].item() == pytest.approx(region, abs=1e-6)
