"""The one-line swap, tried as a TRL user tries it: configurations in the style of TRL's own GRPO tests
(huggingface/trl tests/test_grpo_trainer.py: 3 completions a device, ``num_generations=3``, so ONE group a generation
batch), written against `trl.GRPOConfig`/`trl.GRPOTrainer`, run unchanged with ours and replay on with its defaults (the
tests of the replayed batch's layout with the spread plan off: `NO_PLAN`).

TRL's tests load tiny models and datasets from the Hub; here they are local stand-ins of the same kinds (a tiny causal
LM, a tiny sequence-classification reward model saved to a folder and named by its path, prompt-only datasets in
the standard and the conversational format). Each run must train (the weights move, as TRL's tests check), log the
replay metrics at every step, and, where the task gives the pool partial successes, replay.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock, Mock

import pytest
import torch
from datasets import Dataset
from helpers import ON_CUDA
from transformers import LlamaConfig, LlamaForSequenceClassification

from trl_exreplay import ExReplayGRPOConfig as GRPOConfig  # the swap, exactly as the README writes it
from trl_exreplay import ExReplayGRPOTrainer as GRPOTrainer
from trl_exreplay.demo.examples import VOCABULARY, WORDS, said_target
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer


def prompt_only(conversational: bool, num_tasks: int = 2, repeats: int = 16) -> Dataset:
    """TRL's `standard_prompt_only` / `conversational_prompt_only` shape, with no `task_id` column (tasks are then
    told apart by a hash of the prompt) and a `target` column for the reward."""
    prompts, targets = [], []
    for _ in range(repeats):
        for word in WORDS[:num_tasks]:
            text = f"say the word {word}"
            prompts.append([{"role": "user", "content": text}] if conversational else text)
            targets.append(word)
    return Dataset.from_dict({"prompt": prompts, "target": targets})


def tiny_reward_model(path, tokenizer) -> str:
    """A tiny sequence-classification reward model and its tokenizer, saved to `path` (TRL loads it by name)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def train(tmp_path, *, dataset=None, reward_funcs=said_target, trainer_kwargs=None, learning_rate=0.1, **config):
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    model = build_tiny_model(tokenizer, seed=0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        learning_rate=learning_rate,  # TRL's tests' settings
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=8,
        max_steps=12,
        report_to="none",
        use_cpu=not ON_CUDA,
        bf16=False,
        logging_steps=1,
        **config,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=prompt_only(conversational=False) if dataset is None else dataset,
        processing_class=tokenizer,
        **(trainer_kwargs or {}),
    )
    trainer.train()
    assert trainer.state.global_step == 12
    moved = [name for name, p in trainer.model.named_parameters() if not torch.equal(p.cpu(), before[name].cpu())]
    assert moved, "no parameter changed"
    tasks = [e["replay/tasks"] for e in trainer.state.log_history if "replay/tasks" in e]
    assert len(tasks) == 12  # every step logs replay, replaying or not
    return trainer, tasks


def replayed_on_alternate_batches(tasks: list[float]) -> bool:
    """One group a batch at replay_ratio 0.5: only odd generation batches may replay, and some did."""
    return any(tasks) and not any(tasks[n] for n in range(0, len(tasks), 2))


# The spread plan (a default) puts the one group of these 2-task runs on whichever task looks likelier to teach; at
# TRL's test rate 0.1 that is soon the task every rollout solves, and the pool is left with nothing to replay (its
# estimates are overconfident: docs/results.md, "Rollouts where they teach: the results"). These tests of replay's
# batch layout turn it off; `test_the_defaults_replay_a_batch_of_one_group` trains the defaults on 4 tasks.
NO_PLAN = {"replay_spread_plan": False}


@pytest.mark.parametrize("conversational", [False, True], ids=["standard", "conversational"])
def test_trl_default_batch_of_one_group_replays(tmp_path, conversational):
    trainer, tasks = train(tmp_path, dataset=prompt_only(conversational), **NO_PLAN)
    assert trainer.args.generation_batch_size == 3  # one group of 3: the batch the refusal used to reject
    assert replayed_on_alternate_batches(tasks), tasks


def test_the_defaults_replay_a_batch_of_one_group(tmp_path):
    """With the defaults (the spread plan on) a batch of one group trains and replays on alternate batches, 4 tasks
    giving the plan a choice; the plan redirected the group on some steps."""
    trainer, tasks = train(tmp_path, dataset=prompt_only(conversational=False, num_tasks=4))
    assert replayed_on_alternate_batches(tasks), tasks
    planned = [e["replay/spread_replanned_groups"] for e in trainer.state.log_history if "loss" in e]
    assert len(planned) == 12 and any(planned)


def test_with_an_evaluation_dataset(tmp_path):
    trainer, tasks = train(
        tmp_path,
        trainer_kwargs={"eval_dataset": prompt_only(conversational=False, repeats=3)},
        per_device_eval_batch_size=3,
        eval_strategy="steps",
        eval_steps=4,
        **NO_PLAN,
    )
    evaluations = [e for e in trainer.state.log_history if "eval_reward" in e]
    assert len(evaluations) == 3 and all(0.0 <= e["eval_reward"] <= 1.0 for e in evaluations)
    assert replayed_on_alternate_batches(tasks), tasks


def test_with_an_iterable_dataset(tmp_path, caplog):
    """An iterable dataset trains, replay on; the options that take dataset rows by index (retired questions, the
    spread plan) say once that they are off, and what happens instead."""
    dataset = prompt_only(conversational=False).to_iterable_dataset()
    with caplog.at_level("WARNING", logger="trl_exreplay.replay"):
        _, tasks = train(tmp_path, dataset=dataset, replay_retire_solved=True)
    assert replayed_on_alternate_batches(tasks), tasks
    said = [r.getMessage() for r in caplog.records if "read by index" in r.getMessage()]
    assert len(said) == 2
    assert "replay_retire_solved" in said[0] and "solved questions stay in the fresh stream" in said[0]
    assert "replay_spread_plan" in said[1] and "the sampler's groups are trained as drawn" in said[1]


def test_with_a_reward_model(tmp_path):
    """A reward model named by its path beside a reward function (TRL loads the model and its tokenizer); the pool
    counts a success when the total reward reaches `replay_success_threshold`."""
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    reward_model = tiny_reward_model(tmp_path / "reward_model", tokenizer)
    trainer, tasks = train(tmp_path, reward_funcs=[said_target, reward_model], reward_weights=[1.0, 0.01])
    assert "rewards/said_target/mean" in trainer.state.log_history[0]
    assert any(key.startswith("rewards/reward_model") for key in trainer.state.log_history[0])


def test_with_mask_truncated_completions(tmp_path):
    """Truncated completions are masked out of the loss and never enter the pool (what TRL does not train is not
    replayed). At TRL's learning rate 0.1 the tiny model stops succeeding at once; at 0.01 it keeps some successes."""
    trainer, tasks = train(tmp_path, mask_truncated_completions=True, learning_rate=0.01)
    clipped = [e["completions/clipped_ratio"] for e in trainer.state.log_history if "completions/clipped_ratio" in e]
    assert max(clipped) > 0  # some completions were truncated, hence masked
    assert replayed_on_alternate_batches(tasks), tasks


# --------------------------------------------------------------------------------------------------------------------
# Overrides called on a trainer that never ran our __init__, as TRL's own tests call them
# --------------------------------------------------------------------------------------------------------------------


def test_get_high_entropy_mask_on_a_stand_in_trainer_is_trls():
    """TRL's TestGetHighEntropyMask calls the method on a `Mock(spec=GRPOTrainer)` (ours, once swapped in)."""
    import trl

    trainer = Mock(spec=GRPOTrainer)
    trainer.accelerator = Mock(num_processes=1)
    trainer.accelerator.gather = lambda x: x
    trainer.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    ours = GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, 0.8)
    theirs = trl.GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, 0.8)
    assert torch.equal(ours, theirs)
    assert ours.tolist() == [[False] * 6, [False, False, True, True, False, False]]


def test_generation_on_a_trainer_built_without_our_init_is_trls():
    """TRL's rollout-dispatch tests build a trainer with `object.__new__` and set only TRL's attributes: our overrides
    then read our state's class defaults and do exactly what TRL's methods do."""
    import trl

    def bare(cls):
        trainer = object.__new__(cls)
        trainer.accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
        trainer.args = SimpleNamespace(report_to=[])
        trainer.model = SimpleNamespace(training=True)
        trainer.state = SimpleNamespace(global_step=2)
        trainer._last_loaded_step = 1
        trainer.use_vllm = True
        trainer.vllm_generation = SimpleNamespace(
            sync_weights=MagicMock(), generate=MagicMock(return_value=(None, [[2, 3]], [[[-0.1], [-0.2]]], None))
        )
        return trainer

    ours, theirs = bare(GRPOTrainer), bare(trl.GRPOTrainer)
    assert ours._generation is None and ours._loss_forward is None and not ours._replay_enabled
    result = ours._generate_single_turn([[1]], None, {}, 1)
    assert result == theirs._generate_single_turn([[1]], None, {}, 1)
    assert result[0] == [[2, 3]]
    ours.vllm_generation.sync_weights.assert_called_once()
