"""`outcomes.task_outcomes` and `outcomes.zero_spread_share`: a batch's outcomes, by hand, per group of G rollouts."""

import torch

from trl_exreplay.outcomes import task_outcomes, zero_spread_share
from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory


def test_a_task_in_two_groups_gives_two_outcomes_of_g():
    """G = 4, task "a" in groups 0 and 2, "b" in group 1: "a" won 4 of 4, then 3 of 4. Merged (the old count) it was
    one outcome of 7 successes in 8 rollouts; per group it is 4 of 4, then 3 of 4, in batch order."""
    tasks = ["a"] * 4 + ["b"] * 4 + ["a"] * 4
    success = [True] * 4 + [False] * 4 + [True, True, False, True]
    outcomes = task_outcomes(tasks, list(range(12)), success, group_size=4)
    assert outcomes == [("a", 4, 4, [0, 1, 2, 3]), ("b", 0, 4, []), ("a", 3, 4, [8, 9, 11])]


def test_replayed_rows_count_in_their_group_only():
    tasks = ["a"] * 8
    success = [False, False, False, True, True, False, False, True]
    # row 3 and row 7 are replayed (the last of each group of 4): they count, never win
    outcomes = task_outcomes(tasks, [0, 1, 2, 4, 5, 6], success, 4, replayed_rows=[3, 7])
    assert outcomes == [("a", 1, 4, []), ("a", 2, 4, [4])]
    assert task_outcomes(tasks, [0, 1, 2, 4, 5, 6], success, 4) == [("a", 0, 3, []), ("a", 1, 3, [4])]


def test_a_repeated_task_is_stored_where_a_merged_count_would_refuse_it():
    """The bug the per-group count fixes: at G = 8 with rbound 8, a task that won 4 of 8 in each of two groups was one
    outcome of 8 successes in 16 rollouts: bucket 8, outside ``successes < rbound``, so nothing was stored."""
    tasks, success = ["t"] * 16, [True, False] * 8
    winners_of = {row: Trajectory("t", [1], [2, 3], [1, 1], [-0.1, -0.2], [1.0], 1.0, row / 10, 0) for row in
                  range(0, 16, 2)}  # fmt: skip
    pool = ExperiencePool(replay_store_rbound=8, replay_max_trajectories_per_task=16)
    for task, successes, rollouts, winners in task_outcomes(tasks, list(range(16)), success, group_size=8):
        pool.record_outcome(TaskOutcome(task, successes, rollouts, [winners_of[r] for r in winners]))
    assert pool.bucket_of("t") == 4 and pool.num_trajectories == 8


def test_zero_spread_share_is_taken_over_fresh_rows_only():
    # groups of 4: all fail; mixed; all win once the replayed success (row 11) is left out; a lone fresh row
    totals = torch.tensor([0.0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0.5, 9, 9, 9])
    fresh = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]
    assert zero_spread_share(totals, fresh, 4) == 3 / 4
    assert zero_spread_share(totals, list(range(12)), 4) == 1 / 3  # with row 11: group 2 has spread
