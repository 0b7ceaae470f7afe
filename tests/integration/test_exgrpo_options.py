"""ExGRPO's recipe in the trainer, option by option (`replay_start="solved"`, `replay_retire_solved`,
`replay_count_replayed_successes`, `replay_unclipped_fresh`), on the say-the-word task with a tiny model.
Multi-process runs of the whole profile (DDP and ZeRO-3, resumed) are in test_multiprocess.py. ExGRPO has no rescue and
never revisits a retired question: the tests turn the library's defaults for those off."""

from __future__ import annotations

import torch
from helpers import REPLAY_ONLY, RecordingTrainer, losses, make_args, make_trainer
from trl import GRPOConfig, GRPOTrainer

from trl_exreplay import ExReplayGRPOTrainer
from trl_exreplay.demo.examples import said_target


def fresh_rewards(trainer) -> list[float]:
    return [e["replay/fresh_reward"] for e in trainer.state.log_history if "replay/fresh_reward" in e]


def test_replay_starts_after_the_first_batch_that_succeeds_often_enough(tmp_path):
    """ExGRPO's timing: batch s (the first whose fresh rollouts succeed > 35%) starts replay; batch s + 1 is the first
    whose successes enter the pool; batch s + 2 is the first that can replay. Before, only the skip set fills."""
    trainer = make_trainer(tmp_path, trainer_cls=RecordingTrainer, max_steps=12, replay_start="solved", **REPLAY_ONLY)
    trainer.train()
    rates = fresh_rewards(trainer)
    start = next(step for step, rate in enumerate(rates) if rate > 0.35)
    assert 0 < start < 9, rates  # the test sees steps before and after the start
    assert trainer._replay.schedule.started_at == start
    started = [e["replay/started"] for e in trainer.state.log_history if "replay/started" in e]
    assert started == [0.0] * (start + 1) + [1.0] * (12 - start - 1)
    pool_sizes = [e["replay/pool_trajectories"] for e in trainer.state.log_history if "replay/pool_trajectories" in e]
    tasks = [e["replay/tasks"] for e in trainer.state.log_history if "replay/tasks" in e]
    # logged after each batch's plan, before its outcomes: empty up to batch s + 1, filled at s + 2
    assert pool_sizes[: start + 2] == [0.0] * (start + 2) and pool_sizes[start + 2] > 0
    assert tasks[: start + 2] == [0.0] * (start + 2) and max(tasks[start + 2 :]) > 0
    for step, (_, pool_before) in enumerate(trainer.batches[: start + 2]):
        assert pool_before == {}, step  # nothing stored before batch s + 2 planned
    assert trainer.pool.buckets()  # buckets exist once collection started


def test_before_the_start_only_solved_tasks_are_recorded(tmp_path):
    """A threshold no batch reaches: the run never replays nor stores, but its solved tasks fill the skip set."""
    options = dict(replay_start="solved", replay_start_solved_fraction=0.999, **REPLAY_ONLY)
    trainer = make_trainer(tmp_path, max_steps=8, **options)
    trainer.train()
    assert trainer._replay.schedule.started_at is None
    assert trainer.pool.num_trajectories == 0 and trainer.pool.buckets() == {}
    assert trainer.pool.skip_set  # the tiny model solves some task in 8 steps
    assert not any(e.get("replay/tasks") for e in trainer.state.log_history)


class RetirementTrainer(ExReplayGRPOTrainer):
    """Records, for every generation batch, the skip set it was planned with and its task groups after redirection."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, redirect = [], self._replay._redirect_retired

        def recording(inputs, row_keys, *rest):
            skip_set = set(self.pool.skip_set)
            inputs, row_keys, revisits = redirect(inputs, row_keys, *rest)
            self.seen.append((skip_set, row_keys[::4], len(inputs)))
            return inputs, row_keys, revisits

        self._replay._redirect_retired = recording


def test_retired_questions_leave_the_fresh_stream(tmp_path):
    """From the batch after a task entered the skip set, no group holds it; every batch keeps its 16 rows; a retired
    task never comes back (the dataset repeats its 4 tasks 8 times an epoch, as the evidence harness's datasets do)."""
    trainer = make_trainer(
        tmp_path, trainer_cls=RetirementTrainer, num_tasks=4, max_steps=24, replay_retire_solved=True,
        replay_revisit_ratio=0.0, replay_rescue=0,
    )  # fmt: skip
    trainer.train()
    assert len(trainer.seen) == trainer.state.global_step > 12  # (it may stop early: every question retired)
    for step, (retired, group_keys, rows) in enumerate(trainer.seen):
        assert rows == 16
        if len(retired) == 4:  # every question retired: this batch (of retired tasks) is the run's last
            assert step == len(trainer.seen) - 1
            continue
        assert not set(group_keys) & retired, (step, retired, group_keys)
    sets = [retired for retired, _, _ in trainer.seen]
    assert all(a <= b for a, b in zip(sets, sets[1:]))  # only grows
    assert len(sets[-1]) >= 2  # the test saw questions retire
    assert trainer.pool.skip_set and set(trainer.pool.skip_set) >= sets[-1]
    redirected = [e["replay/redirected_groups"] for e in trainer.state.log_history if "replay/redirected_groups" in e]
    assert sum(redirected) > 0


def test_when_every_question_is_retired_the_run_says_so_and_stops(tmp_path, caplog):
    trainer = make_trainer(
        tmp_path, num_tasks=1, max_steps=60, replay_retire_solved=True, replay_revisit_ratio=0.0, learning_rate=5e-2
    )
    trainer.train()
    assert trainer.pool.skip_set == ["task-0"]
    assert trainer.state.global_step < 60
    assert "every training question is retired" in caplog.text
    assert f"training stops after step {trainer.state.global_step}" in caplog.text


class OutcomeTrainer(ExReplayGRPOTrainer):
    def _flush_pending(self):
        pending = self._replay.pending
        super()._flush_pending()
        if pending is not None:
            self.outcomes = getattr(self, "outcomes", []) + [(pending.outcomes, self._last_plan)]

    def _finish_generation(self, output, step):
        self._last_plan = step.plan, list(step.row_tasks)
        super()._finish_generation(output, step)


def test_a_replayed_tasks_bucket_counts_its_replayed_success(tmp_path):
    """G = 4, k = 1: with the option a replayed task's outcome counts 4 rollouts, its replayed success among them
    (ExGRPO's s + k); without it, its 3 fresh rollouts. Tasks that are not replayed count their 4 fresh ones."""
    for counted in (False, True):
        trainer = make_trainer(
            tmp_path / str(counted), trainer_cls=OutcomeTrainer, max_steps=8, replay_count_replayed_successes=counted
        )
        trainer.train()
        replayed_outcomes = 0
        for outcomes, (plan, row_tasks) in trainer.outcomes:
            replayed_groups = set(plan.replay_groups)
            assert [task for task, *_ in outcomes] == row_tasks[::4]  # one outcome per group of 4, in batch order
            for group, (_task, successes, counted_rows, winners) in enumerate(outcomes):
                if group in replayed_groups:
                    replayed_outcomes += 1
                    assert counted_rows == (4 if counted else 3)
                    assert successes >= (len(winners) + 1 if counted else len(winners))
                else:
                    assert counted_rows == 4 and successes == len(winners)
        assert replayed_outcomes >= 3


def test_unclipped_fresh_tokens_are_trls_loss_without_its_clip(tmp_path):
    """Replay started but replaying no group (replay_ratio 0) leaves TRL's loss alone; with replay_unclipped_fresh it
    is TRL's loss with an infinite clip range: the same losses and weights as GRPOTrainer at epsilon 1e9, bit for bit,
    where two iterations per generation move the ratio off 1 (and the clipped run differs)."""
    common = dict(max_steps=4, num_iterations=2, learning_rate=5e-2)
    replay = dict(replay_ratio=0.0, replay_start_ratio=0.0, **REPLAY_ONLY)
    unclipped = make_trainer(tmp_path / "ours", replay_unclipped_fresh=True, **replay, **common)
    unclipped.train()
    clipped = make_trainer(tmp_path / "clipped", **replay, **common)
    clipped.train()
    args = make_args(tmp_path / "trl", GRPOConfig, epsilon=1e9, epsilon_high=1e9, **common)
    theirs = make_trainer(tmp_path / "trl", trainer_cls=GRPOTrainer, args=args, reward_funcs=said_target)
    theirs.train()
    assert losses(unclipped) == losses(theirs)
    for (name, ours), (_, their) in zip(unclipped.model.named_parameters(), theirs.model.named_parameters()):
        assert torch.equal(ours, their), name
    assert losses(clipped) != losses(unclipped)
    assert (unclipped.epsilon_low, unclipped.epsilon_high) == (0.2, 0.2)  # restored after each loss
    clip_ratios = [e["clip_ratio/region_mean"] for e in clipped.state.log_history if "clip_ratio/region_mean" in e]
    assert max(clip_ratios) > 0  # the clip did act in the clipped run
