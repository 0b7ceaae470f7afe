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
    dataset = ["a", "a", "b", "d", "e", "c", "a"]  # rows 3 and 4 are active and not in the batch
    redirect = redirect_retired_groups(keys, {"a"}, dataset, seed=[0, 5])
    assert sorted(redirect) == [0, 2]
    assert sorted(redirect.values()) == [3, 4]  # the active rows whose task is not in the batch, each once
    assert redirect == redirect_retired_groups(keys, {"a"}, dataset, seed=[0, 5])  # seeded
    draws = {tuple(redirect_retired_groups(keys, {"a"}, dataset, seed=[s]).items()) for s in range(20)}
    assert len(draws) == 2  # both orders of rows 3, 4 occur


def test_retired_groups_are_drawn_uniformly_without_walking_the_dataset():
    """A million rows, a third of them retired: every draw is an active row outside the batch, the rows are drawn
    uniformly (each of 4 tasks' rows about a quarter of the time), and no step builds a list of the rows."""

    class Rows(list):  # each row's task, counting the rows read; a walk of them fails
        reads = 0

        def __getitem__(self, row):
            Rows.reads += 1
            return super().__getitem__(row)

        def __iter__(self):
            raise AssertionError("the dataset's rows were walked")

    dataset = Rows(f"t{i % 6}" for i in range(1_000_000))  # t0, t1 retired; t2 in the batch; t3-t5 drawn
    counts = {}
    for s in range(300):
        redirect = redirect_retired_groups(["t0", "t2", "t1", "t0"], {"t0", "t1"}, dataset, seed=[s])
        assert sorted(redirect) == [0, 2, 3] and len(set(redirect.values())) == 3
        for row in redirect.values():
            assert dataset[row] in ("t3", "t4", "t5")
            counts[dataset[row]] = counts.get(dataset[row], 0) + 1
    assert all(250 <= n <= 350 for n in counts.values()), counts  # 900 draws over 3 tasks
    assert Rows.reads < 300 * 3 * 8  # half the rows qualify: ~2 draws of 2 reads a chosen row; a walk reads 1,000,000


def test_retired_groups_repeat_active_tasks_when_too_few_are_left():
    redirect = redirect_retired_groups(["a", "a", "a"], {"a"}, ["a", "b", "a"], seed=0)
    assert redirect == {0: 1, 1: 1, 2: 1}
    redirect = redirect_retired_groups(["a", "x", "a"], {"a"}, ["x", "y", "a"], seed=1)
    assert redirect[0] == 1 or redirect[2] == 1  # row 1 ("y", not in the batch) goes first
    assert set(redirect.values()) <= {0, 1} and sorted(redirect) == [0, 2]


def test_nothing_to_redirect():
    assert redirect_retired_groups(["a", "b"], set(), ["c"], seed=0) == {}
    assert redirect_retired_groups(["a", "b"], {"a", "b"}, ["a", "b"], seed=0) == {}  # all retired: said elsewhere


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
