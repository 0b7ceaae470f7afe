"""The vLLM generation path, with a stand-in for vLLM (no GPU here) that keeps TRL 1.16's server-mode contract.

TRL's server mode gathers all prompts, generates `num_generations` completions per `prompts[::num_generations]` and
slices the result in equal per-process shares. The stand-in does the same in one process, so the test checks that
only fresh rows are sent (as single generations), that vLLM's sampling log-probs of replayed rows are the recorded
ones, and that TRL's vLLM importance-sampling correction is neutral (1) on replayed rows.
"""

from __future__ import annotations

import math

import torch
from helpers import RecordingTrainer, make_trainer
from loss_check import CheckingTrainer, assert_replaying_losses_compose


class ServerModeStandIn:
    """Generates uniform random words; logprob of each token is log(1 / vocab)."""

    def __init__(self, vocab_ids: list[int], length: int = 4, seed: int = 0):
        self.vocab_ids = vocab_ids
        self.length = length
        self.generator = torch.Generator().manual_seed(seed)
        self.calls: list[tuple[int, int]] = []
        self.syncs = 0

    def sync_weights(self):
        self.syncs += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        self.calls.append((len(prompts), num_generations))
        unique = prompts[::num_generations]
        completions = []
        for _ in unique:
            for _ in range(num_generations):
                picks = torch.randint(len(self.vocab_ids), (self.length,), generator=self.generator).tolist()
                completions.append([self.vocab_ids[p] for p in picks])
        prompt_ids = [p for p in unique for _ in range(num_generations)]
        logprob = -math.log(len(self.vocab_ids))
        logprobs = [[[logprob] for _ in c] for c in completions]
        return prompt_ids, completions, logprobs, None


class CheckedRecordingTrainer(RecordingTrainer, CheckingTrainer):
    """Records the batches and checks each replaying loss against its parts (`tests/loss_check.py`)."""


def test_vllm_server_contract(tmp_path):
    # Rescue off: a rescued row is sent to vLLM and then trained as a replayed row, and this test counts the replayed
    # rows against the rows sent (`test_rescued_rows_get_a_neutral_vllm_ratio_at_sequence_level` covers rescue).
    trainer = make_trainer(
        tmp_path, trainer_cls=CheckedRecordingTrainer, max_steps=8, vllm_importance_sampling_correction=True,
        replay_rescue=0,
    )  # fmt: skip
    tokenizer = trainer.processing_class
    words = [tokenizer.convert_tokens_to_ids(w) for w in ("red", "green", "blue", "cat", "dog", "sun", "say")]
    stand_in = ServerModeStandIn(words)
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, "server", stand_in
    trainer.vllm_importance_sampling_correction, trainer._last_loaded_step = True, -1
    trainer.train()

    assert len(stand_in.calls) == len(trainer.batches) == 8
    replay_steps = 0
    for (rows_sent, num_generations), (output, _) in zip(stand_in.calls, trainer.batches):
        replayed = output["exp_mask"].bool().any(dim=1)
        assert rows_sent == 16 - int(replayed.sum())  # fresh rows only
        if replayed.any():
            replay_steps += 1
            assert num_generations == 1  # groups are partial: one generation per sent row
            # the vLLM correction is neutral on replayed rows; the sampling log-probs there are the recorded ones
            assert torch.equal(
                output["importance_sampling_ratio"][replayed],
                torch.ones_like(output["importance_sampling_ratio"][replayed]),
            )
            mask = output["exp_mask"][replayed].bool()
            recorded = output["recorded_per_token_logps"][replayed]
            # not sampled now: no sampler log-probs (NaN, which TRL's sampling metrics skip); the loss takes the
            # recorded ones
            assert torch.isnan(output["sampling_per_token_logps"][replayed][mask]).all()
            # recorded log-probs are the training model's (TRL computed old log-probs), not vLLM's uniform ones
            assert not torch.allclose(recorded[mask], torch.full_like(recorded[mask], -math.log(len(words))))
        fresh = ~replayed
        fresh_mask = output["completion_mask"][fresh].bool()
        assert torch.allclose(
            output["sampling_per_token_logps"][fresh][fresh_mask], torch.tensor(-math.log(len(words)))
        )
    assert replay_steps >= 3
    assert stand_in.syncs == 8  # weights pushed once per step
    assert_replaying_losses_compose(trainer)  # TRL's loss with its IS correction on fresh rows, plus the term
    sampling = [v for e in trainer.state.log_history for k, v in e.items() if k.startswith("sampling/")]
    assert sampling and all(math.isfinite(v) for v in sampling)  # replayed rows do not reach TRL's sampler metrics


def test_vllm_server_mode_samples_each_guided_row_on_its_own_prompt(tmp_path):
    """Server mode samples `num_generations` completions of `prompts[::num_generations]`: with guided rows in a group,
    the group's rows hold different prompts, so every step is sent one generation per row (before replay starts
    too), and each row's completion comes from its own prompt, guided or not."""
    from test_guidance import GUIDED, FixedProvider

    trainer = make_trainer(tmp_path, trainer_cls=RecordingTrainer, max_steps=3, replay_start_ratio=1.0,
                           trainer_kwargs={"experience_provider": FixedProvider()}, **GUIDED)  # fmt: skip
    tokenizer = trainer.processing_class
    words = [tokenizer.convert_tokens_to_ids(w) for w in ("red", "green", "blue", "cat", "dog", "sun", "say")]
    stand_in = ServerModeStandIn(words)
    sent = []
    generate = stand_in.generate

    def recording(prompts, images, num_generations, profiler=None):
        sent.append([list(p) for p in prompts])
        return generate(prompts, images, num_generations, profiler)

    stand_in.generate = recording
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, "server", stand_in
    trainer._last_loaded_step = -1
    trainer.train()
    assert stand_in.calls == [(16, 1)] * 3  # one generation per row: no row is sampled on another row's prompt
    guided_prompts = [sum(1 for p in prompts if tokenizer.convert_tokens_to_ids("please") in p) for prompts in sent]
    assert guided_prompts == [8, 8, 8]  # round(4 * 0.5) rows of each of the 4 groups, every task retrieving


def test_the_vllm_stand_ins_keep_trls_signatures():
    """The stand-ins replace TRL's `VLLMGeneration`: a TRL that renames, adds or reorders a parameter of the methods
    the trainer calls (`generate`, `sync_weights`) must fail here, not pass against a stale imitation."""
    import inspect

    from test_vllm_multiturn import FakeVLLMGeneration
    from trl.generation.vllm_generation import VLLMGeneration

    for stand_in in (ServerModeStandIn, FakeVLLMGeneration):
        for name in ("generate", "sync_weights"):
            theirs = list(inspect.signature(getattr(VLLMGeneration, name)).parameters)
            ours = list(inspect.signature(getattr(stand_in, name)).parameters)
            assert ours == theirs, (stand_in.__name__, name, theirs)


def test_rescued_rows_get_a_neutral_vllm_ratio_at_sequence_level(tmp_path):
    """A rescued row's tokens are a stored success, not the failed rollout vLLM sampled: its vLLM importance ratio is
    1, at TRL's sequence level (one ratio per row, shape (B, 1)) as at token level, like a replayed row's; the fresh
    rows keep TRL's ratio. Replay never starts here (start ratio 1), so every row the loss marks replayed is rescued."""
    trainer = make_trainer(tmp_path, trainer_cls=RecordingTrainer, max_steps=12, replay_start_ratio=1.0,
                           vllm_importance_sampling_correction=True,
                           vllm_importance_sampling_mode="sequence_truncate")  # fmt: skip
    tokenizer = trainer.processing_class
    words = [tokenizer.convert_tokens_to_ids(w) for w in ("red", "green", "blue", "cat", "dog", "sun", "say")]
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, "server", ServerModeStandIn(words)
    trainer.vllm_importance_sampling_correction, trainer._last_loaded_step = True, -1
    trainer.train()
    rescued_steps = 0
    for output, _ in trainer.batches:
        ratio = output["importance_sampling_ratio"]
        assert ratio.shape == (16, 1)
        rescued = output["exreplay_replayed"].bool()
        if rescued.any():
            rescued_steps += 1
            assert torch.equal(ratio[rescued], torch.ones_like(ratio[rescued]))
        # the fresh rows' ratios are TRL's own: vLLM's uniform log-probs against the model's, not 1
        assert not torch.equal(ratio[~rescued], torch.ones_like(ratio[~rescued]))
    assert rescued_steps >= 1
    assert sum(e.get("replay/rescued_groups", 0) for e in trainer.state.log_history) > 0
