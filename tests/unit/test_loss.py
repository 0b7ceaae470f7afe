"""Tests for `trl_exreplay.loss`: the replayed tokens' term (`off_policy_loss`) of every TRL loss type, and
`aggregate_loss`, TRL's normalisers.

Expected values are worked out by hand (with `math`), never by calling the function under test. That TRL's own loss
plus this term is what the trainer trains is checked in `tests/integration/test_replayed_loss.py`.
"""

from __future__ import annotations

import math

import pytest
import torch

from trl_exreplay.loss import LOSS_TYPES, OffPolicyOptions, aggregate_loss, off_policy_loss

DT = torch.float64  # hand-worked checks run in float64 so they can be tight


def replayed_term(per_token_logps, behaviour_logps, advantages, exp_mask, token_mask=None, **options):
    """`off_policy_loss` with the fields of its `OffPolicyOptions` given as keywords."""
    return off_policy_loss(
        per_token_logps, behaviour_logps, advantages, exp_mask, OffPolicyOptions(**options), token_mask=token_mask
    )


def t(values, dtype=DT):
    return torch.tensor(values, dtype=dtype)


def logps_from_ratios(ratios, old):
    """Current log-probs such that exp(logp - old) == ratio, token by token."""
    return [[o + math.log(r) for r, o in zip(row_r, row_o)] for row_r, row_o in zip(ratios, old)]


def close(actual, expected, atol=1e-10, rtol=0.0):
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=rtol)


OLD_2x3 = [[-1.0, -2.0, -0.5], [-0.7, -3.0, -1.2]]
ALL_2x3 = torch.ones(2, 3)


# --------------------------------------------------------------------------------------------------------------------
# The clip family (grpo, bnpo, dr_grpo, dapo, luspo) and the ExGRPO shaping
# --------------------------------------------------------------------------------------------------------------------

# row 0: A = +1; row 1: A = -2. exp(5) ~ 148.4 is the "huge" ratio of the dual clip.
REPLAY_RATIOS = [[2.5, 1.5, 0.5], [math.exp(5.0), 2.5, 0.5]]
REPLAY_ADV = [1.0, -2.0]
FLAT_RATIOS = [r for row in REPLAY_RATIOS for r in row]


def replay_batch(requires_grad=False):
    logp = t(logps_from_ratios(REPLAY_RATIOS, OLD_2x3)).requires_grad_(requires_grad)
    return logp, t(OLD_2x3), t(REPLAY_ADV), ALL_2x3


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_clip_and_dual_clip(loss_type):
    per_token, m = replayed_term(
        *replay_batch(), loss_type=loss_type, epsilon_low=0.2, replay_clip_high=1.0, replay_dual_clip_c=3.0
    )
    # A = +1: pg1 = -r, pg2 = -clamp(r, 0.8, 2.0), loss = max(pg1, pg2)
    #   r = 2.5 > 2.0 -> max(-2.5, -2.0) = -2.0 (clipped)
    #   r = 1.5 (clipped on-policy at 1 + epsilon_high, but the replayed bound is 1 + replay_clip_high) -> -1.5
    #   r = 0.5 -> max(-0.5, -0.8) = -0.5
    # A = -2: clip1 = max(2r, 2 clamp(r)), dual clip min(-A c = 6, clip1)
    #   r = e^5 -> clip1 = 2 e^5 ~ 296.8, dual clip -> 6.0 (clipped)
    #   r = 2.5 -> max(5.0, 4.0) = 5.0 < 6 -> 5.0 (not clipped: pg2 < pg1 and clip1 < pg3)
    #   r = 0.5 -> max(1.0, 1.6) = 1.6 (clipped, pg2 > pg1)
    expected = [[-2.0, -1.5, -0.5], [6.0, 5.0, 1.6]]
    close(per_token, expected)
    close(m["loss_sum"], 8.6, atol=1e-5)
    assert m["clipped_tokens"].item() == 3.0 and m["replayed_tokens"].item() == 6.0
    close(m["ratio_min"], 0.5, atol=1e-6)
    close(m["ratio_max"], math.exp(5.0), atol=1e-4)
    close(m["ratio_sum"], sum(FLAT_RATIOS), atol=1e-4)
    close(m["logp_drift_sum"], sum(abs(math.log(r)) for r in FLAT_RATIOS), atol=1e-5)
    for value in m.values():
        assert value.dim() == 0 and value.dtype == torch.float32 and not value.requires_grad


def test_dual_clip_caps_negative_advantage_loss_at_c():
    # A single replayed token, A = -0.5, log-ratio 8: -A * r = 0.5 e^8 ~ 1490, capped at -A * c = 0.5 * 3
    logp, old, one = t([[-0.1]]), t([[-8.1]]), torch.ones(1, 1)
    per_token, m = replayed_term(logp, old, t([-0.5]), one, loss_type="grpo", replay_dual_clip_c=3.0)
    close(per_token, [[1.5]])
    assert m["clipped_tokens"].item() == 1.0
    per_token, _ = replayed_term(logp, old, t([-0.5]), one, loss_type="grpo", replay_dual_clip_c=1e9)
    close(per_token, [[0.5 * math.exp(8.0)]], atol=1e-8)  # the dual clip out of reach: plain -A * r


def test_delta_caps_the_unclipped_branch():
    # TRL's two-sided clip: min(r, delta) in the unclipped branch. A = -2, r = 2.5, delta 1.5: max(2 * 1.5, 2 * 2.0).
    logp, old, one = t([[math.log(2.5)]]), t([[0.0]]), torch.ones(1, 1)
    per_token, _ = replayed_term(logp, old, t([-2.0]), one, loss_type="dapo", delta=1.5)
    close(per_token, [[4.0]])  # the clipped branch -A * clamp(2.5, 0.8, 2.0) = 4 now wins over 3
    per_token, _ = replayed_term(logp, old, t([-2.0]), one, loss_type="dapo")
    close(per_token, [[5.0]])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_exgrpo_shaping_whatever_the_loss_type(loss_type):
    beta = 0.1
    per_token, m = replayed_term(
        *replay_batch(), loss_type=loss_type, replay_shaping="exgrpo", replay_shaping_beta=beta
    )
    close(per_token, [[-a * r / (r + beta) for r in row] for a, row in zip(REPLAY_ADV, REPLAY_RATIOS)])
    assert m["clipped_tokens"].item() == 0.0


@pytest.mark.parametrize("shaping", ["clip", "exgrpo"])
def test_behaviour_equal_to_current_gives_ratio_one(shaping):
    # replay_importance_sampling=False: the replayed rows are scored as on-policy, ratio 1 everywhere.
    logp = t([[-0.3, -1.7, -2.2], [-0.9, -0.4, -5.0]])
    adv = [1.5, -0.7]
    per_token, m = replayed_term(logp, logp.clone(), t(adv), ALL_2x3, loss_type="bnpo", replay_shaping=shaping)
    factor = 1.0 if shaping == "clip" else 1.0 / 1.1
    close(per_token, [[-adv[0] * factor] * 3, [-adv[1] * factor] * 3])
    assert m["ratio_min"].item() == m["ratio_max"].item() == 1.0
    assert m["logp_drift_sum"].item() == 0.0 and m["clipped_tokens"].item() == 0.0


def test_log_ratio_is_bounded():
    # A replayed token with an absurd log-ratio (mu = -1e4): ratio exp(20), loss and gradient finite.
    logp = t([[-0.5]]).requires_grad_()
    per_token, m = replayed_term(
        logp, t([[-1.0e4]]), t([0.8]), torch.ones(1, 1), replay_shaping="exgrpo", replay_shaping_beta=0.1
    )
    w = math.exp(20.0)
    close(per_token, [[-0.8 * w / (w + 0.1)]])
    close(m["ratio_max"], w, atol=0.0, rtol=1e-6)  # metrics are float32
    close(m["logp_drift_sum"], 1.0e4 - 0.5, atol=1e-2)  # the drift is reported unbounded
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    assert torch.isfinite(grad).all()


def test_sequence_level_ratio_is_one_per_row():
    # GSPO: w = exp(mean log-ratio over the row's replayed tokens), the same for each of its tokens.
    per_token, m = replayed_term(*replay_batch(), loss_type="grpo", importance_sampling_level="sequence")
    w0 = math.exp(sum(math.log(r) for r in REPLAY_RATIOS[0]) / 3)  # (2.5 * 1.5 * 0.5) ** (1/3) ~ 1.233
    w1 = math.exp(sum(math.log(r) for r in REPLAY_RATIOS[1]) / 3)  # ~ 3.44: -A w = 6.88, clipped: max(6.88, 4) ->
    close(per_token, [[-w0] * 3, [6.0] * 3])  # the dual clip at -A c = 6
    close(m["ratio_max"], w1, atol=1e-5)
    assert m["clipped_tokens"].item() == 3.0


def test_sequence_level_ratio_counts_only_replayed_tokens():
    logp = t([[math.log(4.0), 7.0, 0.0]])  # token 1 is not replayed: its log-probs never count
    exp_mask = torch.tensor([[1, 0, 1]])
    per_token, _ = replayed_term(
        logp,
        t([[0.0, math.nan, 0.0]]),
        t([1.0]),
        exp_mask,
        loss_type="grpo",
        importance_sampling_level="sequence",
        replay_clip_high=5.0,
    )
    close(per_token, [[-2.0, 0.0, -2.0]])  # w = exp((log 4 + 0) / 2) = 2


def test_cispo_truncated_weight_times_log_prob():
    logp = t(logps_from_ratios(REPLAY_RATIOS, OLD_2x3)).requires_grad_()
    per_token, m = replayed_term(logp, t(OLD_2x3), t(REPLAY_ADV), ALL_2x3, loss_type="cispo", replay_clip_high=1.0)
    weights = [[min(r, 2.0) for r in row] for row in REPLAY_RATIOS]
    expected = [[-w * a * lp for w, lp in zip(wr, lr)] for a, wr, lr in zip(REPLAY_ADV, weights, logp.tolist())]
    close(per_token, expected)
    assert m["clipped_tokens"].item() == 3.0  # 2.5, e^5, 2.5
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    close(grad, [[-w * a for w in wr] for a, wr in zip(REPLAY_ADV, weights)])  # the weight is not differentiated


def test_sapo_soft_gate():
    per_token, m = replayed_term(
        *replay_batch(), loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05
    )

    def gate(r, tau):
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))

    taus = [1.0, 1.05]  # A > 0 in row 0, A < 0 in row 1
    close(per_token, [[-a * gate(r, tau) for r in row] for a, tau, row in zip(REPLAY_ADV, taus, REPLAY_RATIOS)])
    assert m["clipped_tokens"].item() == 0.0


def test_vespo_gamma_weight_of_the_sequence_ratio():
    logp = t(logps_from_ratios(REPLAY_RATIOS, OLD_2x3))
    per_token, _ = replayed_term(logp, t(OLD_2x3), t(REPLAY_ADV), ALL_2x3, loss_type="vespo")

    def phi(w, k, lam):  # TRL's gamma weight e^lam w^k e^(-lam w), 1 at w = 1
        return math.exp(lam) * w**k * math.exp(-lam * w)

    w0 = 2.5 * 1.5 * 0.5  # the product of the row's ratios (a sum of log-ratios)
    w1 = math.exp(5.0) * 2.5 * 0.5
    phis = [phi(w0, 2.0, 3.0), phi(w1, 3.0, 2.0)]  # (k, lambda) for A >= 0, for A < 0 (TRL's defaults)
    expected = [[-p * a * lp for lp in row] for p, a, row in zip(phis, REPLAY_ADV, logp.tolist())]
    close(per_token, expected, atol=1e-12)


def test_off_policy_mask_drops_negative_rows_far_from_the_behaviour_policy():
    # OPSM (TRL's get_off_policy_mask): row 1 has A < 0 and mean(mu - logp) = mean(-log r) < 0 here, so it is kept;
    # flip its ratios below 1 and it is dropped. Row 0 (A > 0) is always kept.
    logp, old, adv, mask = replay_batch()
    kept, _ = replayed_term(logp, old, adv, mask, loss_type="grpo", off_policy_mask_threshold=0.5)
    low = t(logps_from_ratios([[1.0, 1.0, 1.0], [0.2, 0.3, 0.5]], OLD_2x3))  # mean(-log r) ~ 0.97 > 0.5
    dropped, _ = replayed_term(low, old, adv, mask, loss_type="grpo", off_policy_mask_threshold=0.5)
    assert (kept[1] != 0).all() and (dropped[1] == 0).all() and (dropped[0] != 0).all()


def test_token_mask_and_exp_mask_zero_everything_else():
    logp, old, adv, _ = replay_batch(requires_grad=True)
    old = old.clone()
    old[0, 1] = math.nan  # garbage where nothing is replayed never reaches the loss or the gradient
    exp_mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    token_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    per_token, m = replayed_term(logp, old, adv, exp_mask, loss_type="grpo", token_mask=token_mask)
    close(per_token, [[-2.0, 0.0, -0.5], [0.0, 5.0, 1.6]])
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    assert torch.isfinite(grad).all() and grad[0, 1] == 0 and grad[1, 0] == 0
    assert m["replayed_tokens"].item() == 5.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("shaping", ["clip", "exgrpo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_gradients_finite_and_only_on_replayed_tokens(loss_type, shaping, level):
    logp, old, adv, _ = replay_batch(requires_grad=True)
    old = torch.where(torch.tensor([[True, True, False], [True, False, False]]), old, t(-math.inf))
    exp_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    per_token, m = replayed_term(
        logp, old, adv, exp_mask, loss_type=loss_type, replay_shaping=shaping, importance_sampling_level=level
    )
    (grad,) = torch.autograd.grad(
        aggregate_loss(per_token, ALL_2x3, loss_type=loss_type, max_completion_length=3), logp
    )
    assert torch.isfinite(per_token).all() and torch.isfinite(grad).all()
    assert (grad[exp_mask == 0] == 0).all()
    assert all(torch.isfinite(value) for name, value in m.items() if name not in ("ratio_min", "ratio_max"))


def test_nothing_replayed_gives_zero_and_neutral_extremes():
    logp = t([[-0.3, -0.4]]).requires_grad_()
    for loss_type in LOSS_TYPES:
        per_token, m = replayed_term(
            logp, t([[math.nan, -math.inf]]), t([1.0]), torch.zeros(1, 2), loss_type=loss_type
        )
        assert (per_token == 0).all()
        (grad,) = torch.autograd.grad(per_token.sum(), logp)
        assert (grad == 0).all()
        assert m["replayed_tokens"].item() == 0.0 and m["loss_sum"].item() == 0.0
        assert m["ratio_min"].item() == math.inf and m["ratio_max"].item() == -math.inf


def test_exgrpo_gradient_single_token():
    a, beta, logp0, old0 = 0.8, 0.1, -0.3, -1.0
    w = math.exp(logp0 - old0)
    logp = t([[logp0]]).requires_grad_()
    per_token, _ = replayed_term(
        logp, t([[old0]]), t([a]), torch.ones(1, 1), replay_shaping="exgrpo", replay_shaping_beta=beta
    )
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    close(grad, [[-a * beta * w / (w + beta) ** 2]])  # d/dlogp of -A w / (w + beta), dw/dlogp = w


def test_clip_gradient_zero_when_clipped():
    # A = -2, ratios e^5 (dual clip), 2.5 (unclipped: -A r), 0.5 (clipped low).
    logp = t([[-0.7 + 5.0, -3.0 + math.log(2.5), -1.2 + math.log(0.5)]]).requires_grad_()
    per_token, _ = replayed_term(logp, t([[-0.7, -3.0, -1.2]]), t([-2.0]), torch.ones(1, 3), loss_type="grpo")
    close(per_token, [[6.0, 5.0, 1.6]])
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    close(grad, [[0.0, 2.0 * 2.5, 0.0]])


def test_every_trl_loss_type_has_a_registered_formula_and_a_new_one_can_be_added(monkeypatch):
    from trl_exreplay import loss

    assert set(loss.OFF_POLICY_LOSSES) == set(LOSS_TYPES) and set(loss.OFF_POLICY_SHAPINGS) == {"clip", "exgrpo"}
    monkeypatch.setattr(loss, "OFF_POLICY_LOSSES", dict(loss.OFF_POLICY_LOSSES))

    @loss.register_off_policy_loss("grpo")
    def reinforce(ratio, advantages, logps, raw_log_ratio, replayed_f, options):
        return -advantages * logps, torch.zeros_like(logps, dtype=torch.bool), ratio

    logp, old, adv, mask = replay_batch()
    per_token, m = replayed_term(logp, old, adv, mask, loss_type="grpo")
    close(per_token, -t(REPLAY_ADV).unsqueeze(1) * logp)
    assert m["clipped_tokens"].item() == 0.0


def test_errors():
    logp, old, adv, mask = replay_batch()
    with pytest.raises(ValueError, match=r"loss_type 'ppo'.*'grpo'.*'vespo'"):
        replayed_term(logp, old, adv, mask, loss_type="ppo")
    with pytest.raises(ValueError, match=r"replay_shaping.*'clip'.*'exgrpo'"):
        replayed_term(logp, old, adv, mask, replay_shaping="sapo")
    with pytest.raises(ValueError, match=r"importance_sampling_level.*'token'.*'sequence'"):
        replayed_term(logp, old, adv, mask, importance_sampling_level="row")
    with pytest.raises(ValueError, match="exp_mask"):
        replayed_term(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="behaviour_logps"):
        replayed_term(logp, old[:1], adv, mask)


# --------------------------------------------------------------------------------------------------------------------
# aggregate_loss: TRL 1.16's normaliser of each loss type
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, ((1.0 + 2.0 + 3.0) / 3 + 4.0 / 1) / 2),
        ("sapo", {}, ((1.0 + 2.0 + 3.0) / 3 + 4.0 / 1) / 2),
        ("bnpo", {}, (1.0 + 2.0 + 3.0 + 4.0) / 4),
        ("dr_grpo", {"max_completion_length": 5}, (1.0 + 2.0 + 3.0 + 4.0) / (2 * 5)),
        ("dapo", {}, (1.0 + 2.0 + 3.0 + 4.0) / 4),
        ("dapo", {"loss_normalizer": 2.5}, (1.0 + 2.0 + 3.0 + 4.0) / 2.5),
        ("cispo", {"loss_normalizer": torch.tensor(8.0)}, (1.0 + 2.0 + 3.0 + 4.0) / 8),
        ("vespo", {"loss_normalizer": 5.0}, (1.0 + 2.0 + 3.0 + 4.0) / 5),
        ("luspo", {}, ((1.0 + 2.0 + 3.0) + 4.0) / 2),
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
    with pytest.raises(ValueError, match=r"loss_type 'ppo'.*'grpo'.*'luspo'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), loss_type="dr_grpo")
