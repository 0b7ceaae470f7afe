"""Multi-turn rollouts (`text_env_factory`) through TRL's colocated vLLM engine, with a stand-in for the engine.

vLLM cannot run here (no GPU), so `FakeVLLMGeneration` keeps the contract of TRL 1.16's `VLLMGeneration` that the
trainer relies on: `max_completion_length` read on every `generate(prompts, images, num_generations)` call, which
returns `(prompt_ids, completion_ids, logprobs, logprob_token_ids)` with `logprobs[seq][token][k]` (k = 1, the sampled
token's log-prob after temperature scaling), and `sync_weights()`. It really samples with the training model (the same
live weights, so its log-probs are the training policy's and TRL's importance-sampling ratio is ~1 on model tokens).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import REPLAY_ONLY, TRAINER_DEFAULTS, config_and_parts, ids, part_of

from trl_exreplay import ExReplayGRPOTrainer, trl_seam
from trl_exreplay.demo import KeyDoorEnv
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
from trl_exreplay.demo.toy import KEY_DOOR_VOCABULARY, key_door_dataset
from trl_exreplay.envs.multiturn import MultiTurnRollouts, MultiTurnSettings
from trl_exreplay.envs.rollout import MultiTurnRollout

MAX_TOKENS_PER_TURN = 4
MULTI_TURN = dict(max_completion_length=48, max_tokens_per_turn=MAX_TOKENS_PER_TURN, max_turns=5, learning_rate=5e-2)
TEMPERATURE = 0.8


class FakeVLLMGeneration:
    """Stand-in for TRL's colocated `VLLMGeneration`, sampling with the HF model it is given."""

    def __init__(self, model, tokenizer, temperature: float, max_completion_length: int, seed: int = 0):
        self.model = model
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = tokenizer.eos_token_id
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        self.seed = seed
        self.calls: list[tuple[int, int, int]] = []  # (prompts, max_completion_length, num_generations)
        self.events: list[str] = []  # "sync" / "generate", in order
        self.syncs = 0

    def sync_weights(self):
        self.syncs += 1
        self.events.append("sync")

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        assert images is None
        assert num_generations == 1
        self.calls.append((len(prompts), self.max_completion_length, num_generations))
        self.events.append("generate")
        torch.manual_seed(self.seed + len(self.calls))
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        generated = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=self.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=self.max_completion_length,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
        )[:, width:].tolist()
        completions = []
        for row in generated:  # up to and including the first eos, like vLLM
            completions.append(row[: row.index(self.eos_token_id) + 1] if self.eos_token_id in row else row)
        # log-probs of the sampled tokens: one right-padded forward over context + completion, logits / temperature
        sequences = [list(p) + c for p, c in zip(prompts, completions)]
        longest = max(len(s) for s in sequences)
        ids = torch.tensor([s + [self.pad_token_id] * (longest - len(s)) for s in sequences], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in sequences], device=device)
        logps = torch.log_softmax(self.model(input_ids=ids, attention_mask=mask).logits.float() / self.temperature, -1)
        logprobs = []
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            positions = range(len(prompt) - 1, len(prompt) - 1 + len(completion))
            logprobs.append([[logps[row, at, token].item()] for at, token in zip(positions, completion)])
        prompt_ids = [list(p) for p in prompts]
        return prompt_ids, completions, logprobs, [[[t] for t in c] for c in completions]


def make_trainer(tmp_path, **overrides) -> ExReplayGRPOTrainer:
    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
    kwargs = {**TRAINER_DEFAULTS, **MULTI_TURN, "output_dir": str(tmp_path / "out"), **overrides}
    args, parts = config_and_parts(**kwargs)
    return ExReplayGRPOTrainer(
        model=build_tiny_model(tokenizer, seed=0),
        args=args,
        train_dataset=key_door_dataset(num_tasks=2, repeats=40),
        processing_class=tokenizer,
        text_env_factory=KeyDoorEnv,
        **parts,
    )


def record_rollouts(trainer) -> list[tuple[dict, dict]]:
    """Wrap TRL's `rollout_func` (the trainer's `_part_rollout`): (output, replayed local rows) per call."""
    seen, rollout = [], trainer.rollout_func

    def recording(prompts, trainer_):
        step = trainer._generation  # the generation step in progress: its replayed rows, before the rollout takes them
        replayed = dict(step.replayed_local) if step.plan is not None and step.plan.replay_groups else {}
        output = rollout(prompts, trainer_)
        seen.append((output, replayed))
        return output

    trainer.rollout_func = recording
    return seen


def record_batches(trainer) -> list[dict]:
    batches, score = [], trainer._generate_and_score_completions

    def recording(inputs):
        output = score(inputs)
        batches.append(output)
        return output

    trainer._generate_and_score_completions = recording
    return batches


def record_episodes(trainer, engine: FakeVLLMGeneration) -> list[tuple[list, int]]:
    """Per rollout-engine run: (its episodes, the generate calls it made)."""
    runs, run = [], part_of(trainer, MultiTurnRollouts).engine.run

    def recording(tasks, generate, sync=None):
        before = len(engine.calls)
        episodes = run(tasks, generate, sync)
        runs.append((episodes, len(engine.calls) - before))
        return episodes

    part_of(trainer, MultiTurnRollouts).engine.run = recording
    return runs


# --------------------------------------------------------------------------------------------- the vLLM path
def test_multi_turn_rollouts_through_vllm_carry_sampling_logprobs(tmp_path):
    max_steps = 3
    trainer = make_trainer(
        tmp_path, max_steps=max_steps, replay_ratio=0.5, replay_start_ratio=0.0, temperature=TEMPERATURE, **REPLAY_ONLY
    )  # replayed rows only: a rescued row holds its recorded log-probs as its sampling ones (step.splice_rescued)
    engine = FakeVLLMGeneration(
        trainer.model, trainer.processing_class, trainer.temperature, trainer.max_completion_length
    )
    # What TRL's vLLM path reads (set by GRPOTrainer.__init__ only when use_vllm=True, which would import vllm).
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, "colocate", engine
    trainer._last_loaded_step = -1
    assert trainer.vllm_importance_sampling_correction  # TRL's default: the correction is on
    assert trainer.vllm_importance_sampling_mode == "sequence_mask"  # TRL's default: one ratio per sequence
    assert trl_seam.computes_old_logps(trainer)
    rollouts, batches = record_rollouts(trainer), record_batches(trainer)
    runs = record_episodes(trainer, engine)
    trainer.train()

    # -- the engine: weights synced once per generation step, before that step's generate calls
    assert trainer.state.global_step == max_steps
    assert engine.syncs == max_steps == len(rollouts) == len(runs)
    assert engine.events[0] == "sync" and engine.events.count("sync") == max_steps
    assert all(n == 1 and 1 <= limit <= MAX_TOKENS_PER_TURN for _, limit, n in engine.calls)
    assert engine.max_completion_length == trainer.max_completion_length == 48  # restored after every turn
    steps = "".join("|" if e == "sync" else "g" for e in engine.events).split("|")[1:]
    for (episodes, calls), generates in zip(runs, steps):
        assert calls == len(generates) == max(e.turns for e in episodes)  # one generate call per turn played
    assert sum(calls for _, calls in runs) == len(engine.calls)
    episodes_turns = sum(e.turns for episodes, _ in runs for e in episodes)
    assert sum(prompts for prompts, _, _ in engine.calls) == episodes_turns  # each active episode, once per turn
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == max_steps and all(math.isfinite(x) for x in losses)

    # -- the rollout output: one log-prob per completion token, None wherever the model did not sample it
    replayed_rows = closing_eos = 0
    for (output, replayed), (episodes, _) in zip(rollouts, runs):
        logprobs = output["logprobs"]
        assert isinstance(logprobs, list) and len(logprobs) == len(output["completion_ids"]) == 16
        assert len(episodes) == 16 - len(replayed)
        for i, (row, completion, env_mask) in enumerate(zip(logprobs, output["completion_ids"], output["env_mask"])):
            assert isinstance(row, list) and len(row) == len(completion) == len(env_mask)
            if i in replayed:
                assert row == [None] * len(completion)
                replayed_rows += 1
                continue
            for lp, trained in zip(row, env_mask):
                if trained:
                    assert isinstance(lp, float) and math.isfinite(lp) and lp <= 0.0
                else:
                    assert lp is None
            closing_eos += completion[-1] == trainer.processing_class.eos_token_id and env_mask[-1] == 0
        fresh_rows = [i for i in range(16) if i not in replayed]
        assert [output["completion_ids"][i] for i in fresh_rows] == [e.completion_ids for e in episodes]
        assert [output["logprobs"][i] for i in fresh_rows] == [e.logprobs for e in episodes]
    assert closing_eos > 0  # episodes ending on the rollout's (untrained, None) eos were checked
    assert replayed_rows > 0, "no row was replayed: the replayed-row assertions above checked nothing"

    # -- TRL's correction: sampling log-probs line up with the training model's, so the ratio is ~1 on model tokens
    assert len(batches) == max_steps
    for batch in batches:
        model_tokens = (batch["completion_mask"] * batch["tool_mask"]).bool()
        replayed = batch["exp_mask"].bool().any(dim=1)
        fresh_tokens = model_tokens & ~replayed.unsqueeze(1)
        sampled = batch["sampling_per_token_logps"]
        torch.testing.assert_close(sampled[fresh_tokens], batch["old_per_token_logps"][fresh_tokens])
        # the sequence ratio sums the log-ratios of the model tokens; NaN (None) ones would make it NaN or 0
        ratio = batch["importance_sampling_ratio"]
        assert ratio.shape == (16, 1)
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-3, rtol=0)
        env_tokens = (batch["completion_mask"] == 1) & (batch["tool_mask"] == 0)
        assert env_tokens.any() and torch.isnan(sampled[env_tokens]).all()  # None -> NaN: no correction there
        if replayed.any():
            assert torch.isnan(sampled[replayed][batch["completion_mask"][replayed].bool()]).all()
    differences = [e["sampling/sampling_logp_difference/max"] for e in trainer.state.log_history if "loss" in e]
    assert len(differences) == max_steps and max(differences) < 1e-3


def test_without_vllm_the_rollout_returns_no_logprobs(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    assert not trainer.use_vllm
    rollouts = record_rollouts(trainer)
    trainer.train()
    assert len(rollouts) == 1
    output, _ = rollouts[0]
    assert output["logprobs"] is None  # TRL computes the behaviour log-probs itself
    assert len(output["completion_ids"]) == 16


@pytest.mark.parametrize(("mode", "tensor_parallel"), [("server", 1), ("colocate", 2), ("server", 2)])
def test_vllm_server_mode_and_tensor_parallelism_are_rejected(tmp_path, mode, tensor_parallel):
    trainer = make_trainer(tmp_path, max_steps=1)
    # As GRPOTrainer.__init__ would leave them with use_vllm=True (which would import vllm).
    trainer.use_vllm, trainer.vllm_mode = True, mode
    trainer.vllm_tensor_parallel_size = trainer.args.vllm_tensor_parallel_size = tensor_parallel
    with pytest.raises(NotImplementedError, match="vllm_mode") as error:
        MultiTurnRollouts.for_trainer(KeyDoorEnv, trainer, MultiTurnSettings(), trainer.settings)
    message = str(error.value)
    assert "vllm_tensor_parallel_size" in message
    assert f"vllm_mode={mode!r}" in message and f"vllm_tensor_parallel_size={tensor_parallel}" in message


def test_vllm_colocate_without_tensor_parallelism_is_accepted(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.use_vllm, trainer.vllm_mode = True, "colocate"
    assert isinstance(
        MultiTurnRollouts.for_trainer(KeyDoorEnv, trainer, MultiTurnSettings(), trainer.settings), MultiTurnRollouts
    )


# ------------------------------------------------------------------------------------------ the rollout engine
class ScriptedGenerate:
    """A fixed action per turn; with `logprobs`, returns (ids, log-probs) with log-prob -(turn + 1 + j / 10) for the
    j-th token of the turn (turns counted from 0)."""

    def __init__(self, tokenizer, turns, logprobs: bool):
        self.tokenizer, self.turns, self.logprobs = tokenizer, list(turns), logprobs
        self.calls = 0

    def __call__(self, contexts, max_new_tokens):
        turn = self.calls
        self.calls += 1
        actions = [ids(self.tokenizer, self.turns[turn]) for _ in contexts]
        if not self.logprobs:
            return actions
        return actions, [[-(turn + 1 + j / 10) for j in range(len(a))] for a in actions]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(KEY_DOOR_VOCABULARY)


def test_episode_logprobs_follow_the_model_tokens(tok):
    engine = MultiTurnRollout(KeyDoorEnv, tok, max_turns=4, max_completion_length=64, step_timeout=5.0)
    turns = ["take the key <eos>", "open red door <eos>"]
    (episode,) = engine.run([{"task_id": "d", "door": "red"}], ScriptedGenerate(tok, turns, logprobs=True))
    env_turn = ids(tok, "<user> you have the key <eos> <assistant>")
    assert episode.completion_ids == ids(tok, turns[0]) + env_turn + ids(tok, turns[1])
    assert episode.env_mask == [1] * 4 + [0] * 7 + [1] * 4
    assert episode.logprobs == [-1.0, -1.1, -1.2, -1.3] + [None] * 7 + [-2.0, -2.1, -2.2, -2.3]
    assert episode.reward == 1.0

    # actions without eos: the closing eos after a turn, and the rollout's final eos, are not sampled (None)
    engine = MultiTurnRollout(KeyDoorEnv, tok, max_turns=2, max_completion_length=64, step_timeout=5.0)
    turns = ["take the key", "open blue door"]
    (episode,) = engine.run([{"task_id": "d", "door": "red"}], ScriptedGenerate(tok, turns, logprobs=True))
    eos = [tok.eos_token_id]
    assert episode.completion_ids == ids(tok, turns[0]) + eos + env_turn + ids(tok, turns[1]) + eos
    assert episode.env_mask == [1] * 3 + [0] * 8 + [1] * 3 + [0]
    assert episode.logprobs == [-1.0, -1.1, -1.2] + [None] * 8 + [-2.0, -2.1, -2.2, None]
    assert episode.reward == 0.0 and not episode.truncated


@pytest.mark.parametrize(
    ("second_action", "kept", "kept_logprobs"),
    [
        ("open red door <eos>", "open red", [-2.0, -2.1]),
        ("open <eos> red door", "open", [-2.0]),  # a cut completion does not end on eos: that one is dropped too
    ],
)
def test_episode_logprobs_are_cut_with_the_completion_budget(tok, second_action, kept, kept_logprobs):
    # 3 + 1 + 7 tokens after turn one; only 2 tokens of the second action fit, and their log-probs with them
    engine = MultiTurnRollout(KeyDoorEnv, tok, max_turns=4, max_completion_length=13, step_timeout=5.0)
    turns = ["take the key", second_action]
    (episode,) = engine.run([{"task_id": "d", "door": "red"}], ScriptedGenerate(tok, turns, logprobs=True))
    assert episode.truncated
    assert episode.completion_ids[11:] == ids(tok, kept)
    assert episode.env_mask == [1] * 3 + [0] * 8 + [1] * len(kept_logprobs)
    assert episode.logprobs == [-1.0, -1.1, -1.2] + [None] * 8 + kept_logprobs


def test_plain_generate_gives_no_logprobs(tok):
    engine = MultiTurnRollout(KeyDoorEnv, tok, max_turns=2, max_completion_length=64, step_timeout=5.0)
    turns = ["take the key <eos>", "open red door"]
    tasks = [{"task_id": "d", "door": "red"}, {"task_id": "e", "door": "green"}]
    episodes = engine.run(tasks, ScriptedGenerate(tok, turns, logprobs=False))
    assert [e.reward for e in episodes] == [1.0, 0.0]
    for episode in episodes:
        assert len(episode.completion_ids) == 15 and sum(episode.env_mask) == 7
        assert episode.logprobs == [None] * len(episode.completion_ids)
