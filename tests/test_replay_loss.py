"""Replay under each TRL option it supports (issue 25, point 3; the "yes" rows of docs/support.md).

Each case trains 2 steps with replay on from a pool filled beforehand, so both steps replay. At every replaying loss
call the test checks, on the very batch the trainer was given, that the trainer's loss is

    TRL's `GRPOTrainer._compute_loss` on the batch with the replayed rows at advantage 0
    + the replayed tokens' term of `trl_exreplay.loss.off_policy_loss`, reduced by `aggregate_loss`,

both recomputed here from a forward of their own, that the replayed term is not zero, and that TRL's own metrics
(its `clip_ratio/*` among them) are logged on replaying steps. The objective itself, value and gradient, is written out
by hand in `tests/test_replay_objective.py`.
"""

from __future__ import annotations

import math

import pytest
from loss_check import CheckingTrainer, assert_replaying_losses_compose, train_replaying

# (name, options): every loss type, and the options that change what a replayed token gets.
CASES = [
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


@pytest.mark.parametrize("name, options", CASES, ids=[name for name, _ in CASES])
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
