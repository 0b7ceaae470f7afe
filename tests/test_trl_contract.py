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


def _self_attributes(classes) -> tuple[set[str], set[str]]:
    """(read, assigned): the names of `self.<name>` loaded and stored in the methods of `classes`, from their source."""
    import ast
    import textwrap

    read, assigned = set(), set()
    for cls in classes:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                (assigned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read, assigned


def test_every_trl_attribute_the_trainer_reads_exists(tmp_path):
    """Derived from the code, not kept by hand: every `self.<name>` that the trainer's classes read and do not define
    themselves must be an attribute of TRL's trainer (a TRL that renames one fails here)."""
    from helpers import make_trainer

    ours = [cls for cls in ExReplayGRPOTrainer.__mro__ if cls.__module__.startswith("trl_exreplay")]
    read, assigned = _self_attributes(ours)
    defined = assigned | {name for cls in ours for name in vars(cls)}
    from_trl = read - defined
    trainer = make_trainer(tmp_path, max_steps=1)
    # Some exist only in a setting this run lacks (vLLM) or while `train()` runs: those TRL's or the Trainer's source
    # assigns.
    import transformers.trainer
    import trl.trainer.grpo_trainer

    sources = inspect.getsource(trl.trainer.grpo_trainer) + inspect.getsource(transformers.trainer)
    missing = sorted(
        name for name in from_trl if not hasattr(trainer, name) and not re.search(rf"self\.{name}\s*=", sources)
    )
    assert not missing, f"attributes read from TRL's trainer that it does not have: {missing}"
    assert {"loss_type", "num_generations", "_metrics", "accelerator"} <= from_trl  # the scan sees them


def test_the_supported_range_is_the_declared_pin_and_is_enforced():
    from packaging.requirements import Requirement

    pins = [Requirement(r) for r in requires("trl-exreplay") if Requirement(r).name == "trl"]
    assert [pin.specifier for pin in pins] == [Requirement(TRL_SUPPORTED).specifier]
    check_trl_version(TRL_MIN)
    check_trl_version("1.16.9")
    for outside in ("1.15.2", TRL_BELOW + ".0", "2.0.0"):
        with pytest.raises(ImportError, match=re.escape(f"supports {TRL_SUPPORTED}") + f".*found trl {outside}"):
            check_trl_version(outside)
