"""ExReplayGRPOTrainer against TRL's GRPOTrainer over a grid of TRL options (issue 25, point 2).

With replay off, and with replay on before anything is replayed (``replay_start_ratio=1.0``: the pool fills, nothing
is drawn from it; rescue and retired questions off, `REPLAY_ONLY`: by design they act from the first step), the trainer must train exactly as TRL does from the same model, data and seed: the same losses,
the same weights after the steps (so the same gradients), and every metric TRL logs, under the same name, with the
same value (bit-equal on CPU). Replay adds only its own ``replay/*`` metrics.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import REPLAY_ONLY, make_args, make_trainer
from trl import GRPOConfig, GRPOTrainer

from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer
from trl_exreplay.demo.examples import VOCABULARY
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

# (name, TRL options), each checked with replay off and with replay on before anything is replayed.
GRID = [
    *((f"loss_type={t}", {"loss_type": t}) for t in TRL_LOSS_TYPES),
    *((f"loss_type={t}, beta=0.04", {"loss_type": t, "beta": 0.04}) for t in TRL_LOSS_TYPES),
    ("kl bias correction", {"beta": 0.04, "use_bias_correction_kl": True}),
    ("top_entropy_quantile=0.5, entropy_coef=0.5", {"top_entropy_quantile": 0.5, "entropy_coef": 0.5}),
    ("entropy_coef=0.1, dapo", {"entropy_coef": 0.1, "loss_type": "dapo"}),
    ("gradient_accumulation_steps=2", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 8}),
    ("num_iterations=2", {"num_iterations": 2}),
    ("steps_per_generation=2", {"steps_per_generation": 2, "per_device_train_batch_size": 8}),
    ("mask_truncated_completions", {"mask_truncated_completions": True}),
    ("scale_rewards=batch", {"scale_rewards": "batch"}),
    ("epsilon_high=0.28", {"epsilon_high": 0.28}),
    ("importance_sampling_level=sequence", {"importance_sampling_level": "sequence"}),
    ("delta=1.5", {"delta": 1.5}),
    ("off_policy_mask_threshold=0.5", {"off_policy_mask_threshold": 0.5}),
    ("use_adaptive_entropy", {"use_adaptive_entropy": True}),
]
STEPS = 3


def _trained(tmp_path, model_dir, trainer_cls=ExReplayGRPOTrainer, **options):
    """`trainer_cls` trained from the tiny model saved at `model_dir` (a path, so that TRL can load it again as the
    reference model when beta > 0)."""
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else ExReplayGRPOConfig
    args = make_args(tmp_path, config_cls, max_steps=STEPS, learning_rate=1e-2, **options)
    trainer = make_trainer(tmp_path, trainer_cls, args, model=model_dir)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    build_tiny_model(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _logged(trainer) -> list[dict]:
    return [
        {k: v for k, v in entry.items() if k not in ("step_time", "train_runtime")}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]


def _assert_same_as_trl(ours, theirs) -> None:
    mine, trl = _logged(ours), _logged(theirs)
    assert len(mine) == len(trl) == STEPS
    for step, (a, b) in enumerate(zip(mine, trl)):
        missing = sorted(set(b) - set(a))
        assert not missing, f"step {step}: TRL's metrics {missing} are not logged"
        for name, value in b.items():
            same = a[name] == value or (math.isnan(a[name]) and math.isnan(value))
            assert same, f"step {step}: {name} = {a[name]!r}, TRL: {value!r}"
        extra = sorted(k for k in set(a) - set(b) if not k.startswith(("replay/", "env/")))
        assert not extra, f"step {step}: metrics {extra} are not TRL's nor replay's"
    for (name, mine_param), (_, trl_param) in zip(ours.model.named_parameters(), theirs.model.named_parameters()):
        assert torch.equal(mine_param, trl_param), name


@pytest.mark.parametrize("name, options", GRID, ids=[name for name, _ in GRID])
def test_equal_to_trl_with_replay_off_and_before_replay_starts(tmp_path, model_dir, name, options):
    theirs = _trained(tmp_path / "trl", model_dir, GRPOTrainer, **options)
    off = _trained(tmp_path / "off", model_dir, enable_experience_replay=False, **options)
    _assert_same_as_trl(off, theirs)
    on = _trained(tmp_path / "on", model_dir, replay_start_ratio=1.0, **REPLAY_ONLY, **options)
    _assert_same_as_trl(on, theirs)
    assert any("replay/fresh_reward" in entry for entry in _logged(on))  # the pool was fed meanwhile
