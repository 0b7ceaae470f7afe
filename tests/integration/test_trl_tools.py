"""Replay through TRL's own multi-turn paths (issue 25, point 4): its tool loop (`environment_factory`, `tools`) and a
custom `rollout_func`, on the tool-calling testbed of `tests/tool_env.py` (TRL's Qwen3 chat template; TRL parses,
runs and answers the tiny model's tool calls itself).

What must hold on a replaying step: the replayed rows are the stored trajectories, tool results included, and TRL's
tool loop runs none of their tool calls again; their tool-result tokens are masked out of the loss exactly as TRL
masks them in a fresh row (`tool_mask` 0, so neither TRL's loss nor the replayed term trains them); the fresh rows
come from TRL's tool loop. Under DDP and ZeRO-3 (2 processes) the same, with rank-identical pools and losses.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
from helpers import REPOSITORY, make_args
from launching import accelerate_launch
from loss_check import CheckingTrainer, assert_replaying_losses_compose
from tool_env import (
    ButtonsEnv,
    PlainButtonsEnv,
    SpellingButtonsEnv,
    build_tool_model,
    build_tool_tokenizer,
    buttons_dataset,
)
from trl import GRPOConfig, GRPOTrainer

from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
TOOL_SETTINGS = dict(max_completion_length=48, per_device_train_batch_size=16, max_steps=6, replay_start_ratio=0.3)


class RecordingTrainer(CheckingTrainer):
    """Keeps each training batch, with the trajectories its replayed rows were made from (row -> trajectory), and
    checks each replaying loss against its parts (`tests/loss_check.py`)."""

    def _calculate_rewards(self, *args, **kwargs):
        if self._generation is not None:  # (set while TRL's `_generate_and_score_completions` runs)
            self._replayed_now = dict(self._generation.replayed_local)
        return super()._calculate_rewards(*args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        self._replayed_now = {}
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.batches.append((output, self._replayed_now))
        return output


def _tool_trainer(tmp_path, **kwargs):
    tokenizer = build_tool_tokenizer()
    trainer = RecordingTrainer(
        model=build_tool_model(tokenizer),
        args=make_args(tmp_path, **TOOL_SETTINGS),
        train_dataset=buttons_dataset(),
        processing_class=tokenizer,
        **kwargs,
    )
    trainer.batches = []
    return trainer


def _check_replayed_rows(trainer) -> int:
    """Every replayed row as stored, its tool results masked; returns the tool-result tokens seen in replayed rows."""
    replayed_tool_tokens = fresh_tool_tokens = replayed_rows = 0
    for output, replayed in trainer.batches:
        tool_tokens = (output["completion_mask"] == 1) & (output["tool_mask"] == 0)
        assert not (output["exp_mask"].bool() & tool_tokens).any()
        for row, trajectory in replayed.items():
            n = len(trajectory.completion_ids)
            assert output["completion_ids"][row, :n].tolist() == trajectory.completion_ids
            prompt = output["prompt_ids"][row][output["prompt_mask"][row].bool()].tolist()
            assert prompt == trajectory.prompt_ids  # trained after the context it was sampled in
            assert output["completion_mask"][row, n:].sum() == 0  # TRL's tool loop added nothing to it
            assert output["tool_mask"][row, :n].tolist() == trajectory.completion_mask  # masked as it was, fresh
            assert output["exp_mask"][row, :n].tolist() == trajectory.completion_mask
            replayed_tool_tokens += int(tool_tokens[row].sum())
            replayed_rows += 1
        fresh = [r for r in range(output["completion_ids"].size(0)) if r not in replayed]
        fresh_tool_tokens += int(tool_tokens[fresh].sum())
    assert replayed_rows > 0 and fresh_tool_tokens > 0
    return replayed_tool_tokens


def test_environment_factory_replays_stored_episodes_with_tool_results_masked(tmp_path):
    trainer = _tool_trainer(tmp_path, environment_factory=ButtonsEnv)
    trainer.train()
    assert _check_replayed_rows(trainer) > 0  # replayed rows do carry tool results, and they are masked
    assert_replaying_losses_compose(trainer)
    logged = [e for e in trainer.state.log_history if "replay/rows_fraction" in e]
    assert any(e["replay/rows_fraction"] > 0 and e["tools/call_frequency"] > 0 for e in logged)
    assert "replay/reward_mismatch" not in trainer.state.log_history[-2]  # environments are not replayed: no check


# ------------------------------------------------------------------------------------------ untrusted tool text


def _trained(tmp_path, trainer_cls, environment_factory, **options):
    tokenizer = build_tool_tokenizer()
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else ExReplayGRPOConfig
    trainer = trainer_cls(
        model=build_tool_model(tokenizer),
        args=make_args(tmp_path, config_cls, **{**TOOL_SETTINGS, "max_steps": 3, **options}),
        train_dataset=buttons_dataset(),
        processing_class=tokenizer,
        environment_factory=environment_factory,
    )
    trainer.train()
    return trainer


def _assert_trains_as(ours, theirs, reward_name: str | None = None) -> None:
    """The same training: every metric TRL logs, with the same value (bit-equal on CPU), and the same weights. TRL
    names an environment's reward after its class: `reward_name` is ours where the classes differ."""
    logged = [[e for e in t.state.log_history if "loss" in e] for t in (ours, theirs)]
    assert len(logged[0]) == len(logged[1]) == 3
    theirs_name = type(theirs.environments[0]).__name__
    for mine, trl in zip(*logged):
        for name, value in trl.items():
            if name in ("step_time", "train_runtime"):
                continue
            got = mine[name.replace(theirs_name, reward_name) if reward_name else name]
            assert got == value or (math.isnan(got) and math.isnan(value)), name
    for (name, mine), (_, trl) in zip(ours.model.named_parameters(), theirs.model.named_parameters()):
        assert torch.equal(mine, trl), name


def test_tool_text_is_trls_by_default_and_cleaned_on_request(tmp_path):
    """TRL's tool loop with replay off: by default the trainer is GRPOTrainer exactly, spelled special tokens in tool
    results and `reset()` observations included (no metric added); with tool_special_tokens='remove' it trains exactly
    as GRPOTrainer does on the same environment without the spellings, and counts every one removed."""
    trl = _trained(tmp_path / "trl", GRPOTrainer, SpellingButtonsEnv)
    ours = _trained(tmp_path / "ours", ExReplayGRPOTrainer, SpellingButtonsEnv, enable_experience_replay=False)
    _assert_trains_as(ours, trl)
    assert not any("env/special_tokens_removed" in entry for entry in ours.state.log_history)
    plain = _trained(tmp_path / "plain", GRPOTrainer, PlainButtonsEnv)
    # the spellings did reach TRL's model
    assert plain.state.log_history[0]["loss"] != trl.state.log_history[0]["loss"]
    SpellingButtonsEnv.resets = SpellingButtonsEnv.presses = 0
    cleaned = _trained(tmp_path / "cleaned", ExReplayGRPOTrainer, SpellingButtonsEnv, enable_experience_replay=False,
                       tool_special_tokens="remove")  # fmt: skip
    _assert_trains_as(cleaned, plain, reward_name="SpellingButtonsEnv")
    removed = [e["env/special_tokens_removed"] for e in cleaned.state.log_history if "env/special_tokens_removed" in e]
    assert SpellingButtonsEnv.resets == 3 * 16 and SpellingButtonsEnv.presses > 0
    assert removed[-1] == 2 * (SpellingButtonsEnv.resets + SpellingButtonsEnv.presses) and len(removed) == 3


def press(button: str) -> str:
    """
    Press a button.

    Args:
        button: The button's colour.
    """
    return "pressed " + button


def pressed_the_named_button(prompts, completions, **kwargs):
    rewards = []
    for prompt, completion in zip(prompts, completions):
        called = any(message.get("role") == "tool" for message in completion)
        rewards.append(float(called and "red" in prompt[-1]["content"]))
    return rewards


def test_standalone_tools_replay(tmp_path):
    trainer = _tool_trainer(tmp_path, tools=[press], reward_funcs=pressed_the_named_button)
    trainer.train()
    assert _check_replayed_rows(trainer) > 0
    assert_replaying_losses_compose(trainer)
    # Replayed tool calls are not run again, so their recomputed reward is not compared with the recorded one.
    assert not any("replay/reward_mismatch" in entry for entry in trainer.state.log_history)


# ---------------------------------------------------------------------------------------------------- rollout_func


def _word_rollout(calls: list[int], per_unique_prompt: int = 1):
    """A user's rollout_func: one completion per prompt it is given (a random word of the vocabulary, then eos);
    `per_unique_prompt` > 1 makes it generate that many per unique prompt instead, as a vLLM-server rollout might."""
    rng = random.Random(0)

    def rollout(prompts, trainer):
        calls.append(len(prompts))
        tokenizer = trainer.processing_class
        if per_unique_prompt > 1:  # assumes each group's prompts are all there, as TRL gives them without replay
            prompts = [p for p in prompts[::per_unique_prompt] for _ in range(per_unique_prompt)]
        prompt_ids = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for p in prompts
        ]
        words = ["red", "blue", "green", "cat"]
        completion_ids = [tokenizer(rng.choice(words))["input_ids"] + [tokenizer.eos_token_id] for _ in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout


def _rollout_trainer(tmp_path, rollout):
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    trainer = RecordingTrainer(
        model=build_tiny_model(tokenizer, seed=0),
        reward_funcs=said_target,
        args=make_args(tmp_path, max_steps=6),
        train_dataset=say_word_dataset(num_tasks=4, repeats=8),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    trainer.batches = []
    return trainer


def test_rollout_func_is_asked_for_the_fresh_rows_only(tmp_path):
    calls: list[int] = []
    trainer = _rollout_trainer(tmp_path, _word_rollout(calls))
    trainer.train()
    rows = trainer.args.per_device_train_batch_size
    replayed_per_step = [len(replayed) for _, replayed in trainer.batches]
    assert any(replayed_per_step)
    assert calls == [rows - k for k in replayed_per_step]
    assert_replaying_losses_compose(trainer)
    for output, replayed in trainer.batches:
        for row, trajectory in replayed.items():
            n = len(trajectory.completion_ids)
            assert output["completion_ids"][row, :n].tolist() == trajectory.completion_ids
            prompt = output["prompt_ids"][row][output["prompt_mask"][row].bool()].tolist()
            assert prompt == trajectory.prompt_ids  # trained after the context it was sampled in
            prompt = output["prompt_ids"][row][output["prompt_mask"][row].bool()].tolist()
            assert prompt == trajectory.prompt_ids
            assert output["exp_mask"][row, :n].tolist() == trajectory.completion_mask


def test_rollout_func_extra_fields_reach_reward_functions_on_replaying_steps(tmp_path):
    """A per-row field a rollout_func returns (TRL passes it to the reward functions) has a value for replayed rows
    too, so a reward function that reads it does not fail when replay starts."""
    calls: list[int] = []
    words = _word_rollout(calls)

    def rollout(prompts, trainer):
        output = words(prompts, trainer)
        return {**output, "env_reward": [0.5] * len(output["completion_ids"])}

    def env_reward(completions, env_reward, **kwargs):
        return [float(value) for value in env_reward]

    tokenizer = build_tiny_tokenizer(VOCABULARY)
    trainer = RecordingTrainer(
        model=build_tiny_model(tokenizer, seed=0),
        reward_funcs=[said_target, env_reward],
        args=make_args(tmp_path, max_steps=6),
        train_dataset=say_word_dataset(num_tasks=4, repeats=8),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    trainer.batches = []
    trainer.train()
    assert any(len(replayed) for _, replayed in trainer.batches)


def test_rollout_func_that_cannot_return_fewer_completions_is_refused_clearly(tmp_path):
    trainer = _rollout_trainer(tmp_path, _word_rollout([], per_unique_prompt=4))
    with pytest.raises(ValueError, match=r"rollout_func returned \d+ completions for \d+ prompts.*fresh rows"):
        trainer.train()


# ------------------------------------------------------------------------------------------------- two processes

SCRIPT = REPOSITORY / "tests" / "scripts" / "tool_replay_multiprocess.py"


@pytest.mark.slow
def test_tool_loop_replay_on_two_processes(tmp_path):
    """TRL's tool loop takes a different number of rounds on each rank; under ZeRO-3 each generation call gathers the
    sharded parameters, so the trainer runs the rounds in lockstep (a rank done early generates a throwaway row). (Under
    DDP the same rounds run without the lockstep's collectives: ZeRO-3 is the configuration that can hang.)"""
    accelerate_launch("recipes/accelerate/zero3_cpu.yaml", SCRIPT, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["pool_hash"] == ranks[1]["pool_hash"] and ranks[0]["losses"] == ranks[1]["losses"]
    assert sum(sum(rank["replayed_rows"]) for rank in ranks) > 0
    assert sum(sum(rank["masked_tool_tokens"]) for rank in ranks) > 0  # replayed tool results, masked
    assert all(torch.isfinite(torch.tensor(rank["losses"])).all() for rank in ranks)
    for rank in ranks:  # every replaying loss call of each rank: TRL's part plus the replayed term of loss.py
        assert rank["loss_checks"]
        for loss, trl, term in rank["loss_checks"]:
            assert loss == pytest.approx(trl + term, abs=1e-6, rel=1e-6)
    # (a rank whose rows of a step are all fresh adds a zero term; the replayed rows are on the other)
    assert any(abs(term) > 1e-4 for rank in ranks for _, _, term in rank["loss_checks"])
    uneven = [a != b for a, b in zip(ranks[0]["generation_calls"], ranks[1]["generation_calls"])]
    assert any(uneven)  # the ranks did take different numbers of tool rounds (the case that needs the lockstep)


@pytest.mark.parametrize(("mode", "tensor_parallel"), [("server", 1), ("colocate", 2)])
def test_tool_loop_replay_with_vllm_server_or_tensor_parallelism_is_refused_before_vllm_starts(
    tmp_path, mode, tensor_parallel
):
    tokenizer = build_tool_tokenizer()
    args = make_args(tmp_path, use_vllm=True, vllm_mode=mode, vllm_tensor_parallel_size=tensor_parallel)
    with pytest.raises(NotImplementedError, match=r"TRL's tool loop.*vllm_mode='colocate'"):
        ExReplayGRPOTrainer(
            model=build_tool_model(tokenizer),
            args=args,
            train_dataset=buttons_dataset(),
            processing_class=tokenizer,
            environment_factory=ButtonsEnv,
        )
