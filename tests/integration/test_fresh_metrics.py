"""TRL's metrics keep `GRPOTrainer`'s meaning under replay (issue 70): `reward`, `reward_std`, the per-function rewards,
`frac_reward_zero_std` and the completion lengths are the fresh rollouts' (a rescued row with its own failed reward, a
replayed row left out), so that a curve against a GRPO baseline compares policies; what the loss trained on is under
`replay/trained_reward` and `replay/zero_std_trained`. And `metrics.trl_reward_metrics`, which computes those figures,
gives TRL's own values over TRL's options."""

from __future__ import annotations

import math

import pytest
from helpers import make_args, make_trainer
from trl import GRPOConfig, GRPOTrainer

from trl_exreplay import ExReplayGRPOTrainer
from trl_exreplay.demo.examples import said_target
from trl_exreplay.metrics import trl_reward_metrics

G = 4


def length_reward(completions, **kwargs) -> list[float]:
    """A reward with a spread of values (not only 0 and 1), for the standard deviations."""
    return [len(c[0]["content"]) / 7.0 for c in completions]


def said_target_or_none(completions, target, **kwargs) -> list[float | None]:
    """`said_target`, but None for every third row: with no other function those rows are unscorable to TRL."""
    return [None if i % 3 == 0 else r for i, r in enumerate(said_target(completions, target))]


class ComparingTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer`, which after each generation batch compares the reward figures TRL logged with
    `trl_reward_metrics` over the same gathered rewards."""

    compared: list

    def _calculate_rewards(self, *args):
        self.scored = super()._calculate_rewards(*args)
        return self.scored

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        figures = trl_reward_metrics(self.scored, self.reward_weights, self.reward_func_names, self.num_generations,
                                     self.scale_rewards, self.multi_objective_aggregation)  # fmt: skip
        logged = self._metrics["train"]
        self.compared = getattr(self, "compared", []) + [{name: (v, logged[name][-1]) for name, v in figures.items()}]
        return output


OPTIONS = [
    ("two functions, weighted", dict(reward_funcs=[said_target, length_reward], reward_weights=[1.0, 0.5])),
    ("scale_rewards=batch", dict(reward_funcs=[said_target, length_reward], scale_rewards="batch")),
    ("scale_rewards=none", dict(reward_funcs=[said_target, length_reward], scale_rewards="none")),
    ("normalize_then_sum", dict(reward_funcs=[said_target, length_reward], multi_objective_aggregation="normalize_then_sum")),
    ("unscorable rows", dict(reward_funcs=[said_target_or_none])),
]  # fmt: skip


@pytest.mark.parametrize("name, options", OPTIONS, ids=[name for name, _ in OPTIONS])
def test_the_reward_figures_are_trls_own(tmp_path, name, options):
    reward_funcs = options.pop("reward_funcs")
    args = make_args(tmp_path, GRPOConfig, max_steps=3, **options)
    trainer = make_trainer(tmp_path, ComparingTrainer, args, reward_funcs=reward_funcs)
    trainer.train()
    assert len(trainer.compared) == 3
    for figures in trainer.compared:
        assert {f"rewards/{f.__name__}/mean" for f in reward_funcs} <= set(figures)
        for figure, (ours, trls) in figures.items():
            assert ours == trls or (math.isnan(ours) and math.isnan(trls)), (figure, ours, trls)


class BatchRecordingTrainer(ExReplayGRPOTrainer):
    """Keeps, per training generation batch, the rewards as scored (replayed rows: recorded), the replayed and rescued
    rows, and each row's completion length (this single-process run's rows are the batch's)."""

    def _generate(self, prompts):
        result = super()._generate(prompts)
        if self.model.training:
            self._lengths = [len(ids) for ids in result[1]]
        return result

    def _finish_generation(self, output, step):
        super()._finish_generation(output, step)
        self.batches = getattr(self, "batches", []) + [
            dict(rewards=step.rewards[:, 0].tolist(), replayed=set(step.plan.replayed_rows()),
                 rescued={row: t.rewards[0] for row, t in step.rescued.items()}, lengths=self._lengths)
        ]  # fmt: skip


def _zero_spread_share(values_per_group: list[list[float]]) -> float:
    return sum(len(set(values)) == 1 for values in values_per_group) / len(values_per_group)


def test_a_run_with_rescue_and_replay_logs_the_fresh_rows_reward_as_trls(tmp_path):
    """The library's defaults (rescue and retirement from step 1), replay from the third step: each batch's `reward`
    and `frac_reward_zero_std` are those of its fresh rows (a rescued row with its failed reward), its lengths those
    of its generated completions; the batch as trained (rescued rows holding their stored success, replayed rows their
    recorded reward) is `replay/trained_reward` and `replay/zero_std_trained`."""
    trainer = make_trainer(tmp_path, trainer_cls=BatchRecordingTrainer, max_steps=12, replay_start_ratio=0.2,
                           replay_ratio=0.5, learning_rate=5e-2)  # fmt: skip
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == len(trainer.batches) == 12
    differs = 0
    for entry, batch in zip(logged, trainer.batches):
        rows = range(len(batch["rewards"]))
        fresh = [r for r in rows if r not in batch["replayed"]]
        trained = [batch["rescued"].get(r, batch["rewards"][r]) for r in rows]
        assert entry["reward"] == pytest.approx(sum(batch["rewards"][r] for r in fresh) / len(fresh), abs=1e-6)
        assert entry["reward"] == entry["replay/fresh_reward"]  # single-turn: the same rows, the same figure
        assert entry["replay/trained_reward"] == pytest.approx(sum(trained) / len(trained), abs=1e-6)
        groups = [[batch["rewards"][r] for r in fresh if r // G == g] for g in range(len(trained) // G)]
        assert entry["frac_reward_zero_std"] == _zero_spread_share(groups)
        assert entry["replay/zero_std_trained"] == _zero_spread_share([trained[g : g + G] for g in range(0, 16, G)])
        fresh_lengths = [batch["lengths"][r] for r in fresh]
        assert entry["completions/mean_length"] == pytest.approx(sum(fresh_lengths) / len(fresh), abs=1e-6)
        assert entry["completions/max_length"] == max(fresh_lengths)
        assert entry["completions/min_length"] == min(fresh_lengths)
        differs += entry["reward"] != entry["replay/trained_reward"]
    # the run did rescue and replay, and both changed what TRL alone would have logged as `reward`
    assert sum(bool(b["rescued"]) for b in trainer.batches) >= 2
    assert sum(bool(b["replayed"]) for b in trainer.batches) >= 2
    assert differs >= 2
