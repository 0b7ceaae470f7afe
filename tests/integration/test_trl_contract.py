"""The TRL contract: the range of TRL versions checked at import, and the signatures of the TRL methods that
`ExReplayGRPOTrainer` overrides (issue 25, point 6). A TRL upgrade that changes one fails here, in CI, not in a run."""

from __future__ import annotations

import inspect
import re
from importlib.metadata import requires

import pytest
from trl import GRPOTrainer

from trl_exreplay import ExReplayGRPOTrainer, trl_seam
from trl_exreplay.trl_seam import TRL_BELOW, TRL_MIN, TRL_SUPPORTED, check_trl_version

OVERRIDDEN = {name: list(parameters) for name, parameters in trl_seam.OVERRIDDEN.items()}  # pinned in the seam


@pytest.mark.fast  # in the fast lane: no training
def test_the_overrides_are_exactly_the_pinned_ones():
    ours = [cls for cls in ExReplayGRPOTrainer.__mro__ if cls.__module__.startswith("trl_exreplay")]
    overridden = sorted(
        name
        for cls in ours
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("__") and hasattr(GRPOTrainer, name)
    )
    assert overridden == sorted(OVERRIDDEN), "a new override of a TRL method: pin its signature here"


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
@pytest.mark.fast  # in the fast lane: no training
def test_each_overridden_trl_method_has_the_pinned_signature(name):
    parameters = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)
    assert parameters == OVERRIDDEN[name], f"GRPOTrainer.{name} changed: {parameters}"


def _attributes(sources, name: str) -> tuple[set[str], set[str]]:
    """(read, assigned): the attributes of the variable `name` (`self`, `trainer`) loaded and stored in `sources`
    (classes or modules), from their source."""
    import ast
    import textwrap

    read, assigned = set(), set()
    for source in sources:
        tree = ast.parse(textwrap.dedent(inspect.getsource(source)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name:
                (assigned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read, assigned


def test_every_trl_attribute_the_trainer_reads_exists(tmp_path):
    """Derived from the code, not kept by hand: every `self.<name>` that the trainer's classes read and do not define
    themselves must be an attribute of TRL's trainer (a TRL that renames one fails here)."""
    from helpers import make_trainer

    import trl_exreplay.envs.multiturn
    import trl_exreplay.guidance.rollouts
    import trl_exreplay.replay

    ours = [cls for cls in ExReplayGRPOTrainer.__mro__ if cls.__module__.startswith("trl_exreplay")]
    read, assigned = _attributes(ours, "self")
    defined = assigned | {name for cls in ours for name in vars(cls)}
    # The seam reads TRL's state off the trainer; the parts' factories (`for_trainer`, `guided_rollouts`) read TRL's
    # attributes off it once, when built.
    handed = (trl_seam, trl_exreplay.envs.multiturn, trl_exreplay.replay, trl_exreplay.guidance.rollouts)
    read_by_parts, _ = _attributes(handed, "trainer")
    from_trl = (read - defined) | {name for name in read_by_parts if name not in defined}
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
    assert {"loss_type", "num_generations", "_metrics", "accelerator", "model_wrapped", "_dist"} <= from_trl


@pytest.mark.fast  # in the fast lane: no training
def test_the_constructor_takes_trls_parameters_as_trl_does():
    """`ExReplayGRPOTrainer.__init__` names every `GRPOTrainer.__init__` parameter, in TRL's order, kind and default;
    ours follow, keyword-only."""
    trl = list(inspect.signature(GRPOTrainer.__init__).parameters.values())
    ours = list(inspect.signature(ExReplayGRPOTrainer.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(trl)]] == [(p.name, p.kind, p.default) for p in trl]
    extra = ours[len(trl) :]
    assert [p.name for p in extra] == [
        "experience_pool",
        "text_env_factory",
        "multi_turn",
        "guidance",
        "experience_provider",
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None for p in extra)


LOSS_SETTINGS = {"luspo": {"importance_sampling_level": "sequence"}}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_the_replayed_terms_reduction_is_trls_for_every_loss_type(tmp_path, loss_type):
    """`loss.reduce_as_trl` against TRL's own `_compute_loss`: at advantage 0 and ratio 1, TRL's loss is its KL term
    alone, `beta * KL` per token through TRL's normaliser; the same per-token values through ours must give the same
    loss, in training (with gradient accumulation and several steps per generation) and in evaluation."""
    import torch

    from trl_exreplay.demo.examples import VOCABULARY
    from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
    from trl_exreplay.loss import reduce_as_trl

    tokenizer = build_tiny_tokenizer(VOCABULARY)
    build_tiny_model(tokenizer, seed=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    from helpers import make_trainer

    beta, accumulation, per_generation = 0.25, 3, 2
    trainer = make_trainer(
        tmp_path, trainer_cls=GRPOTrainer, model=str(tmp_path / "model"), loss_type=loss_type, beta=beta,
        gradient_accumulation_steps=accumulation, steps_per_generation=per_generation, per_device_train_batch_size=8,
        **LOSS_SETTINGS.get(loss_type, {}),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    rows, prompt_length, length = 8, 3, 5
    vocabulary = len(tokenizer)
    completion_mask = torch.ones(rows, length, dtype=torch.long)
    completion_mask[torch.arange(rows), torch.randint(1, length, (rows,), generator=generator)] = 0
    completion_mask = completion_mask.cumprod(dim=1)  # each row ends somewhere
    inputs = {
        "prompt_ids": torch.randint(0, vocabulary, (rows, prompt_length), generator=generator),
        "prompt_mask": torch.ones(rows, prompt_length, dtype=torch.long),
        "completion_ids": torch.randint(0, vocabulary, (rows, length), generator=generator),
        "completion_mask": completion_mask,
        "advantages": torch.zeros(rows),
        "num_items_in_batch": completion_mask.sum() * 5,  # the generation batch's tokens: more than this micro-batch's
    }
    model = trainer.model
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    with torch.no_grad():
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, attention, length)
    inputs["ref_per_token_logps"] = logps + torch.randn(rows, length, generator=generator) * 0.3
    difference = inputs["ref_per_token_logps"] - logps
    per_token_kl = torch.exp(difference) - difference - 1
    trainer.current_gradient_accumulation_steps = accumulation
    for training in (True, False):
        model.train(training)
        with torch.no_grad():
            trl_loss = GRPOTrainer._compute_loss(trainer, model, dict(inputs))
        ours = reduce_as_trl(
            beta * per_token_kl, completion_mask, loss_type=loss_type, training=training,
            num_items_in_batch=inputs["num_items_in_batch"], num_processes=1, accumulation=accumulation,
            steps_per_generation=per_generation, max_completion_length=trainer.max_completion_length,
        )  # fmt: skip
        torch.testing.assert_close(ours, trl_loss, rtol=1e-5, atol=1e-7)
        assert trl_loss.abs() > 1e-4  # the comparison is not of two zeros


class OldLogpsTrainer(ExReplayGRPOTrainer):
    """Records, per generation batch, whether TRL computed old log-probs and whether the trainer expected it."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.seen = getattr(self, "seen", []) + [("old_per_token_logps" in output, trl_seam.computes_old_logps(self))]
        return output


@pytest.mark.parametrize(
    ("steps_per_generation", "accumulation", "iterations"),
    [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 4, 1), (2, 1, 1), (1, 1, 2)],  # the last two: TRL computes old log-probs
)
def test_the_old_logprobs_condition_is_trls(tmp_path, steps_per_generation, accumulation, iterations):
    """`trl_seam.computes_old_logps` (which sets whether the generating policy's entropies come from TRL's old-log-probs
    forward) says what TRL does: compared with the batch TRL returns, for aligned and misaligned schedules."""
    from helpers import make_trainer

    trainer = make_trainer(
        tmp_path, trainer_cls=OldLogpsTrainer, max_steps=2, per_device_train_batch_size=8,
        steps_per_generation=steps_per_generation, gradient_accumulation_steps=accumulation, num_iterations=iterations,
    )  # fmt: skip
    trainer.train()
    assert trainer.seen and all(computed == expected for computed, expected in trainer.seen), trainer.seen
    assert trainer.seen[0][0] == (accumulation % (steps_per_generation * iterations) != 0)  # the case is the one meant


def test_the_supported_range_is_the_declared_pin_and_is_enforced():
    from packaging.requirements import Requirement

    pins = [Requirement(r) for r in requires("trl-exreplay") if Requirement(r).name == "trl"]
    assert [pin.specifier for pin in pins] == [Requirement(TRL_SUPPORTED).specifier]
    check_trl_version(TRL_MIN)
    check_trl_version("1.16.9")
    for outside in ("1.15.2", TRL_BELOW + ".0", "2.0.0"):
        with pytest.raises(ImportError, match=re.escape(f"supports {TRL_SUPPORTED}") + f".*found trl {outside}"):
            check_trl_version(outside)
