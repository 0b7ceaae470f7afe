"""The ExGRPO replay rules (`trl_exreplay.pool.rules`) by hand, apart from any pool: each case is a decision of
ExGRPO's code (skip set, bounds, entropy ranking; the module's docstring names its files) or of this library's design
(per-task capacity, eviction, policy age)."""

import numpy as np
import pytest

from trl_exreplay.pool.rules import (
    best_index,
    eviction,
    is_solved,
    replayable,
    select,
    selection_order,
    stores_successes,
)


@pytest.mark.parametrize(
    "successes, num_fresh, solved",
    [(8, 8, True), (1, 1, True), (7, 8, False), (0, 8, False), (0, 0, False)],  # no fresh rollout: no evidence
)
def test_only_a_task_every_fresh_rollout_solved_enters_the_skip_set(successes, num_fresh, solved):
    assert is_solved(successes, num_fresh) is solved


@pytest.mark.parametrize(
    "successes, lbound, rbound, stored",
    [(0, 0, 8, False), (1, 0, 8, True), (7, 0, 8, True), (8, 0, 8, False), (2, 2, 8, False), (3, 2, 5, True)],
)
def test_successes_are_stored_strictly_between_the_bounds(successes, lbound, rbound, stored):
    assert stores_successes(successes, lbound, rbound) is stored


def test_best_index_takes_the_extreme_entropy_first_on_ties_or_the_rng_draw():
    entropies = [0.5, 0.2, 0.9, 0.2, 0.9]
    assert best_index(entropies, "argmin", np.random.default_rng(0)) == 1
    assert best_index(entropies, "argmax", np.random.default_rng(0)) == 2
    draws = {best_index(entropies, "random", np.random.default_rng(seed)) for seed in range(40)}
    assert draws == set(range(5))
    assert best_index(entropies, "random", np.random.default_rng(3)) == int(np.random.default_rng(3).integers(5))


def test_argmin_eviction_replaces_the_highest_entropy_only_for_a_lower_one():
    entropies, ids, versions = [0.4, 0.9, 0.9, 0.1], [10, 11, 12, 13], [1, 1, 1, 1]
    # the highest entropy (0.9, twice): the later one (id 12) goes, so the store keeps the older of equals
    assert eviction(entropies, ids, versions, 0.5, 2, "argmin") == ("replace", 2)
    assert eviction(entropies, ids, versions, 0.9, 2, "argmin") == ("refuse", -1)  # not lower: kept out
    assert eviction(entropies, ids, versions, 1.5, 2, "argmin") == ("refuse", -1)


def test_argmax_eviction_replaces_the_lowest_entropy_only_for_a_higher_one():
    entropies, ids, versions = [0.4, 0.1, 0.9, 0.1], [10, 11, 12, 13], [1, 1, 1, 1]
    assert eviction(entropies, ids, versions, 0.5, 2, "argmax") == ("replace", 3)  # the later of the two 0.1
    assert eviction(entropies, ids, versions, 0.1, 2, "argmax") == ("refuse", -1)


def test_random_eviction_is_fifo():
    assert eviction([0.4, 0.1], [10, 11], [1, 1], 0.0, 2, "random") == ("shift", 0)


def test_stale_trajectories_are_evicted_first_oldest_version_then_oldest_id():
    entropies, ids, versions = [0.1, 0.9, 0.2, 0.3], [10, 11, 12, 13], [5, 2, 2, 9]
    # new version 10, max age 4: versions 5 and 2 are stale (age 5 and 8); the oldest version, then id: slot 1
    assert eviction(entropies, ids, versions, 2.0, 10, "argmin", max_policy_age=4) == ("shift", 1)
    assert eviction(entropies, ids, versions, 2.0, 10, "argmax", max_policy_age=4) == ("shift", 1)
    # nothing stale (age <= 8): the mode's rule applies
    assert eviction(entropies, ids, versions, 2.0, 10, "argmin", max_policy_age=8) == ("refuse", -1)
    assert eviction(entropies, ids, versions, 0.05, 10, "argmin", max_policy_age=8) == ("replace", 1)


def test_selection_order_by_entropy_ties_to_the_lowest_id():
    entropies, ids = [0.5, 0.2, 0.5, 0.9], [7, 8, 3, 1]
    assert selection_order(entropies, ids, 4, "argmin") == [1, 2, 0, 3]  # 0.5 twice: id 3 before id 7
    assert selection_order(entropies, ids, 2, "argmax") == [3, 2]
    assert selection_order(entropies, ids, 0, "argmin") == []


def test_random_selection_is_the_rngs_permutation_and_needs_an_rng():
    entropies, ids = [0.5, 0.2, 0.5, 0.9], [7, 8, 3, 1]
    expected = [int(i) for i in np.random.default_rng(5).permutation(4)][:3]
    assert selection_order(entropies, ids, 3, "random", np.random.default_rng(5)) == expected
    with pytest.raises(ValueError, match="needs an `rng`"):
        selection_order(entropies, ids, 1, "random")


def test_selecting_more_than_the_candidates_is_an_error():
    with pytest.raises(ValueError, match="Cannot select 3 trajectories out of 2 candidates"):
        selection_order([0.1, 0.2], [1, 2], 3, "argmin")


def test_select_decides_every_replayed_task_in_turn_from_one_rng():
    """The one rule of which stored trajectories replay, by hand: tasks in the order given, positions in the order they
    take the group's replayed rows; under ``random`` the tasks draw in turn from one generator."""
    candidates = {
        "b": ([0.7, 0.1, 0.4], [2, 5, 9]),  # saved entropies (or the current policy's), trajectory ids, store order
        "a": ([0.3, 0.3], [8, 4]),  # a tie: the lower id (the older trajectory) first
    }
    assert select(candidates, 2, "argmin") == {"b": [1, 2], "a": [1, 0]}
    assert list(select(candidates, 2, "argmin")) == ["b", "a"]
    assert select(candidates, 1, "argmax") == {"b": [0], "a": [1]}
    rng = np.random.default_rng(11)
    first, second = rng.permutation(3), rng.permutation(2)  # "b" draws first, then "a" from the same generator
    assert select(candidates, 2, "random", np.random.default_rng(11)) == {"b": first[:2].tolist(),
                                                                           "a": second[:2].tolist()}  # fmt: skip
    # the current policy's entropies reverse "b": the same rule, other figures
    assert select({"b": ([0.1, 0.9, 0.5], [2, 5, 9])}, 2, "argmin") == {"b": [0, 2]}
    with pytest.raises(ValueError, match="Cannot select 3 trajectories out of 2 candidates"):
        select(candidates, 3, "argmin")


def test_a_task_is_replayable_when_bucketed_not_skipped_with_its_row_and_enough_young_trajectories():
    difficulty = np.array([2, -1, 3, 1, 0])
    in_skip_set = np.array([False, False, True, False, False])
    has_row = np.array([True, True, True, False, True])
    num_selectable = np.array([2, 5, 5, 5, 1])
    # task 1: in no bucket; 2: in the skip set; 3: no dataset row; 4: one young trajectory, two needed
    assert replayable(difficulty, in_skip_set, has_row, num_selectable, 2).tolist() == [True] + [False] * 4
    assert replayable(difficulty, in_skip_set, has_row, num_selectable, 1).tolist() == [
        True,
        False,
        False,
        False,
        True,
    ]
