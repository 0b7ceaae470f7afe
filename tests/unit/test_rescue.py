"""Rescue's parts alone (`replay_rescue`): a solved task keeps its best success in the pool, and a rescued row's
stored trajectory is spliced into TRL's generation output, tensors widened, exactly."""

import torch

from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory
from trl_exreplay.step import attach_replay_tensors, splice_rescued


def traj(task, entropy, completion=(5, 6), mask=None, logps=None, prompt=(1, 2)):
    mask = [1] * len(completion) if mask is None else mask
    logps = [-0.5] * len(completion) if logps is None else logps
    return Trajectory(task, list(prompt), list(completion), mask, logps, [1.0], 1.0, entropy, 0)


def test_a_solved_task_keeps_its_best_success_and_is_not_replayed():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(TaskOutcome("t", 2, 4, [traj("t", 0.75), traj("t", 0.25)], '{"p": 1}'), keep_solved=1)
    assert pool.num_trajectories == 2 and pool.replayable_tasks() == [("t", 2)]
    pool.record_outcome(TaskOutcome("t", 4, 4, [traj("t", 0.125)]), keep_solved=1)  # solved: the stored 0.25 stays
    assert pool.skip_set == ["t"] and pool.replayable_tasks() == []
    assert [t.entropy for t in pool.trajectories("t")] == [0.25]
    # failed again: out of the skip set, in bucket 0, its kept success replayable (and rescue's material)
    pool.record_outcome(TaskOutcome("t", 0, 4, []), keep_solved=1)
    assert pool.skip_set == [] and pool.replayable_tasks() == [("t", 0)] and pool.num_selectable("t") == 1


def test_a_task_solved_with_nothing_stored_keeps_one_of_this_outcomes_successes():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(TaskOutcome("t", 4, 4, [traj("t", 0.875), traj("t", 0.25), traj("t", 0.5)]), keep_solved=1)
    assert [t.entropy for t in pool.trajectories("t")] == [0.25] and pool.num_tasks == 1
    plain = ExperiencePool(replay_store_rbound=4)  # without rescue: a solved task leaves the store (ExGRPO's rule)
    plain.record_outcome(TaskOutcome("t", 4, 4, [traj("t", 0.9)]))
    assert plain.num_trajectories == 0


def test_a_solved_task_keeps_as_many_successes_as_rescue_puts_in():
    pool = ExperiencePool(replay_store_rbound=4)
    pool.record_outcome(TaskOutcome("t", 2, 4, [traj("t", 0.75)]), keep_solved=2)
    pool.record_outcome(TaskOutcome("t", 4, 4, [traj("t", 0.5), traj("t", 0.875), traj("t", 0.25)]), keep_solved=2)
    assert [t.entropy for t in pool.trajectories("t")] == [0.75, 0.25]  # the stored one, then this outcome's best


def test_a_rescued_row_takes_its_stored_tokens_and_widens_the_batch():
    """Two rows of a rank: row 0 stays as generated; row 1 (a failed rollout of 2 tokens under a prompt of 2) takes a
    stored success with a longer prompt (3) and completion (4, its third token the environment's)."""
    pad = 0
    output = {
        "prompt_ids": torch.tensor([[7, 8], [7, 8]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[9, 9], [4, 0]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        "tool_mask": torch.ones(2, 2, dtype=torch.long),
        "old_per_token_logps": torch.tensor([[-1.0, -1.0], [-2.0, 0.0]]),
        "advantages": torch.tensor([0.5, 1.5]),
    }
    stored = traj("t", 0.1, completion=(5, 6, 3, 2), mask=[1, 1, 0, 1], logps=[-0.25, -0.5, 0.0, -0.75],
                  prompt=(6, 7, 8))  # fmt: skip
    splice_rescued(output, {1: stored}, pad)
    assert output["prompt_ids"].tolist() == [[0, 7, 8], [6, 7, 8]]
    assert output["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert output["completion_ids"].tolist() == [[9, 9, 0, 0], [5, 6, 3, 2]]
    assert output["completion_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert output["tool_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 1]]
    assert output["old_per_token_logps"].tolist() == [[-1.0, -1.0, 0.0, 0.0], [-0.25, -0.5, 0.0, -0.75]]
    assert output["advantages"].tolist() == [0.5, 1.5]  # TRL's, computed with the rescued row's recorded reward
    attach_replay_tensors(output, {1: stored}, replaying=True)
    assert output["exreplay_replayed"].tolist() == [0, 1]
    assert output["exp_mask"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 1]]
    assert output["recorded_per_token_logps"][1].tolist() == [-0.25, -0.5, 0.0, -0.75]
