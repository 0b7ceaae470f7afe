"""Every group teaching (the library's defaults) in the trainer, part by part, on the say-the-word task with a tiny model: rescue
(`replay_rescue`: an all-fail fresh group gets a stored success, and TRL's advantages are computed over the group
that results) and retired questions with revisits (`replay_revisit_ratio`). Two-process runs of the defaults (DDP and
ZeRO-3, resumed) are in tests/distributed/test_multiprocess.py."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import TEACH, make_trainer

from trl_exreplay import ExReplayGRPOTrainer
from trl_exreplay.demo.examples import VOCABULARY, said_target
from trl_exreplay.demo.tiny import save_tiny_model

G = 4


class StepRecordingTrainer(ExReplayGRPOTrainer):
    """Keeps each training generation batch's output, rescued and revisited rows, row tasks and the skip set it was
    planned with, and the outcomes it queued."""

    def _finish_generation(self, output, step):
        super()._finish_generation(output, step)
        self.steps = getattr(self, "steps", []) + [
            dict(
                output={k: v.clone() if torch.is_tensor(v) else v for k, v in output.items()},
                rescued=dict(step.rescued),
                revisited=set(step.revisited),
                row_tasks=list(step.row_tasks),
                replay_groups=dict(step.plan.replay_groups),
                outcomes=list(self._replay.pending.outcomes),
                skip_set=set(self._retired_before),
            )
        ]

    def _plan_generation(self, inputs):
        step = super()._plan_generation(inputs)
        self._retired_before = set(self.pool.skip_set)  # the pool as the plan read it (outcomes flushed first)
        return step


def test_an_all_fail_group_is_rescued_by_a_stored_success_and_trained_as_replayed(tmp_path):
    """replay_ratio 0: only rescue puts stored rows in. Each rescued group's last row holds the stored success's
    tokens, is marked replayed (its recorded log-probs, advantage 0 in TRL's loss), and TRL's advantages are those of
    the group with that row's recorded reward 1 among 3 failures: (1 - 1/4) / (0.5 + 1e-4) for it, (0 - 1/4) / (0.5 +
    1e-4) for the others (the group's unbiased std is 0.5). The pool counts the group as it was: 0 successes of 4."""
    trainer = make_trainer(tmp_path, trainer_cls=StepRecordingTrainer, max_steps=10, replay_rescue=1,
                           replay_ratio=0.0, learning_rate=5e-2)  # fmt: skip
    trainer.train()
    rescued_groups = 0
    for step in trainer.steps:
        output = step["output"]
        for row, trajectory in step["rescued"].items():
            rescued_groups += 1
            group = row // G
            assert row == group * G + G - 1  # the group's last row
            n = len(trajectory.completion_ids)
            assert output["completion_ids"][row, :n].tolist() == trajectory.completion_ids
            assert output["completion_mask"][row].sum() == n
            assert output["exreplay_replayed"][row] == 1 and output["exp_mask"][row, :n].tolist() == [1] * n
            assert torch.equal(output["recorded_per_token_logps"][row, :n], torch.tensor(trajectory.logps))
            expected = torch.tensor([-0.25, -0.25, -0.25, 0.75]) / (0.5 + 1e-4)
            assert torch.allclose(output["advantages"][group * G : group * G + G], expected, atol=1e-6)
            task = step["row_tasks"][row]
            assert (task, 0, G, []) in [tuple(o) for o in step["outcomes"]]
    assert rescued_groups >= 2
    logged = [e["replay/rescued_groups"] for e in trainer.state.log_history if "replay/rescued_groups" in e]
    assert sum(logged) == rescued_groups
    assert [e for e in trainer.state.log_history if e.get("replay/rows_fraction")] == []  # nothing planned


@pytest.mark.parametrize(
    "start",
    [
        {},
        {"replay_start": "solved", "replay_start_solved_fraction": 0.99, "replay_revisit_ratio": 1.0, "max_steps": 24},
    ],
    ids=["steps", "solved-never"],
)
def test_retired_questions_are_revisited_and_a_failed_revisit_returns(tmp_path, start):
    """replay_revisit_ratio 0.5: about half the draws of a retired task are let through. A revisited group holds its
    retired task (not redirected); a revisit that any fresh rollout fails takes its task out of the skip set, also
    under ExGRPO's start rule before replay starts (when only solved outcomes are otherwise recorded)."""
    trainer = make_trainer(tmp_path, trainer_cls=StepRecordingTrainer, **TEACH, learning_rate=5e-2,
                           **{"max_steps": 16, "replay_revisit_ratio": 0.5, **start})  # fmt: skip
    trainer.train()
    revisits, returned = 0, []
    for before, after in zip(trainer.steps, trainer.steps[1:]):
        back = set()
        for group in before["revisited"]:
            revisits += 1
            task = before["row_tasks"][group * G]
            assert task in before["skip_set"]
            outcome = [o for o in before["outcomes"] if o[0] == task][-1]  # its last group in the batch decides
            if outcome[1] < outcome[2]:  # failed by a fresh rollout: back in the fresh stream
                back.add(task)
                assert task not in after["skip_set"]
        returned.append(len(back))
    assert revisits >= 2 and sum(returned) >= 1
    logged = [e["replay/revisited_groups"] for e in trainer.state.log_history if "replay/revisited_groups" in e]
    assert sum(logged[:-1]) == revisits  # the last batch has no next one to check against
    returns = [e.get("replay/returned_tasks", 0.0) for e in trainer.state.log_history if "loss" in e]
    assert returns[:-1] == returned


def test_rescue_with_a_kl_term_is_off_and_says_so(tmp_path, caplog):
    save_tiny_model(str(tmp_path / "model"), VOCABULARY, seed=0)  # beta > 0: TRL loads the reference from a path
    with caplog.at_level(logging.WARNING, logger="trl_exreplay"):
        trainer = make_trainer(tmp_path, model=str(tmp_path / "model"), max_steps=2, replay_rescue=1, beta=0.1)
    assert "replay_rescue=1 is off" in caplog.text
    trainer.train()
    assert not any("replay/rescued_groups" in e for e in trainer.state.log_history)


@pytest.mark.parametrize("settings", [{}, TEACH], ids=["defaults", "teach"])
def test_a_threshold_every_rollout_passes_is_said_once(tmp_path, caplog, settings):
    """An always-1 format reward beside the task's: every rollout's total is at least 1, the default threshold, so
    every task would be "solved", nothing stored but the one success rescue keeps of a solved task; the trainer says so
    once, naming the field and the totals, and what follows from it under these settings."""

    def format_reward(completions, **kwargs):
        return [1.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="trl_exreplay"):
        trainer = make_trainer(tmp_path, max_steps=3, reward_funcs=[said_target, format_reward], **settings)
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "counted as a success" in r.getMessage()]
    assert len(said) == 1 and "replay_success_threshold=1" in said[0] and "ranged 1-2" in said[0]
    # what follows from it: the success kept for rescue (a default), and, with retirement, its revisits
    assert "(but the 1 success a solved task keeps for rescue, replay_rescue=1)" in said[0]
    retired = "it is retired: it comes back only as a revisit (replay_revisit_ratio=0.5 of its draws)"
    assert (retired in said[0]) == bool(settings) and ("retired" in said[0]) == bool(settings)
    # every task is "solved" from the first batch: nothing is replayed, and each keeps only the one success rescue
    # keeps of a solved task (replay_rescue=1, the default)
    assert trainer.pool.skip_set and trainer.pool.num_trajectories == len(trainer.pool.skip_set)


def test_a_format_reward_that_retires_every_question_stops_the_run_after_the_step_it_names(tmp_path, caplog):
    """Without revisits, every question retired after the first batch (an always-1 format reward): the run says it
    stops after the step that trains the last batch, and does: that step's two micro-batches (gradient accumulation)
    and its optimizer step run, so every row of the batch is trained and nothing is left uncaptured."""

    def format_reward(completions, **kwargs):
        return [1.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="trl_exreplay"):
        trainer = make_trainer(tmp_path, max_steps=20, reward_funcs=[said_target, format_reward],
                               replay_revisit_ratio=0.0, gradient_accumulation_steps=2, **TEACH,
                               per_device_train_batch_size=8)  # fmt: skip
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "every training question is retired" in r.getMessage()]
    assert len(said) == 1
    assert (
        f"training stops after step {trainer.state.global_step} of max_steps=20, once this batch is trained" in said[0]
    )
    assert "set replay_revisit_ratio above 0" in said[0] and "set replay_success_threshold" in said[0]
    assert "it is retired for good: training stops once every question is" in caplog.text  # said at the first batch
    assert 1 < trainer.state.global_step < 20
    assert trainer._faults.totals["uncaptured_rows"] == 0 and "not stored" not in caplog.text
    assert len([e for e in trainer.state.log_history if "loss" in e]) == trainer.state.global_step


def test_the_run_says_once_at_its_start_what_replay_changes(tmp_path, caplog):
    """The defaults: rescue and the spread plan from step 1, replay from the step replay_start_ratio names (0.3 of 6
    steps: the third, the first whose `replay/started` is 1), and how to train as GRPOTrainer."""
    with caplog.at_level(logging.WARNING, logger="trl_exreplay"):
        trainer = make_trainer(tmp_path, max_steps=6)
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "experience replay changes training" in r.getMessage()]
    assert said == [
        "trl_exreplay: experience replay changes training from GRPOTrainer's. From step 1: an all-fail group gets 1 "
        "stored success of its task in place of its last failed rollout (replay_rescue=1); the batch's groups go to the "
        "tasks most likely to have a reward spread, by estimates learnt from every fresh group (replay_spread_plan=True, "
        "10% of the groups kept as drawn). From step 3 of 6 (replay_start_ratio=0.3): 50% of the groups train on 1 "
        "stored success among their 4 rows (replay_ratio=0.5). TRL's reward and completion metrics stay the fresh "
        "rollouts'; what the loss trained on is under replay/*. GRPOTrainer exactly: enable_experience_replay=False; "
        "GRPOTrainer until replay starts: replay_rescue=0, replay_spread_plan=False."
    ]
    started = [e["replay/started"] for e in trainer.state.log_history if "replay/started" in e]
    assert started.index(1.0) + 1 == 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_exreplay"):
        make_trainer(tmp_path / "off", max_steps=2, enable_experience_replay=False).train()
    assert "experience replay changes training" not in caplog.text  # GRPOTrainer: nothing to say
