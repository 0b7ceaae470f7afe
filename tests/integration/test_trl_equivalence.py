"""ExReplayGRPOTrainer against TRL's GRPOTrainer over a grid of TRL options (issue 25, point 2).

With replay off, and with replay on before anything is replayed (``replay_start_ratio=1.0``: the pool fills, nothing
is drawn from it; rescue and retired questions off, `REPLAY_ONLY`: by design they act from the first step), the trainer must train exactly as TRL does from the same model, data and seed: the same losses,
the same weights after the steps (so the same gradients), and every metric TRL logs, under the same name, with the
same value (bit-equal on CPU). Replay adds only its own ``replay/*`` metrics.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import REPLAY_ONLY, make_args, make_trainer
from trl import GRPOConfig, GRPOTrainer

from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

# (name, TRL options), each checked with replay off and with replay on before anything is replayed.
GRID = [
    *((f"loss_type={t}", {"loss_type": t}) for t in TRL_LOSS_TYPES),
    *((f"loss_type={t}, beta=0.04", {"loss_type": t, "beta": 0.04}) for t in TRL_LOSS_TYPES),
    ("kl bias correction", {"beta": 0.04, "use_bias_correction_kl": True}),
    ("top_entropy_quantile=0.5, entropy_coef=0.5", {"top_entropy_quantile": 0.5, "entropy_coef": 0.5}),
    ("entropy_coef=0.1, dapo", {"entropy_coef": 0.1, "loss_type": "dapo"}),
    ("gradient_accumulation_steps=2", {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 8}),
    ("num_iterations=2", {"num_iterations": 2}),
    ("steps_per_generation=2", {"steps_per_generation": 2, "per_device_train_batch_size": 8}),
    ("mask_truncated_completions", {"mask_truncated_completions": True}),
    ("scale_rewards=batch", {"scale_rewards": "batch"}),
    ("epsilon_high=0.28", {"epsilon_high": 0.28}),
    ("importance_sampling_level=sequence", {"importance_sampling_level": "sequence"}),
    ("delta=1.5", {"delta": 1.5}),
    ("off_policy_mask_threshold=0.5", {"off_policy_mask_threshold": 0.5}),
    ("use_adaptive_entropy", {"use_adaptive_entropy": True}),
]
STEPS = 3


def _trained(tmp_path, model_dir, trainer_cls=ExReplayGRPOTrainer, **options):
    """`trainer_cls` trained from the tiny model saved at `model_dir` (a path, so that TRL can load it again as the
    reference model when beta > 0)."""
    config_cls = GRPOConfig if trainer_cls is GRPOTrainer else ExReplayGRPOConfig
    args = make_args(tmp_path, config_cls, max_steps=STEPS, learning_rate=1e-2, **options)
    trainer = make_trainer(tmp_path, trainer_cls, args, model=model_dir)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    build_tiny_model(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _logged(trainer) -> list[dict]:
    return [
        {k: v for k, v in entry.items() if k not in ("step_time", "train_runtime")}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]


def _assert_same_as_trl(ours, theirs) -> None:
    mine, trl = _logged(ours), _logged(theirs)
    assert len(mine) == len(trl) == STEPS
    for step, (a, b) in enumerate(zip(mine, trl)):
        missing = sorted(set(b) - set(a))
        assert not missing, f"step {step}: TRL's metrics {missing} are not logged"
        for name, value in b.items():
            same = a[name] == value or (math.isnan(a[name]) and math.isnan(value))
            assert same, f"step {step}: {name} = {a[name]!r}, TRL: {value!r}"
        extra = sorted(k for k in set(a) - set(b) if not k.startswith(("replay/", "env/")))
        assert not extra, f"step {step}: metrics {extra} are not TRL's nor replay's"
    for (name, mine_param), (_, trl_param) in zip(ours.model.named_parameters(), theirs.model.named_parameters()):
        assert torch.equal(mine_param, trl_param), name


@pytest.mark.parametrize("name, options", GRID, ids=[name for name, _ in GRID])
def test_equal_to_trl_with_replay_off_and_before_replay_starts(tmp_path, model_dir, name, options):
    theirs = _trained(tmp_path / "trl", model_dir, GRPOTrainer, **options)
    off = _trained(tmp_path / "off", model_dir, enable_experience_replay=False, **options)
    _assert_same_as_trl(off, theirs)
    on = _trained(tmp_path / "on", model_dir, replay_start_ratio=1.0, **REPLAY_ONLY, **options)
    _assert_same_as_trl(on, theirs)
    assert any("replay/fresh_reward" in entry for entry in _logged(on))  # the pool was fed meanwhile


# A chat template that renders TRL's vision-language messages (content as a list of text and image parts).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<' + message['role'] + '> ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "{{ ' <eos> ' }}{% endfor %}{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
)


def tiny_llava(tmp_path):
    """A tiny LLaVA (CLIP vision tower, Llama text model) saved to a folder, and its processor: a vision-language
    model as TRL sees one (the processing class is a processor)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )  # fmt: skip

    tokenizer = build_tiny_tokenizer([*VOCABULARY, "<image>"])
    image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=14, image_token="<image>",
        chat_template=VLM_CHAT_TEMPLATE,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14, projection_dim=16,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>")
    )
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).save_pretrained(tmp_path / "llava")
    return str(tmp_path / "llava"), processor


def test_a_vision_language_model_trains_as_trl_does_with_replay_off_and_says_so(tmp_path, caplog):
    """The pool stores token ids, not images, so a vision-language model cannot replay: with the defaults (replay on)
    the swap trains anyway, exactly as GRPOTrainer (same metrics, same weights), and one warning says why."""
    model, processor = tiny_llava(tmp_path)
    dataset = say_word_dataset(num_tasks=3, repeats=8)
    runs = {}
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), (ExReplayGRPOTrainer, ExReplayGRPOConfig)):
        args = make_args(tmp_path / trainer_cls.__name__, config_cls, max_steps=STEPS, learning_rate=1e-2)
        with caplog.at_level("WARNING", logger="trl_exreplay"):
            runs[trainer_cls] = trainer_cls(
                model=model, reward_funcs=said_target, args=args, train_dataset=dataset,
                processing_class=processor,
            )  # fmt: skip
            runs[trainer_cls].train()
    ours, theirs = runs[ExReplayGRPOTrainer], runs[GRPOTrainer]
    assert ours.args.enable_experience_replay and not ours.settings.enable_experience_replay
    _assert_same_as_trl(ours, theirs)
    assert not any(key.startswith("replay/") for entry in _logged(ours) for key in entry)
    said = [r.getMessage() for r in caplog.records if "experience replay is off for this run" in r.getMessage()]
    assert len(said) == 1 and "vision-language model" in said[0], said
