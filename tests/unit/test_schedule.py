"""ExGRPO's run-level rules (`trl_exreplay.schedule`): when replay starts and which questions leave the fresh stream,
as pure functions; the checkpointed state read back or refused; and the pool's skip set as of a stamp."""

from __future__ import annotations

import pytest

from trl_exreplay.schedule import (
    SCHEDULE_FILE,
    EpochSeededSampler,
    ReplaySchedule,
    redirect_retired_groups,
    revisited_groups,
    starts_replay,
)


def test_replay_starts_strictly_above_the_solved_fraction():
    fresh = list(range(20))
    assert not starts_replay([True] * 7 + [False] * 13, fresh, 0.35)  # 0.35 is not above 0.35
    assert starts_replay([True] * 8 + [False] * 12, fresh, 0.35)
    assert not starts_replay([True] * 20, [], 0.35)  # no fresh rollout says nothing
    # only the fresh rows count: rows 0-3 succeed but only rows 2-5 are fresh -> 2 / 4
    assert starts_replay([True] * 4 + [False] * 4, [2, 3, 4, 5], 0.35)
    assert not starts_replay([True] * 4 + [False] * 4, [3, 4, 5, 6], 0.35)


def test_retired_groups_take_active_rows_not_in_the_batch():
    keys = ["a", "b", "a", "c"]  # groups 0 and 2 hold retired task "a"
    active_rows, active_keys = [10, 11, 12, 13], ["b", "d", "e", "c"]
    redirect = redirect_retired_groups(keys, {"a"}, active_rows, active_keys, seed=[0, 5])
    assert sorted(redirect) == [0, 2]
    assert sorted(redirect.values()) == [11, 12]  # the active rows whose task is not in the batch, each once
    assert redirect == redirect_retired_groups(keys, {"a"}, active_rows, active_keys, seed=[0, 5])  # seeded
    draws = {
        tuple(redirect_retired_groups(keys, {"a"}, active_rows, active_keys, seed=[s]).items()) for s in range(20)
    }
    assert len(draws) == 2  # both orders of rows 11, 12 occur


def test_retired_groups_repeat_active_tasks_when_too_few_are_left():
    redirect = redirect_retired_groups(["a", "a", "a"], {"a"}, [7], ["b"], seed=0)
    assert redirect == {0: 7, 1: 7, 2: 7}
    redirect = redirect_retired_groups(["a", "x", "a"], {"a"}, [7, 8], ["x", "y"], seed=1)
    assert redirect[0] == 8 or redirect[2] == 8  # row 8 ("y", not in the batch) goes first
    assert set(redirect.values()) <= {7, 8} and sorted(redirect) == [0, 2]


def test_nothing_to_redirect():
    assert redirect_retired_groups(["a", "b"], set(), [1], ["c"], seed=0) == {}
    assert redirect_retired_groups(["a", "b"], {"a", "b"}, [], [], seed=0) == {}  # everything retired: said elsewhere


def test_schedule_round_trip_and_absent_file(tmp_path):
    assert ReplaySchedule.load(str(tmp_path)) == ReplaySchedule()
    schedule = ReplaySchedule(started_at=7)
    schedule.save(str(tmp_path))
    assert ReplaySchedule.load(str(tmp_path)) == schedule
    assert [p.name for p in tmp_path.iterdir()] == [SCHEDULE_FILE]  # no temporary file left


@pytest.mark.parametrize(
    "content, message",
    [
        ("{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ("[1, 2]", "format_version 1"),
        ('{"format_version": 2}', "format_version 1"),
        ('{"format_version": 1, "started_at": -1}', "`started_at` is -1; allowed: null or an integer >= 0"),
        ('{"format_version": 1, "started_at": true}', "`started_at` is True"),
        ('{"format_version": 1, "started_at": "3"}', "`started_at` is '3'"),
        ('{"format_version": 1, "started_at": 1.5}', "`started_at` is 1.5"),
        ('{"format_version": 1, "started_at": ' + "[" * 100_000 + "]" * 100_000 + "}", "bytes"),
    ],
)
def test_a_bad_schedule_file_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / SCHEDULE_FILE
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message) as error:
        ReplaySchedule.load(str(tmp_path))
    assert SCHEDULE_FILE in str(error.value)


def test_the_epoch_seeded_sampler_draws_trls_orders_by_epoch_number():
    """Uninterrupted, it draws what TRL's RepeatSampler draws epoch after epoch; a fresh one set to epoch e (a resumed
    run) draws TRL's e-th order, where TRL's own sampler would start again from the first."""
    from trl.trainer.utils import RepeatSampler

    def trl_sampler():
        return RepeatSampler(list(range(10)), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=True, seed=7)

    alone = trl_sampler()
    trl_orders = [list(alone) for _ in range(4)]
    assert len({tuple(order) for order in trl_orders}) == 4
    ours = EpochSeededSampler(trl_sampler())
    for epoch in range(4):
        ours.set_epoch(epoch)
        assert list(ours) == trl_orders[epoch]
    resumed = EpochSeededSampler(trl_sampler())
    resumed.set_epoch(3)
    assert list(resumed) == trl_orders[3] and len(resumed) == len(alone)
    assert list(trl_sampler()) != trl_orders[3]  # what TRL's sampler draws after a resume


def test_revisited_groups_let_a_share_of_retired_draws_through_by_seed():
    keys = ["a", "b", "a", "c", "b", "a"] * 50  # 300 groups; a and b retired: 250 retired groups
    assert revisited_groups(keys, {"a", "b"}, 0.0, seed=[0, 1]) == []
    assert revisited_groups(keys, {"a", "b"}, 1.0, seed=[0, 1]) == [g for g, k in enumerate(keys) if k != "c"]
    drawn = revisited_groups(keys, {"a", "b"}, 0.25, seed=[0, 1])
    assert drawn == revisited_groups(keys, {"a", "b"}, 0.25, seed=[0, 1])  # every rank, and a resumed run, alike
    assert drawn != revisited_groups(keys, {"a", "b"}, 0.25, seed=[0, 2])
    assert all(keys[g] in "ab" for g in drawn) and 40 <= len(drawn) <= 85  # about a quarter of 250
    assert revisited_groups(keys, set(), 0.5, seed=0) == []
