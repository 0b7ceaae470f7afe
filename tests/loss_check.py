"""`CheckingTrainer`: an `ExReplayGRPOTrainer` that recomputes every replaying loss from its two parts, TRL's
`GRPOTrainer._compute_loss` on the batch with the replayed rows at advantage 0 and the replayed tokens' term of
`trl_exreplay.loss`, each from a forward of its own, before training on it. Shared by the tests of each path that
replays (single turn under every TRL option, TRL's tool loop, a `rollout_func`, our multi-turn games, PEFT).

It checks the glue (which rows TRL sees at advantage 0, which options reach `loss.py`, the normaliser), not the
formulas: those are pinned by hand in `tests/unit/test_loss.py`, and the whole objective, value and gradient, is written
out without `loss.py` in `tests/integration/test_replayed_loss.py`."""

from __future__ import annotations

import copy
import shutil

import torch
from trl import GRPOTrainer

from trl_exreplay import ExReplayGRPOTrainer
from trl_exreplay.loss import TOKEN_SUM_LOSS_TYPES, OffPolicyOptions, aggregate_loss, off_policy_loss

# TRL's adaptive-entropy controller state, which its `_compute_loss` updates.
TRL_STATE = ("entropy_coef", "_entropy_window_stats", "_last_world_entropy")


class CheckingTrainer(ExReplayGRPOTrainer):
    """Recomputes each replaying loss from its parts (TRL's loss, `off_policy_loss`) before training on it."""

    checks: list  # (the trainer's loss, TRL's part, the replayed term, replayed tokens), per replaying call

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checks = []

    def _compute_loss(self, model, inputs):
        parts = self._loss_terms(model, inputs) if self._replays(inputs) else None  # before the controller moves
        loss = super()._compute_loss(model, inputs)
        if parts is not None:
            self.checks.append((loss.detach(), *parts))
        return loss

    @torch.no_grad()
    def _loss_terms(self, model, inputs):
        mode = "train"
        saved = {name: copy.copy(getattr(self, name, None)) for name in TRL_STATE}
        metrics = {name: list(values) for name, values in self._metrics[mode].items()}
        advantages = inputs["advantages"]
        replayed_rows = inputs["exp_mask"].bool().any(-1)
        zeroed = {**inputs, "advantages": torch.where(replayed_rows, 0.0, advantages)}
        trl_loss = GRPOTrainer._compute_loss(self, model, zeroed)  # TRL's own, unchanged by us
        for name, value in saved.items():  # undo the controller's and the logs' side effects of that extra call
            setattr(self, name, value)
        self._metrics[mode].clear()
        self._metrics[mode].update(metrics)

        mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            self, model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True
        )
        args = self.args
        behaviour = inputs["recorded_per_token_logps"] if args.replay_importance_sampling else logps
        selection = None
        if args.top_entropy_quantile < 1:
            selection = GRPOTrainer.get_high_entropy_mask(self, entropies, mask, 1 - args.top_entropy_quantile)
        # The option mapping is the trainer's (that each option reaches `loss.py` as it should is checked by hand in
        # tests/integration/test_replayed_loss.py); this check is of the composition: the rows, the selection, the normaliser.
        options = OffPolicyOptions.from_config(
            args, self.settings, loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            epsilon_low=self.epsilon_low, off_policy_mask_threshold=self.off_policy_mask_threshold,
        )  # fmt: skip
        per_token, _ = off_policy_loss(
            logps, behaviour, advantages, inputs["exp_mask"] * mask, options, token_mask=selection
        )
        accumulation = self.current_gradient_accumulation_steps
        if args.loss_type in TOKEN_SUM_LOSS_TYPES:
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            normalizer = normalizer * accumulation / args.steps_per_generation
            term = aggregate_loss(per_token, mask, loss_type=args.loss_type, loss_normalizer=normalizer)
        else:
            term = aggregate_loss(
                per_token, mask, loss_type=args.loss_type, max_completion_length=self.max_completion_length
            )
            term = term / accumulation
        return trl_loss, term, int((inputs["exp_mask"] * mask).sum())


def assert_replaying_losses_compose(trainer: CheckingTrainer) -> None:
    """Every replaying loss was TRL's part plus the replayed term, some replayed tokens counted, not all for 0."""
    assert trainer.checks, "no replaying loss call"
    for loss, trl_loss, term, _ in trainer.checks:
        torch.testing.assert_close(loss, trl_loss + term, atol=1e-6, rtol=1e-6)
    assert sum(replayed_tokens for *_, replayed_tokens in trainer.checks) > 0
    assert any(abs(term.item()) > 1e-4 for _, _, term, _ in trainer.checks), "the replayed term never counted"


# Long enough for some completions to end (EOS) rather than be cut: `mask_truncated_completions` keeps those.
LENGTH = {"max_completion_length": 8}


def build_filled_pool(folder):
    """The tiny model saved (a path, so that TRL can load it again as the reference model when beta > 0), and a pool
    from 4 steps of training that fill it and replay nothing: `folder/model`, `folder/pool`."""
    from helpers import make_trainer

    from trl_exreplay.demo.examples import VOCABULARY
    from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(VOCABULARY)
    build_tiny_model(tokenizer, seed=0).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    # On the CPU whatever device the tests train on: the pool is the tests' input, and sampling on another device
    # draws other completions (on CUDA every stored one could be truncated, and mask_truncated_completions would
    # leave the replayed term nothing to check).
    trainer = make_trainer(
        folder / "fill", model=str(folder / "model"), max_steps=4, replay_start_ratio=1.0, use_cpu=True, **LENGTH
    )
    trainer.train()
    assert trainer.pool.num_trajectories >= 2
    trainer.pool.save(str(folder / "pool"))
    return folder


def train_replaying(tmp_path, filled, trainer_cls, **options):
    """`trainer_cls` from the model and a copy of the pool of `build_filled_pool`, 2 steps that both replay."""
    from helpers import make_trainer

    from trl_exreplay.pool import ExperiencePool

    shutil.copytree(filled / "pool", tmp_path / "pool")
    pool = ExperiencePool.load(str(tmp_path / "pool"), work_dir=str(tmp_path / "pool-work"))
    trainer = make_trainer(
        tmp_path,
        trainer_cls,
        model=str(filled / "model"),
        trainer_kwargs={"experience_pool": pool},
        **{"max_steps": 2, "replay_start_ratio": 0.0, **LENGTH, **options},
    )
    trainer.checks = []
    trainer.train()
    return trainer
