"""The TRL contract: the range of TRL versions checked at import, and the signatures of the TRL methods that
`ExReplayGRPOTrainer` overrides (issue 25, point 6). A TRL upgrade that changes one fails here, in CI, not in a run."""

from __future__ import annotations

import inspect
import re
from importlib.metadata import requires

import pytest
from trl import GRPOTrainer

from trl_exreplay import ExReplayGRPOTrainer
from trl_exreplay.compat import TRL_BELOW, TRL_MIN, TRL_SUPPORTED, check_trl_version

# Parameters of each overridden method as TRL 1.16 defines them (names, in order).
OVERRIDDEN = {
    "_get_train_sampler": ["self", "dataset"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_get_per_token_logps_and_entropies": [
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
        "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
    ],
    "_generate_single_turn": ["self", "prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"],
    "_tokenize_prompts": ["self", "prompts"],
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "_tool_call_loop": [
        "self", "prompts", "prompt_ids", "completion_ids", "completions", "logprobs", "images", "multimodal_fields",
    ],
    "_compute_loss": ["self", "model", "inputs"],
    "get_high_entropy_mask": ["self", "entropies", "mask", "threshold"],
    "save_model": ["self", "output_dir", "_internal_call"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
}  # fmt: skip
# TRL attributes and methods the trainer reads or calls besides its overrides.
USED = [
    "_get_per_token_logps_and_entropies", "get_high_entropy_mask", "_metrics", "num_generations", "loss_type",
    "importance_sampling_level", "off_policy_mask_threshold", "use_adaptive_entropy", "_entropy_bonus_enabled",
    "entropy_coef", "aux_loss_enabled", "router_aux_loss_coef", "epsilon_low", "epsilon_high", "beta",
    "top_entropy_quantile", "max_completion_length", "reward_weights", "use_vllm", "tools", "rollout_func",
    "environment_factories", "_is_vlm", "environments", "vllm_mode", "vllm_tensor_parallel_size", "is_fsdp_enabled",
    "is_deepspeed_enabled", "_dist", "num_generations_eval",
]  # fmt: skip


def test_the_overrides_are_exactly_the_pinned_ones():
    ours = [cls for cls in ExReplayGRPOTrainer.__mro__ if cls.__module__.startswith("trl_exreplay")]  # and mixins
    overridden = sorted(
        name
        for cls in ours
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("__") and hasattr(GRPOTrainer, name)
    )
    assert overridden == sorted(OVERRIDDEN), "a new override of a TRL method: pin its signature here"


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_each_overridden_trl_method_has_the_pinned_signature(name):
    parameters = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)
    assert parameters == OVERRIDDEN[name], f"GRPOTrainer.{name} changed: {parameters}"


def test_the_trl_attributes_the_trainer_uses_exist(tmp_path):
    from helpers import make_trainer

    trainer = make_trainer(tmp_path, max_steps=1)
    missing = [name for name in USED if not hasattr(trainer, name)]
    assert not missing


def test_the_supported_range_is_the_declared_pin_and_is_enforced():
    from packaging.requirements import Requirement

    pins = [Requirement(r) for r in requires("trl-exreplay") if Requirement(r).name == "trl"]
    assert [pin.specifier for pin in pins] == [Requirement(TRL_SUPPORTED).specifier]
    check_trl_version(TRL_MIN)
    check_trl_version("1.16.9")
    for outside in ("1.15.2", TRL_BELOW + ".0", "2.0.0"):
        with pytest.raises(ImportError, match=re.escape(f"supports {TRL_SUPPORTED}") + f".*found trl {outside}"):
            check_trl_version(outside)
