"""Experience replay with a PEFT (LoRA) policy: the pool records the adapted model's log-probs, and LoRA trains."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_args
from loss_check import CheckingTrainer, assert_replaying_losses_compose

from trl_exreplay import ExperiencePool, ExReplayGRPOTrainer
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
from trl_exreplay.trainer import POOL_DIR

peft = pytest.importorskip("peft")

TEMPERATURE = 0.8


def lora_config():
    # init_lora_weights=False: B is not zero, so the adapter changes the model's outputs from the start
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def make_peft_trainer(tmp_path, trainer_cls=ExReplayGRPOTrainer, **overrides):
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    args = make_args(tmp_path, temperature=TEMPERATURE, **overrides)
    return trainer_cls(
        model=build_tiny_model(tokenizer, seed=0),
        reward_funcs=said_target,
        args=args,
        train_dataset=say_word_dataset(num_tasks=4, repeats=8),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )


def completion_logps(model, trajectory, temperature):
    """Per-token log-probs and entropies of the completion tokens, computed here from the logits (not through the
    trainer): one forward on prompt + completion, log_softmax(logits / temperature), gather the sampled tokens."""
    ids = torch.tensor([trajectory.prompt_ids + trajectory.completion_ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    n = len(trajectory.completion_ids)
    logits = logits[0, -n - 1 : -1].float().cpu() / temperature  # position t predicts token t + 1
    logps = torch.log_softmax(logits, dim=-1)
    entropies = -(logps.exp() * logps).sum(-1)
    return logps.gather(-1, torch.tensor(trajectory.completion_ids).unsqueeze(-1)).squeeze(-1), entropies


def lora_parameter(name: str) -> bool:
    return "lora_" in name


@pytest.mark.parametrize(
    "schedule",
    [
        {},  # aligned: the pool takes the log-probs of the loss forward
        # TRL computes old log-probs right after generation (the pool takes those); beta > 0 adds TRL's reference
        # forward, which with PEFT is the same module with its adapter disabled: it must not leak into the pool
        {"steps_per_generation": 2, "per_device_train_batch_size": 8, "beta": 0.04},
    ],
    ids=["aligned", "spg2-beta"],
)
def test_recorded_logps_are_the_adapted_models(tmp_path, schedule):
    trainer = make_peft_trainer(tmp_path, max_steps=8, learning_rate=0.0, replay_start_ratio=0.25, **schedule)
    model = trainer.model
    assert isinstance(model, peft.PeftModel)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(lora_parameter(name) for name in trainable)
    assert not any(p.requires_grad for name, p in model.named_parameters() if not lora_parameter(name))

    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer.train()
    model.eval()
    # learning_rate 0: the policy that generated every stored trajectory is the final one
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key

    # the adapter is not a no-op: adapted and base logits differ
    prompt = [{"role": "user", "content": "say the word red"}]
    probe = trainer.processing_class.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)
    probe = torch.tensor([probe["input_ids"]], device=model.device)
    with torch.no_grad():
        adapted_logits = model(input_ids=probe).logits
        with model.disable_adapter():
            base_logits = model(input_ids=probe).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-2

    trajectories = [t for task in trainer.pool.stored_tasks() for t in trainer.pool.trajectories(task)]
    assert len(trajectories) >= 3
    for trajectory in trajectories[:6]:
        mask = torch.tensor(trajectory.completion_mask, dtype=torch.bool)
        assert mask.any() and len(trajectory.logps) == len(trajectory.completion_ids)
        recorded = torch.tensor(trajectory.logps)
        adapted, adapted_entropies = completion_logps(model, trajectory, TEMPERATURE)
        with model.disable_adapter():
            base, base_entropies = completion_logps(model, trajectory, TEMPERATURE)
        torch.testing.assert_close(recorded[mask], adapted[mask], atol=1e-5, rtol=0)
        assert (recorded[mask] - base[mask]).abs().max() > 1e-3
        assert not recorded[~mask].any()
        # the recorded entropy is the adapted model's too
        assert trajectory.entropy == pytest.approx(adapted_entropies[mask].mean().item(), abs=1e-5)
        assert abs(trajectory.entropy - base_entropies[mask].mean().item()) > 1e-4

    replayed = [e["replay/rows_fraction"] for e in trainer.state.log_history if "replay/rows_fraction" in e]
    assert max(replayed) > 0  # stored trajectories were replayed in training batches
    off_policy = [e for e in trainer.state.log_history if "replay/importance_ratio_mean" in e]
    assert off_policy
    for entry in off_policy:  # replayed against the policy that recorded them (unchanged): ratio 1, no drift
        assert entry["replay/importance_ratio_min"] == pytest.approx(1.0, abs=1e-4)
        assert entry["replay/importance_ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert entry["replay/logp_drift"] == pytest.approx(0.0, abs=1e-4)


def test_lora_learns_with_replay_and_saves_an_adapter(tmp_path):
    trainer = make_peft_trainer(tmp_path, CheckingTrainer, max_steps=4, learning_rate=5e-2, replay_start_ratio=0.25)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert all(lora_parameter(k) for k in changed), sorted(k for k in changed if not lora_parameter(k))
    assert any("lora_A" in k for k in changed) and any("lora_B" in k for k in changed)
    assert max(e.get("replay/rows_fraction", 0) for e in trainer.state.log_history) > 0
    assert_replaying_losses_compose(trainer)  # TRL's loss of the adapted model plus the replayed term

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    names = set(os.listdir(out))
    assert {"adapter_config.json", "adapter_model.safetensors", "exreplay_pool"} <= names, names
    assert "model.safetensors" not in names  # the adapter only, not the full model
    saved_pool = ExperiencePool.load(str(out / POOL_DIR))
    assert saved_pool.num_trajectories == trainer.pool.num_trajectories > 0
    assert saved_pool.content_hash() == trainer.pool.content_hash()

    # the saved adapter on a fresh base model is the trained policy
    reloaded = peft.PeftModel.from_pretrained(build_tiny_model(trainer.processing_class, seed=0), str(out))
    reloaded.to(trainer.model.device)
    trainer.model.eval()
    ids = torch.tensor([saved_pool.trajectories(saved_pool.stored_tasks()[0])[0].prompt_ids], device=reloaded.device)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
