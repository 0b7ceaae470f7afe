"""replay_spread_plan: before generation, the batch's groups go to the tasks whose groups are likely to have a reward
spread (`trl_exreplay.spread`), through the trainer: the plan moves groups to such tasks and keeps the batch's shape,
its estimates and metrics are those of the fresh outcomes, and a resumed run plans and trains as the unbroken one."""

from __future__ import annotations

import zlib

from helpers import losses, make_trainer

from trl_exreplay.spread import ESTIMATES_FILE, SuccessEstimates

# say-the-word tasks 0-11: a reward that makes 0-3 always won, 4-7 never won, 8-11 won about half the time
KIND = {f"task-{i}": ("won", "lost", "half")[i // 4] for i in range(12)}


def by_kind(completions, task_id, **kwargs) -> list[float]:
    """1 for the "won" tasks, 0 for the "lost" ones; for the "half" ones, a coin flipped by the completion's text (so
    that a resumed run, which generates the same completions, gets the same rewards)."""
    by_kind.calls.append(list(task_id))
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    coin = [zlib.crc32(f"{t} {text}".encode()) % 2 for t, text in zip(task_id, texts)]
    return [{"won": 1.0, "lost": 0.0, "half": float(c)}[KIND[t]] for t, c in zip(task_id, coin)]


def spread_trainer(tmp_path, **overrides):
    by_kind.calls = []
    settings = dict(reward_funcs=by_kind, num_tasks=12, max_steps=12, replay_spread_plan=True,
                    replay_spread_explore=0.0, replay_rescue=0, replay_retire_solved=False, replay_ratio=0.0)  # fmt: skip
    return make_trainer(tmp_path, **{**settings, **overrides})


def test_the_plan_gives_the_batch_to_tasks_whose_groups_teach_and_keeps_its_shape(tmp_path):
    trainer = spread_trainer(tmp_path)
    trainer.train()
    batches = by_kind.calls
    assert len(batches) == 12 and {len(b) for b in batches} == {16}  # 4 groups of 4 each step, as GRPO's
    groups = [KIND[b[g * 4]] for b in batches for g in range(4)]
    assert all(len(set(b[g * 4 : g * 4 + 4])) == 1 for b in batches for g in range(4))  # a group is one task
    late = groups[len(groups) // 2 :]
    # a third of the dataset's rows are the tasks won half the time; once their estimates are learnt, most groups
    assert late.count("half") / len(late) > 0.6
    # the estimates hold every task a fresh group played, with its successes
    estimates = trainer._pool_keeper.estimates
    assert len(estimates) == len({t for b in batches for t in b}) >= 4
    alpha, beta = estimates.posterior(["task-0", "task-4"], step=trainer.state.global_step)
    assert alpha[0] > 4 * beta[0] and beta[1] > 4 * alpha[1]  # the always-won task and the never-won one
    logged = [e for e in trainer.state.log_history if "replay/spread_replanned_groups" in e]
    assert len(logged) == 12 and sum(e["replay/spread_replanned_groups"] for e in logged) > 0
    for entry in logged:  # the split of the fresh groups that teach nothing, and the plan's calibration
        assert entry["replay/all_fail_fresh"] + entry["replay/all_win_fresh"] <= 1.0
        assert (
            0.0 <= entry["replay/spread_predicted_fresh"] <= 1.0
            and 0.0 <= entry["replay/spread_observed_fresh"] <= 1.0
        )
    # a group the plan gave no task with spread: the always-lost and always-won ones are rarer late than early
    assert late.count("lost") + late.count("won") < groups[: len(groups) // 2].count("lost") + groups[
        : len(groups) // 2
    ].count("won")


def test_explore_one_keeps_every_group_as_the_sampler_drew_it(tmp_path):
    planned = spread_trainer(tmp_path / "planned", replay_spread_explore=1.0, max_steps=4)
    planned.train()
    drawn = by_kind.calls
    plain = spread_trainer(tmp_path / "plain", replay_spread_plan=False, max_steps=4)
    plain.train()
    assert drawn == by_kind.calls and losses(planned) == losses(plain)  # the same groups, the same training


def test_a_resumed_run_plans_and_trains_as_the_unbroken_one(tmp_path):
    settings = dict(save_strategy="steps", save_steps=6)
    full = spread_trainer(tmp_path / "full", **settings)
    full.train()
    full_batches = by_kind.calls
    checkpoint = tmp_path / "full" / "out" / "checkpoint-6"
    saved = SuccessEstimates(half_life=50)
    assert (checkpoint / ESTIMATES_FILE).is_file() and saved.load(str(checkpoint)) and len(saved) > 0
    resumed = spread_trainer(tmp_path / "full", **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert by_kind.calls == full_batches[6:]  # the same groups planned, step for step
    assert losses(resumed) == losses(full)  # the checkpoint's six, then the same six after it
    keys = sorted(KIND)
    assert [x.tolist() for x in resumed._pool_keeper.estimates.posterior(keys, 12)] == [
        x.tolist() for x in full._pool_keeper.estimates.posterior(keys, 12)
    ]
