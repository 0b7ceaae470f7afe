"""`evaluate_policy`: one greedy episode per task through `MultiTurnRollout`, tallied per group, faults counted."""

from __future__ import annotations

import pytest
import torch

from trl_exreplay.demo import KeyDoorEnv
from trl_exreplay.demo.tiny import build_tiny_tokenizer
from trl_exreplay.demo.toy import COLOURS, KEY_DOOR_VOCABULARY
from trl_exreplay.envs.evaluation import evaluate_policy


class ScriptedPolicy(torch.nn.Module):
    """A policy whose answer is a function of what it read: "key" first, then a colour: the door's, except for green
    doors, where it always says "blue" (and so never wins)."""

    def __init__(self, tokenizer):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # gives the policy a device
        self.tokenizer = tokenizer
        self.generation_config = type("GenerationConfig", (), {"eos_token_id": tokenizer.eos_token_id})()
        self.calls: list[tuple[int, bool, dict]] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.calls.append((len(input_ids), self.training, kwargs))
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            seen = self.tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True).split()
            door = next(word for word in seen if word in COLOURS)
            answer = "key" if "have" not in seen else ("blue" if door == "green" else door)
            new = self.tokenizer(answer, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            rows.append(ids + new + [self.tokenizer.pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


class FaultyOnGold(KeyDoorEnv):
    def reset(self, task):
        if task["door"] == "gold":
            raise RuntimeError("the gold door's environment is down")
        return super().reset(task)


def test_evaluate_policy_tallies_wins_losses_and_faults():
    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
    policy = ScriptedPolicy(tokenizer)
    policy.train()
    tasks = [{"task_id": f"t{i}", "door": door} for i, door in enumerate(["red", "green", "blue", "gold", "red"])]
    result = evaluate_policy(
        policy, tokenizer, tasks, FaultyOnGold, max_turns=3, max_completion_length=64, max_tokens_per_turn=4,
        batch_size=3, group_column="door", workers=2,
    )  # fmt: skip
    assert [e.task["task_id"] for e in result.episodes] == ["t0", "t1", "t2", "t3", "t4"]  # task order kept
    assert [e.reward for e in result.episodes] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert [e.turns for e in result.episodes] == [2, 3, 2, 0, 2]  # green: "key", "blue", "blue" until max_turns
    assert result.successes == 3 and result.success_rate == 3 / 5 and result.errors == 1
    assert result.mean_turns == 9 / 5
    assert result.per_group == {"red": [2, 2], "green": [0, 1], "blue": [1, 1], "gold": [0, 1]}
    # batches of at most 3 episodes, greedy, in eval mode; the policy's training mode is given back
    assert max(n for n, _, _ in policy.calls) == 3 and all(not training for _, training, _ in policy.calls)
    assert all(kwargs.get("do_sample") is False for _, _, kwargs in policy.calls)
    assert policy.training


def test_success_threshold_counts_partial_rewards_as_failures():
    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
    tasks = [{"task_id": "t0", "door": "red"}]
    won = evaluate_policy(ScriptedPolicy(tokenizer), tokenizer, tasks, KeyDoorEnv, max_turns=3,
                          max_completion_length=64, success_threshold=1.0)  # fmt: skip
    strict = evaluate_policy(ScriptedPolicy(tokenizer), tokenizer, tasks, KeyDoorEnv, max_turns=3,
                             max_completion_length=64, success_threshold=1.5)  # fmt: skip
    assert won.success_rate == 1.0 and strict.success_rate == 0.0 and strict.per_group == {"all": [0, 1]}


def test_binomial_interval_is_wilsons():
    from trl_exreplay.envs.evaluation import binomial_interval

    # Reference values of the Wilson score interval (z = 1.959964).
    assert binomial_interval(14, 40) == pytest.approx((0.221345, 0.504941), abs=1e-6)
    assert binomial_interval(1, 2) == pytest.approx((0.094531, 0.905469), abs=1e-6)
    assert binomial_interval(0, 40) == (0.0, pytest.approx(0.087622, abs=1e-6))  # not empty at 0 successes
    assert binomial_interval(40, 40) == (pytest.approx(0.912378, abs=1e-6), 1.0)
    assert binomial_interval(0, 0) == (0.0, 1.0)
    low, high = binomial_interval(14, 40, confidence=0.5)
    assert 0.221345 < low < 0.35 < high < 0.504941
    with pytest.raises(ValueError, match="allowed values are integers 0 .. trials \\(40\\)"):
        binomial_interval(41, 40)
