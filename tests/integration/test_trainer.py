"""ExReplayGRPOTrainer end to end on a tiny local model (CPU, single process)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import REPLAY_ONLY, RecordingTrainer, losses, make_args, make_trainer
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from trl_exreplay import ExperiencePool, ExReplayGRPOTrainer, Trajectory
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
from trl_exreplay.planner import ReplayPlan
from trl_exreplay.pool import tokenizer_fingerprint
from trl_exreplay.pool.persistence import read_state, state_files
from trl_exreplay.selection import current_policy_entropies, select_trajectories
from trl_exreplay.trainer import POOL_DIR, POOL_WORK_DIR


@pytest.mark.fast  # in the fast lane: the drop-in promise, a replaying step, a resume
def test_disabled_replay_is_grpo_trainer(tmp_path):
    """enable_experience_replay=False: same losses and same weights as GRPOTrainer from the same seed."""
    common = dict(max_steps=3, learning_rate=1e-2)
    ours = make_trainer(tmp_path / "ours", enable_experience_replay=False, **common)
    ours.train()
    theirs = make_trainer(
        tmp_path / "theirs", trainer_cls=GRPOTrainer, args=make_args(tmp_path / "theirs", GRPOConfig, **common)
    )
    theirs.train()
    assert len(losses(ours)) == 3
    assert losses(ours) == losses(theirs)
    for (name, ours_param), (_, their_param) in zip(ours.model.named_parameters(), theirs.model.named_parameters()):
        assert torch.equal(ours_param, their_param), name
    assert ours.pool.num_trajectories == 0


@pytest.mark.fast  # in the fast lane: the drop-in promise, a replaying step, a resume
def test_replay_group_layout_and_generated_rows(tmp_path):
    trainer = make_trainer(
        tmp_path, trainer_cls=RecordingTrainer, max_steps=8, replay_trajectories_per_group=2, **REPLAY_ONLY
    )  # rescued groups have their own layout (test_every_group_teaches.py)
    trainer.train()
    num_generations, k = 4, 2
    tokenizer = trainer.processing_class
    steps_with_replay = 0
    assert len(trainer.batches) == len(trainer.generated_rows) == 8
    for (output, pool_before), generated in zip(trainer.batches, trainer.generated_rows):
        exp_mask, completion_mask = output["exp_mask"], output["completion_mask"]
        assert exp_mask.size(0) == 16  # rows per batch unchanged
        replayed = exp_mask.bool().any(dim=1)
        replay_tasks = 0
        for group in range(16 // num_generations):
            rows = slice(group * num_generations, (group + 1) * num_generations)
            prompts = output["prompt_ids"][rows]
            assert (prompts == prompts[0]).all()  # one task per group
            flags = replayed[rows].tolist()
            if any(flags):
                replay_tasks += 1
                assert flags == [False] * (num_generations - k) + [True] * k
                task_prompt = tokenizer.decode(prompts[0], skip_special_tokens=True)
                word = task_prompt.split()[-1]
                # replayed completions are stored trajectories of that task, and were successes
                for row in range(group * num_generations + num_generations - k, (group + 1) * num_generations):
                    n = int(completion_mask[row].sum())
                    completion = output["completion_ids"][row, :n].tolist()
                    stored = [t.completion_ids for ts in pool_before.values() for t in ts]
                    assert completion in stored
                    assert word in tokenizer.decode(completion, skip_special_tokens=True).split()
        # exp_mask is exactly the model tokens of replayed rows, zero elsewhere
        assert torch.equal(exp_mask[replayed], completion_mask[replayed])
        assert not exp_mask[~replayed].any()
        assert generated == 16 - replay_tasks * k  # counted at the model's generate
        steps_with_replay += replay_tasks > 0
    assert steps_with_replay >= 3


def test_replayed_rewards_enter_the_group_baseline(tmp_path):
    trainer = make_trainer(tmp_path, trainer_cls=RecordingTrainer, max_steps=8, scale_rewards="group")
    trainer.train()
    tokenizer = trainer.processing_class
    checked = 0
    for output, _ in trainer.batches:
        replayed = output["exp_mask"].bool().any(dim=1)
        for group in range(4):
            rows = range(group * 4, group * 4 + 4)
            if not replayed[rows[-1]]:
                continue
            word = tokenizer.decode(output["prompt_ids"][rows[0]], skip_special_tokens=True).split()[-1]
            texts = [
                tokenizer.decode(output["completion_ids"][r, : int(output["completion_mask"][r].sum())]) for r in rows
            ]
            rewards = torch.tensor(said_target([[{"content": t}] for t in texts], [word] * 4))
            assert rewards[-1] == 1.0  # the replayed trajectory was a success
            expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            torch.testing.assert_close(output["advantages"][list(rows)].cpu(), expected, atol=1e-5, rtol=0)
            checked += 1
    assert checked >= 3


class SnapshotCallback(TrainerCallback):
    def __init__(self):
        self.weights = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.float32  # recorded log-probs to 1e-5 of a float32 forward
@pytest.mark.parametrize(
    "schedule",
    [
        {},  # aligned: log-probs and entropies come from the loss forward before the optimizer step
        {"gradient_accumulation_steps": 2, "steps_per_generation": 4, "per_device_train_batch_size": 8},
        {"steps_per_generation": 2, "per_device_train_batch_size": 8},  # TRL computes old log-probs
        {"num_iterations": 2, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 8},
    ],
    ids=["aligned", "ga2-spg4", "spg2", "iterations2"],
)
def test_recorded_logps_are_the_generating_policy(tmp_path, schedule):
    # 8 steps: enough generations that the stored successes span policy versions whatever the device's sampling (on
    # CUDA, 5 steps with num_iterations=2 stored successes of one version only)
    trainer = make_trainer(tmp_path, max_steps=8, temperature=0.7, replay_start_ratio=1.0, **schedule)
    snapshots = SnapshotCallback()
    trainer.add_callback(snapshots)
    trainer.train()
    trajectories = [t for task in trainer.pool.stored_tasks() for t in trainer.pool.trajectories(task)]
    assert len(trajectories) >= 3
    model = trainer.model
    checked_versions = set()
    for trajectory in trajectories:
        model.load_state_dict(snapshots.weights[trajectory.policy_version])
        ids = torch.tensor([trajectory.prompt_ids + trajectory.completion_ids], device=model.device)
        with torch.no_grad():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                model, ids, torch.ones_like(ids), len(trajectory.completion_ids), compute_entropy=True
            )
        torch.testing.assert_close(torch.tensor(trajectory.logps), logps[0].cpu(), atol=1e-5, rtol=0)
        assert abs(trajectory.entropy - entropies[0].mean().item()) < 1e-5
        checked_versions.add(trajectory.policy_version)
    assert len(checked_versions) >= 2  # trajectories from several policy versions, each matched its own


@pytest.mark.fast  # in the fast lane: the drop-in promise, a replaying step, a resume
def test_resume_gives_the_same_next_losses(tmp_path):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, replay_start_ratio=0.25)
    full = make_trainer(tmp_path / "full", **common)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    saved = ExperiencePool.load(str(checkpoint / "exreplay_pool"))
    assert saved.num_trajectories > 0

    resumed = make_trainer(tmp_path / "resumed", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert losses(resumed)[-2:] == losses(full)[-2:]
    assert resumed.pool.content_hash() == full.pool.content_hash()
    replay_rows = [e["replay/rows_fraction"] for e in resumed.state.log_history if "replay/rows_fraction" in e]
    assert max(replay_rows) > 0  # the resumed steps did replay


class PoolFilesAtSave(TrainerCallback):
    """Each checkpoint's pool as saved: its files' inodes and its content hash (before rotation may delete it)."""

    def __init__(self, output_dir):
        self.output_dir = output_dir
        self.inodes, self.hashes = {}, {}

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(self.output_dir, f"checkpoint-{state.global_step}", POOL_DIR)
        names = state_files(read_state(folder))
        self.inodes[state.global_step] = {name: os.stat(os.path.join(folder, name)).st_ino for name in names}
        self.hashes[state.global_step] = ExperiencePool.load(folder).content_hash()


def test_checkpoint_pools_are_incremental_and_rotate_with_save_total_limit(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=5, save_strategy="steps", save_steps=1, save_total_limit=2)
    out = tmp_path / "out"
    at_save = PoolFilesAtSave(str(out))
    trainer.add_callback(at_save)
    trainer.train()

    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]  # TRL's rotation
    for step in (4, 5):
        assert ExperiencePool.load(str(out / f"checkpoint-{step}" / POOL_DIR)).content_hash() == at_save.hashes[step]
    assert at_save.hashes[5] == trainer.pool.content_hash()
    assert len(set(at_save.hashes.values())) >= 3  # the pool changed between checkpoints
    shared_steps = 0
    for step in range(2, 6):
        before, now = at_save.inodes[step - 1], at_save.inodes[step]
        shards = lambda files: {n for n in files if n.startswith("trajectories-")}  # noqa: E731
        shared = shards(before) & shards(now)
        # Incremental: a shard the previous checkpoint had is the very same file (a hard link), never rewritten;
        # a save adds at most one trajectory shard and one task row shard (plus a compaction's output).
        assert all(before[n] == now[n] for n in shared)
        assert len(shards(now) - shared) <= 3
        shared_steps += bool(shared)
    assert shared_steps >= 3
    for name in at_save.inodes[5]:
        if name.startswith("trajectories-"):
            assert os.stat(out / "checkpoint-5" / POOL_DIR / name).st_nlink >= 2  # also the live pool's file
    assert (out / POOL_WORK_DIR).is_dir() and not (out / "checkpoint-5" / POOL_WORK_DIR).exists()


def test_a_pool_recorded_with_another_tokenizer_is_refused(tmp_path):
    other = build_tiny_tokenizer(list(reversed(VOCABULARY)))  # as many tokens; every id means another word
    given = ExperiencePool()
    given.bind_tokenizer(tokenizer_fingerprint(other))
    with pytest.raises(ValueError, match="recorded with another tokenizer"):
        make_trainer(tmp_path, trainer_kwargs={"experience_pool": given})

    first = make_trainer(tmp_path / "a", max_steps=1, save_strategy="steps", save_steps=1)
    first.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-1"
    saved = ExperiencePool.load(str(checkpoint / POOL_DIR))
    assert saved.tokenizer_fingerprint == tokenizer_fingerprint(first.processing_class)
    saved.tokenizer_fingerprint = tokenizer_fingerprint(other)
    saved.save(str(checkpoint / POOL_DIR))
    resumed = make_trainer(tmp_path / "b", max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.raises(ValueError, match="recorded with another tokenizer"):
        resumed.train(resume_from_checkpoint=str(checkpoint))


def replay_log(tmp_path, **overrides):
    trainer = make_trainer(tmp_path, max_steps=6, **overrides)
    trainer.train()
    log = trainer.state.log_history
    return [e["replay/tasks"] for e in log if "replay/tasks" in e], [
        e["replay/policy_age"] for e in log if "replay/policy_age" in e
    ]


def test_max_policy_age_limits_what_is_replayed(tmp_path):
    tasks, ages = replay_log(tmp_path / "free")
    assert max(tasks) == 2 and max(ages) > 1  # unconstrained: two replay groups, some trajectories older than 1
    tasks, ages = replay_log(tmp_path / "age", replay_max_policy_age=1)
    assert max(tasks) >= 1 and max(ages) <= 1


def _stored_trajectories(trainer, task_id, completions, saved_entropies):
    tokenizer = trainer.processing_class
    prompt = [{"role": "user", "content": "say the word red"}]
    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt_ids = prompt_ids["input_ids"]
    out = []
    for words, entropy in zip(completions, saved_entropies):
        ids = tokenizer(words)["input_ids"]
        out.append(Trajectory(task_id, prompt_ids, ids, [1] * len(ids), [-1.0] * len(ids), [1.0], 1.0, entropy, 0))
    return out


def _entropy_alone(trainer, trajectory):
    ids = torch.tensor([trajectory.prompt_ids + trajectory.completion_ids], device=trainer.model.device)
    with torch.no_grad():
        _, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, torch.ones_like(ids), len(trajectory.completion_ids), compute_entropy=True
        )
    return entropies[0].mean().item()


@pytest.mark.parametrize("use_current", [True, False])
def test_selection_by_current_or_saved_entropy(tmp_path, use_current):
    trainer = make_trainer(tmp_path, replay_select_by_current_entropy=use_current, replay_select_mode="argmin")
    completions = ["red red", "cat dog sun moon", "blue", "tree rock fish"]
    current = [_entropy_alone(trainer, t) for t in _stored_trajectories(trainer, "task-0", completions, [0] * 4)]
    saved = [-c for c in current]  # saved order is the reverse of the current one
    for trajectory in _stored_trajectories(trainer, "task-0", completions, saved):
        trainer.pool.add(trajectory)
    plan = ReplayPlan(num_generations=4, num_replayed=1, replay_groups={0: "task-0"})
    chosen = select_trajectories(trainer.pool, plan, trainer.settings, 0, [0, 0], trainer.accelerator,
                                 trainer._policy_forward, lambda read: read())["task-0"][0]  # fmt: skip
    expected = int(np.argmin(current)) if use_current else int(np.argmin(saved))
    assert chosen.completion_ids == trainer.pool.trajectories("task-0")[expected].completion_ids
    assert int(np.argmin(current)) != int(np.argmin(saved))


@pytest.mark.float32
def test_sharded_entropy_forward_matches_unpadded(tmp_path):
    trainer = make_trainer(tmp_path)
    trajectories = _stored_trajectories(trainer, "t", ["red", "cat dog sun moon", "blue green", "a"], [0] * 4)
    batched = current_policy_entropies(trajectories, trainer.accelerator, trainer._policy_forward)
    alone = [_entropy_alone(trainer, t) for t in trajectories]
    assert batched == pytest.approx(alone, abs=1e-5)


def test_replay_metrics_are_logged(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=6)
    trainer.train()
    logged = set().union(*(entry.keys() for entry in trainer.state.log_history))
    expected = {
        "replay/rows_fraction",
        "replay/tasks",
        "replay/pool_tasks",
        "replay/pool_trajectories",
        "replay/skip_set",
        "replay/off_policy_loss",
        "replay/off_clip_fraction",
        "replay/importance_ratio_min",
        "replay/importance_ratio_mean",
        "replay/importance_ratio_max",
        "replay/logp_drift",
        "replay/policy_age",
        "replay/generated_rows",
        "replay/fresh_reward",
        "replay/trained_reward",
        "replay/zero_std_trained",
    }
    assert expected <= logged, expected - logged
    assert any(key.startswith("replay/bucket_") for key in logged)


def test_exp_is_correct_off_uses_current_logps(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=6, replay_importance_sampling=False)
    trainer.train()
    replay_entries = [e for e in trainer.state.log_history if "replay/importance_ratio_mean" in e]
    assert replay_entries
    for entry in replay_entries:
        assert entry["replay/importance_ratio_min"] == entry["replay/importance_ratio_max"] == 1.0
        assert entry["replay/logp_drift"] == 0.0


def test_one_group_a_generation_batch_replays_on_alternate_batches(tmp_path, caplog):
    """TRL's default batch holds one group a generation batch: replay_ratio 0.5 is a long-run share, so that group is
    a replayed task on every second batch (the odd ones), its last row replayed, and the run says so once."""
    trainer = make_trainer(
        tmp_path, trainer_cls=RecordingTrainer, num_tasks=1, per_device_train_batch_size=4, max_steps=12,
        replay_start_ratio=0.0, learning_rate=1e-2, **REPLAY_ONLY,
    )  # fmt: skip
    assert "holds 1 task group(s), so replay_ratio=0.5 replays a group in only about one generation batch of 2" in (
        caplog.text
    )
    trainer.train()
    replayed_batches = []
    for n, ((output, pool_before), generated) in enumerate(zip(trainer.batches, trainer.generated_rows)):
        rows = output["exp_mask"].bool().any(dim=1).tolist()
        if n % 2 == 1 and pool_before:
            assert rows == [False, False, False, True], n
            assert generated == 3
            (stored,) = pool_before.values()
            assert output["completion_ids"][3, : int(output["completion_mask"][3].sum())].tolist() in [
                t.completion_ids for t in stored
            ]
            replayed_batches.append(n)
        else:
            assert rows == [False] * 4 and generated == 4, n
    assert len(replayed_batches) >= 3  # the test saw replay, not only its absence
    tasks = [e["replay/tasks"] for e in trainer.state.log_history if "replay/tasks" in e]
    assert tasks == [float(n in replayed_batches) for n in range(12)]


def test_plain_grpo_config_replays_with_defaults(tmp_path):
    args = make_args(tmp_path, GRPOConfig, max_steps=6)
    trainer = make_trainer(tmp_path, args=args)
    assert trainer.settings.replay_ratio == 0.5 and trainer.settings.enable_experience_replay
    trainer.train()
    assert max(e.get("replay/tasks", 0) for e in trainer.state.log_history) > 0


def test_top_entropy_quantile_trains_the_highest_entropy_tokens_fresh_and_replayed(tmp_path, monkeypatch):
    import trl_exreplay.trainer as trainer_module

    losses_seen, selections = [], []
    term = trainer_module.off_policy_loss

    def spy_loss(logps, behaviour, advantages, exp_mask, options=None, token_mask=None):
        losses_seen.append((exp_mask.clone(), token_mask))
        return term(logps, behaviour, advantages, exp_mask, options, token_mask=token_mask)

    monkeypatch.setattr(trainer_module, "off_policy_loss", spy_loss)
    trainer = make_trainer(tmp_path, max_steps=6, top_entropy_quantile=0.5)
    select = trainer.get_high_entropy_mask  # TRL's own selection

    def spy_select(entropies, mask, threshold):
        selected = select(entropies, mask, threshold)
        selections.append((entropies.detach().clone(), mask.bool(), selected, threshold))
        return selected

    monkeypatch.setattr(trainer, "get_high_entropy_mask", spy_select)
    trainer.train()

    # Every step calls TRL's selection once, in TRL's loss; a replaying step's replayed term gets that very selection
    # (no second gather of every rank's entropies).
    replaying = len(losses_seen)
    assert 0 < replaying < 6 and len(selections) == 6
    assert any((exp_mask.bool() & given).any() for exp_mask, given in losses_seen)  # replayed tokens selected from
    for entropies, mask, selected, threshold in selections:
        assert threshold == 0.5
        assert not (selected & ~mask).any()
        kept, dropped = entropies[selected], entropies[mask & ~selected]
        assert kept.numel() >= mask.sum() / 2 and dropped.numel() > 0
        assert kept.min() >= dropped.max()
    for (_, given), (_, _, selected, _) in zip(losses_seen, selections[-replaying:]):
        assert given is selected


def test_saving_mid_generation_batch_loses_no_trajectory(tmp_path):
    """steps_per_generation 2 and GA 1: a save falls between the two halves of a generation batch."""
    common = dict(max_steps=6, steps_per_generation=2, per_device_train_batch_size=8, replay_start_ratio=0.5)
    unsaved = make_trainer(tmp_path / "a", **common)
    unsaved.train()
    saved = make_trainer(tmp_path / "b", save_strategy="steps", save_steps=1, **common)
    saved.train()
    assert unsaved.pool.num_trajectories > 0
    assert saved.pool.content_hash() == unsaved.pool.content_hash()
    assert saved._faults.totals["uncaptured_rows"] == 0


class OutcomeRecordingTrainer(RecordingTrainer):
    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.outcomes = getattr(self, "outcomes", []) + [self._replay.pending.outcomes]
        return output


def test_a_task_in_several_groups_has_one_outcome_per_group(tmp_path):
    """One task fills the batch's four groups of 4: four outcomes of at most 4 rollouts each (the library counts a
    task's difficulty per group), never one of 16, which would sit in a bucket above G and never be stored."""
    # without rescue, whose rows count as the failures they were (test_every_group_teaches.py), not as replayed rows
    trainer = make_trainer(tmp_path, trainer_cls=OutcomeRecordingTrainer, num_tasks=1, max_steps=4, **REPLAY_ONLY)
    trainer.train()
    tokenizer = trainer.processing_class
    for (output, _), outcomes in zip(trainer.batches, trainer.outcomes):
        replayed = output["exp_mask"].bool().any(dim=1)
        texts = [
            tokenizer.decode(output["completion_ids"][r, : int(output["completion_mask"][r].sum())]) for r in range(16)
        ]
        success = said_target([[{"content": t}] for t in texts], ["red"] * 16)
        assert len(outcomes) == 4  # four groups, one task, one outcome each
        for group, (task_id, successes, num_fresh, winners) in enumerate(outcomes):
            fresh = [r for r in range(4 * group, 4 * group + 4) if not replayed[r]]
            assert task_id == "task-0"
            assert num_fresh == len(fresh) <= 4
            assert winners == [r for r in fresh if success[r] == 1.0]
            assert successes == len(winners)


def test_given_pool_takes_the_run_configuration(tmp_path, caplog):
    given = ExperiencePool(replay_max_trajectories_per_task=9, replay_select_mode="argmax", replay_store_rbound=4)
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    trainer = ExReplayGRPOTrainer(
        model=build_tiny_model(tokenizer),
        reward_funcs=said_target,
        args=make_args(tmp_path, replay_max_trajectories_per_task=3),
        train_dataset=say_word_dataset(4),
        processing_class=tokenizer,
        experience_pool=given,
    )
    assert trainer.pool is given
    settings = (given.replay_max_trajectories_per_task, given.replay_select_mode, given.replay_store_rbound)
    assert settings == (3, "argmin", 4)
    assert "replay_max_trajectories_per_task" in caplog.text and "replay_select_mode" in caplog.text  # config names


def test_trls_model_card_names_exreplay(tmp_path):
    """TRL writes a model card with every checkpoint and push; it must name our trainer, tag it and cite ExGRPO."""
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.create_model_card(model_name="tiny-exreplay")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- exreplay" in card and "- grpo" in card and "- trl" in card
    assert "ExReplay GRPO" in card and "2510.02245" in card and "zhan2025exgrpo" in card


def test_a_replayed_episode_with_environment_tokens_keeps_them_out_of_a_single_turn_loss():
    """A pool made by a multi-turn or tool run, replayed where TRL's batch has no `tool_mask`: the replayed row gets
    one from its stored model-token mask, and is flagged replayed whatever its mask."""
    from trl_exreplay.step import attach_replay_tensors

    output = {"completion_ids": torch.zeros(3, 5, dtype=torch.long), "completion_mask": torch.tensor([[1] * 5] * 3)}
    output["completion_mask"][2, 3:] = 0
    stored = Trajectory("t", [1], [7, 8, 9, 10], [1, 0, 0, 1], [-0.5, 0.0, 0.0, -0.25], [1.0], 1.0, 0.1, 0)
    attach_replay_tensors(output, {1: stored}, replaying=True)
    assert output["tool_mask"].tolist() == [[1] * 5, [1, 0, 0, 1, 0], [1] * 5]
    assert output["exp_mask"].tolist() == [[0] * 5, [1, 0, 0, 1, 0], [0] * 5]
    assert output["exreplay_replayed"].tolist() == [0, 1, 0]
    assert output["recorded_per_token_logps"][1].tolist() == [-0.5, 0.0, 0.0, -0.25, 0.0]
