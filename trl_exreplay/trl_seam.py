"""The seam with TRL: everything this package assumes of TRL 1.16's `GRPOTrainer` beyond its public API, in one place.

The rest of the package reaches TRL through this module, or through TRL's public top-level names (`trl.GRPOTrainer`,
`trl.GRPOConfig`) and the overrides themselves, which must stay methods of `ExReplayGRPOTrainer`. Here are:

* the TRL versions the assumptions were checked against, enforced at import (`check_trl_version`);
* the keys of the batch `_generate_and_score_completions` returns (`BATCH_KEYS`, `OPTIONAL_BATCH_KEYS`), which of them
  are per completion token (`completion_token_fills`), and the layouts of the tuples TRL's methods return
  (`RETURNS`);
* the order in which TRL calls the methods we override within a step (`GENERATION_CALLS`, `LOSS_CALLS`);
* the reads of TRL's private state: its metric lists, its micro-step counter, its tokenizer, its distributed mode, its
  environments (`logged_metrics`, `micro_step`, ...), its condition for the old-log-probs forward
  (`computes_old_logps`), its `"dapo"` normaliser (`count_loss_tokens`), the fields of its `RepeatSampler`
  (`rewind_repeat_sampler`), and the one write: the clip range, removed for one loss (`clip_range_removed`);
* TRL's helpers that live below its public API (`pad`, `nanstd`, `unwrap_model_for_generation`, the static
  `get_gamma_weights` and `get_off_policy_mask`, GRPO's citation).

`tests/integration/test_trl_contract.py` pins each of these against the installed TRL: one test per assumption, each
failing when TRL changes it. A TRL upgrade is the checklist in docs/architecture.md ("Upgrading TRL").

The overrides (`OVERRIDDEN` pins their TRL signatures): why each exists, and what it assumes of TRL (in
`trl/trainer/grpo_trainer.py` unless said). Each calls `super()`; none copies a TRL method body.

* `_get_train_sampler`: each epoch's rows drawn by the epoch's number, so that a resumed run draws what the run that
  was not stopped draws. Assumes: TRL's sampler is a `RepeatSampler` (`utils.py`) whose `__iter__` draws one
  `randperm` of `num_samples` from `generator` (seeded with `seed`) when `shuffle` (`rewind_repeat_sampler`).
* `_generate_and_score_completions`: the replay plan before TRL's method, the batch tagged after it. Assumes: called
  once per generation batch by `_prepare_inputs`; returns `BATCH_KEYS` and some of `OPTIONAL_BATCH_KEYS`; a tensor we
  add with the batch's rows as its first dimension follows the rows through `shuffle_sequence_dict` and
  `split_tensor_dict` into the loss's micro-batches.
* `_generate`: TRL's completion figures taken again over the fresh rows. Assumes: returns `RETURNS["_generate"]`;
  calls `_tokenize_prompts`, then `_generate_single_turn` (or the `rollout_func`), then `_tool_call_loop`
  (`GENERATION_CALLS`); the `prompt_ids` list it passes to them is the one it returns (replay rewrites it in place).
* `_tokenize_prompts`: guided rows sampled on their guided prompt. Assumes: returns `RETURNS["_tokenize_prompts"]`.
* `_generate_single_turn`: only the fresh rows generated, the replayed completions spliced in. Assumes: returns
  `RETURNS["_generate_single_turn"]`; its first call in a batch generates the batch's rows (later ones: tool rounds).
* `_tool_call_loop`: replayed rows (finished episodes) kept out of TRL's tool loop, ranks in lockstep. Assumes: returns
  `RETURNS["_tool_call_loop"]`.
* `_get_tool_suffix_ids`: special tokens removed from tool results. Assumes: called once per tool result, before TRL
  tokenizes it.
* `_calculate_rewards`: replayed rows keep their recorded rewards; all-fail groups are rescued. Assumes: returns the
  rewards of the global rows (gathered) that the advantages are computed from, after the old and reference forwards.
* `_compute_loss`: the replayed tokens' term added; ExGRPO's unclipped fresh tokens. Assumes: reads `advantages` per
  row, and `epsilon_low` / `epsilon_high` when it runs (`clip_range_removed`); normalises as `loss.reduce_as_trl`.
* `_get_per_token_logps_and_entropies`: the loss's forward kept (the replayed term and the pool's records), and the
  generating policy's entropies. Assumes: the order of `GENERATION_CALLS` and `LOSS_CALLS`: when
  `computes_old_logps`, a batch's first policy forward is the old-log-probs one; a loss's first forward is its policy
  forward.
* `get_high_entropy_mask`: the replayed term takes the tokens TRL's loss selects. Assumes: called by `_compute_loss`
  after its forward (`LOSS_CALLS`).
* `save_model` / `_load_optimizer_and_scheduler`: the pool in every checkpoint, restored on resume. Assumes
  (transformers' `Trainer`): `_save_checkpoint` calls `save_model` with the checkpoint folder; a resume calls
  `_load_optimizer_and_scheduler` with it.

The class attributes `_tag_names`, `_name` and `_paper` are TRL's too: its model card (`base_trainer.py`,
`create_model_card`) reads them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version

import torch

TRL_MIN, TRL_BELOW = "1.16.0", "1.17"
TRL_SUPPORTED = f"trl>={TRL_MIN},<{TRL_BELOW}"


def check_trl_version(found: str | None = None) -> None:
    """Raise `ImportError` unless TRL's version (installed, or `found`) is in `TRL_SUPPORTED` (``pyproject.toml``'s
    pin): a TRL outside it may have changed what this module assumes, silently.

    ```python
    from trl_exreplay.trl_seam import TRL_SUPPORTED, check_trl_version

    check_trl_version("1.16.0")
    try:
        check_trl_version("1.17.0")
    except ImportError as e:
        assert TRL_SUPPORTED in str(e)
    ```
    """
    from packaging.version import Version

    if found is None:
        try:
            found = version("trl")
        except PackageNotFoundError:
            raise ImportError(f"trl_exreplay needs TRL ({TRL_SUPPORTED}); it is not installed.") from None
    if not Version(TRL_MIN) <= Version(found) < Version(TRL_BELOW):
        raise ImportError(
            f"trl_exreplay supports {TRL_SUPPORTED} (its trainer overrides private methods of that GRPOTrainer); "
            f"found trl {found}. Install a supported one: pip install '{TRL_SUPPORTED}'."
        )


check_trl_version()

# Below TRL's public API (checked by the version above and pinned by the contract tests): used, never copied.
from trl import GRPOTrainer  # noqa: E402
from trl.models import unwrap_model_for_generation  # noqa: E402, F401
from trl.trainer.utils import nanstd, pad  # noqa: E402, F401

gamma_weights = GRPOTrainer.get_gamma_weights  # VESPO's weights, a static method of TRL's loss
off_policy_mask = GRPOTrainer.get_off_policy_mask  # OPSM's mask, a static method of TRL's loss
GRPO_CITATION = GRPOTrainer._paper["citation"]

# ------------------------------------------------------------------------------------------------ signatures
# The parameters of each TRL method `ExReplayGRPOTrainer` overrides, as TRL 1.16 defines them (names, in order).
OVERRIDDEN = {
    "_get_train_sampler": ("self", "dataset"),
    "_generate_and_score_completions": ("self", "inputs"),
    "_generate": ("self", "prompts"),
    "_get_per_token_logps_and_entropies": (
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
        "pixel_values",
        "image_grid_thw",
        "num_images",
        "pixel_attention_mask",
        "spatial_shapes",
        "num_tiles",
        "image_sizes",
        "token_type_ids",
        "mm_token_type_ids",
        "image_position_ids",
    ),
    "_generate_single_turn": (
        "self",
        "prompt_ids",
        "images",
        "multimodal_fields",
        "num_generations",
        "has_tool_images",
    ),
    "_tokenize_prompts": ("self", "prompts"),
    "_calculate_rewards": ("self", "inputs", "prompts", "completions", "completion_ids_list"),
    "_tool_call_loop": (
        "self",
        "prompts",
        "prompt_ids",
        "completion_ids",
        "completions",
        "logprobs",
        "images",
        "multimodal_fields",
    ),
    "_get_tool_suffix_ids": ("self", "tool_messages"),
    "_compute_loss": ("self", "model", "inputs"),
    "get_high_entropy_mask": ("self", "entropies", "mask", "threshold"),
    "save_model": ("self", "output_dir", "_internal_call"),
    "_load_optimizer_and_scheduler": ("self", "checkpoint"),
}

# The parameters of the TRL functions the package calls (by keyword) without overriding them.
CALLED = {
    "get_gamma_weights": (
        "advantages",
        "log_ratio_per_token",
        "mask",
        "importance_sampling_ratio",
        "k_pos",
        "lambda_pos",
        "k_neg",
        "lambda_neg",
    ),
    "get_off_policy_mask": (
        "advantages",
        "per_token_logps",
        "sampling_per_token_logps",
        "mask",
        "off_policy_threshold",
    ),
    "pad": ("tensors", "padding_value", "padding_side", "pad_to_multiple_of"),
    "nanstd": ("tensor", "dim", "keepdim"),
}

# What the tuples TRL's methods return hold, in order (TRL's own names in its `return` statements).
RETURNS = {
    "_generate": (
        "prompt_ids",
        "completion_ids",
        "tool_mask",
        "completions",
        "logprobs",
        "extra_fields",
        "images",
        "tool_images",
    ),
    "_tool_call_loop": (
        "tool_mask",
        "completions",
        "completion_ids",
        "logprobs",
        "tool_call_count",
        "tool_failure_count",
        "tool_images",
    ),
    "_tokenize_prompts": ("prompt_ids", "images", "multimodal_fields"),
    "_generate_single_turn": ("completion_ids", "logprobs"),
    "_get_per_token_logps_and_entropies": ("logps", "entropies", "aux_loss"),
}


def returned(result: tuple, method: str, name: str):
    """The value named `name` in the tuple `result` that TRL's `method` returned (`RETURNS`)."""
    return result[RETURNS[method].index(name)]


# ------------------------------------------------------------------------------------------------ the batch
# The keys of `_generate_and_score_completions`'s output (grpo_trainer.py, its `output = {...}`): always these ...
BATCH_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch")
# ... and, by the run's settings: `old_per_token_logps` (when `computes_old_logps`), `importance_sampling_ratio`
# (vLLM's correction), `sampling_per_token_logps` (a generator that returns log-probs: vLLM, a rollout_func),
# `ref_per_token_logps` (beta != 0), `tool_mask` (tools, environments, a rollout_func's `env_mask`), and a
# vision-language model's inputs.
OPTIONAL_BATCH_KEYS = (
    "old_per_token_logps",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "num_images",
    "num_tiles",
)
# The keys a `rollout_func` must return (TRL raises without them; other keys go to the reward functions).
ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")


def completion_token_fills(batch: dict, pad_token_id: int) -> dict[str, float | int]:
    """The tensors of TRL's `batch` that hold one value per completion token (rows x the width of `completion_ids`),
    each with the value that pads it where a row's completion is shorter: what a splice of longer completions into the
    batch widens (`step.splice_rescued`). `importance_sampling_ratio` is one of them in vLLM's token modes only (one
    value per row in its sequence modes). `ref_per_token_logps` is not: TRL computes it only with beta != 0, where
    rescue, the one splice, is off."""
    fills = {
        "completion_ids": pad_token_id,
        "completion_mask": 0,
        "tool_mask": 1,
        "old_per_token_logps": 0.0,
        "sampling_per_token_logps": 0.0,
    }
    ratio = batch.get("importance_sampling_ratio")
    if ratio is not None and ratio.dim() == 2 and ratio.size(1) == batch["completion_ids"].size(1):
        fills["importance_sampling_ratio"] = 1.0
    return fills


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens TRL's loss trains (`_compute_loss`'s `mask`): the completion's, less the tool and environment
    tokens (`tool_mask` 0)."""
    return batch["completion_mask"] * batch.get("tool_mask", 1)


def count_loss_tokens(accelerator, batch: dict) -> torch.Tensor:
    """TRL's `num_items_in_batch` of `batch` (`_generate_and_score_completions`): its loss tokens summed over ranks,
    the normaliser of the `"dapo"`, `"cispo"` and `"vespo"` losses. Collective."""
    return accelerator.gather(loss_mask(batch).sum()).sum()


# ------------------------------------------------------------------------------------------------ call order
# The calls of one training generation batch, in the order `_generate_and_score_completions` makes them (the tiny run
# of the contract test: one tool-free single-turn batch, TRL's old-log-probs forward on, beta != 0).
GENERATION_CALLS = (
    "_generate",
    "_tokenize_prompts",
    "_generate_single_turn",
    "_tool_call_loop",  # only with tools or environments (not in the tool-free run)
    "_get_per_token_logps_and_entropies(policy, old log-probs)",  # when `computes_old_logps`
    "_get_per_token_logps_and_entropies(reference)",  # when beta != 0
    "_calculate_rewards",
)
# The calls of one loss (`_compute_loss`, per micro-batch).
LOSS_CALLS = (
    "_get_per_token_logps_and_entropies(policy, with grad)",
    "get_high_entropy_mask",  # when top_entropy_quantile < 1
)


def computes_old_logps(trainer) -> bool:
    """Whether TRL's `_generate_and_score_completions` makes its old-log-probs forward this step (its condition,
    grpo_trainer.py, before `old_per_token_logps = ...`): generation misaligned with the optimizer steps, or vLLM's
    importance-sampling correction."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    misaligned = trainer.args.gradient_accumulation_steps % generate_every != 0
    return misaligned or (trainer.use_vllm and trainer.vllm_importance_sampling_correction)


@contextlib.contextmanager
def clip_range_removed(trainer) -> Iterator[None]:
    """TRL's loss with no clip range while the block runs (ExGRPO's `loss_remove_clip`): `_compute_loss` reads
    `epsilon_low` and `epsilon_high` when it runs, and an infinite range clips nothing. Restored after."""
    clip = trainer.epsilon_low, trainer.epsilon_high
    trainer.epsilon_low = trainer.epsilon_high = float("inf")
    try:
        yield
    finally:
        trainer.epsilon_low, trainer.epsilon_high = clip


# ------------------------------------------------------------------------------------------------ private state
def logged_metrics(trainer, mode: str | None = None) -> dict[str, list]:
    """TRL's metric lists of `mode` ("train" or "eval"; default: the model's mode), `GRPOTrainer._metrics[mode]`: name
    -> the values its next `log` averages (NaN left out) and then clears."""
    return trainer._metrics[mode or ("train" if trainer.model.training else "eval")]


def micro_step(trainer) -> int:
    """The micro-batch's index within the optimizer step: TRL's `_step` (micro-batches trained, counted by
    `training_step`, 0 at every step boundary) modulo the accumulation steps. The same on every rank."""
    return trainer._step % trainer.args.gradient_accumulation_steps


def text_tokenizer(trainer):
    """The text tokenizer TRL uses (`_tokenizer`: the processing class, or a processor's tokenizer)."""
    return trainer._tokenizer


def is_vision_language(trainer) -> bool:
    """Whether TRL took the processing class for a vision-language model's processor (`_is_vlm`)."""
    return trainer._is_vlm


def distributed_mode(trainer):
    """TRL's `DistributedBackend` (`_dist`, distributed.py): `is_zero3`, `is_fsdp`."""
    return trainer._dist


def environment_instances(trainer) -> Iterator:
    """The `environment_factory` environments TRL has built so far (`_environment_pool`: name -> instances)."""
    for instances in trainer._environment_pool.values():
        yield from instances


def rewind_repeat_sampler(sampler, epoch: int) -> None:
    """Put TRL's `RepeatSampler` (utils.py) where its `epoch`-th iteration (from 0) starts, as if the ones before had
    run: its generator reseeded with `seed`, then one permutation of `num_samples` drawn per earlier epoch (what each
    `__iter__` draws when `shuffle`). Nothing to do for a sampler that does not shuffle, or has no seed."""
    if sampler.shuffle and sampler.seed is not None:
        sampler.generator.manual_seed(sampler.seed)
        for _ in range(epoch):
            torch.randperm(sampler.num_samples, generator=sampler.generator)
