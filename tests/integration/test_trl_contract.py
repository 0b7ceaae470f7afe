"""The TRL contract: each assumption `trl_exreplay.trl_seam` records about TRL 1.16's `GRPOTrainer` (issue 72), one test
each, against the installed TRL: the supported versions, the signatures of the methods the trainer overrides and of
the TRL functions it calls, the layouts of the tuples TRL returns, the keys of its generation batch, the order of its
calls within a step (observed on a tiny run of TRL's own trainer), its old-log-probs condition, its loss mask and
`"dapo"` normaliser, its loss reading the clip range, its `RepeatSampler`, and that only the seam reads TRL's private
state. A TRL upgrade that changes one fails here, in CI, not in a run; each test's docstring says what it catches."""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from importlib.metadata import requires
from pathlib import Path

import pytest
import torch
from helpers import make_args, make_trainer
from trl import GRPOConfig, GRPOTrainer

from trl_exreplay import ExReplayGRPOTrainer, trl_seam
from trl_exreplay.demo.examples import VOCABULARY
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
from trl_exreplay.trl_seam import TRL_BELOW, TRL_MIN, TRL_SUPPORTED, check_trl_version

PACKAGE = Path(trl_seam.__file__).parent


@pytest.mark.fast  # in the fast lane: no training
def test_the_overrides_are_exactly_the_pinned_ones():
    """A new override of a TRL method fails here until the seam pins its signature and says why it exists and what it
    assumes (its docstring's list)."""
    ours = [cls for cls in ExReplayGRPOTrainer.__mro__ if cls.__module__.startswith("trl_exreplay")]
    overridden = sorted(
        name
        for cls in ours
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("__") and hasattr(GRPOTrainer, name)
    )
    assert overridden == sorted(trl_seam.OVERRIDDEN), "a new override of a TRL method: pin its signature in trl_seam"
    undocumented = [name for name in overridden if f"`{name}`" not in trl_seam.__doc__]
    assert undocumented == [], "say in trl_seam's docstring why each is overridden and what it assumes"


@pytest.mark.parametrize("name", sorted(trl_seam.OVERRIDDEN))
@pytest.mark.fast  # in the fast lane: no training
def test_each_overridden_trl_method_has_the_pinned_signature(name):
    """A TRL that renames, adds, removes or reorders a parameter of an overridden method fails here."""
    parameters = tuple(inspect.signature(getattr(GRPOTrainer, name)).parameters)
    assert parameters == trl_seam.OVERRIDDEN[name], f"GRPOTrainer.{name} changed: {parameters}"


@pytest.mark.parametrize("name", sorted(trl_seam.CALLED))
@pytest.mark.fast  # in the fast lane: no training
def test_each_trl_function_called_has_the_pinned_signature(name):
    """The TRL functions the package calls by keyword (`loss.py`, `selection.py`, `metrics.py`): a TRL that renames or
    drops a parameter fails here."""
    function = {"get_gamma_weights": trl_seam.gamma_weights, "get_off_policy_mask": trl_seam.off_policy_mask,
                "pad": trl_seam.pad, "nanstd": trl_seam.nanstd}[name]  # fmt: skip
    assert tuple(inspect.signature(function).parameters) == trl_seam.CALLED[name]


def _returns(method) -> list[tuple[str, ...]]:
    """The names in each `return a, b, ...` statement of `method`'s own body (not of functions nested in it)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0]
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            found.append(tuple(ast.unparse(element) for element in node.value.elts))
        stack.extend(ast.iter_child_nodes(node))
    return found


@pytest.mark.parametrize("name", sorted(trl_seam.RETURNS))
@pytest.mark.fast  # in the fast lane: no training
def test_trls_methods_return_the_tuples_the_seam_reads(name):
    """`trl_seam.returned` reads TRL's result tuples by position: a TRL that adds, drops or reorders an element of one
    (its `return` statements, read from its source) fails here."""
    returns = _returns(getattr(GRPOTrainer, name))
    assert returns and set(returns) == {trl_seam.RETURNS[name]}, returns


# --------------------------------------------------------------------------- a tiny run of TRL's own trainer
class Recorder(GRPOTrainer):
    """TRL's `GRPOTrainer`, recording the calls of each training generation batch and of each loss under the names the
    seam's `GENERATION_CALLS` and `LOSS_CALLS` give them, each forward's log-probs, and the batches. A probe column
    (`probe_row`: each row's index) is added to each batch, to follow the rows into the loss's micro-batches."""

    def _generate_and_score_completions(self, inputs):
        self.calls, self.forwards, self.generating = [], [], True
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.generating = False
        if self.model.training:
            self.batches.append({"calls": self.calls, "forwards": self.forwards, "keys": set(output), **output})
            output = {**output, "probe_row": torch.arange(output["completion_ids"].size(0))}
        return output

    def _compute_loss(self, model, inputs):
        self.calls, self.forwards = [], []
        loss = super()._compute_loss(model, inputs)
        self.losses.append({"calls": self.calls, "inputs": inputs})
        return loss

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if self.generating:
            role = "reference" if model is self.ref_model else "policy, old log-probs"
        else:
            role = "policy, with grad" if torch.is_grad_enabled() else "policy, no grad"
        self.calls.append(f"_get_per_token_logps_and_entropies({role})")
        self.forwards.append(result[0])
        return result


def _recording(name):
    def method(self, *args, **kwargs):
        self.calls.append(name)
        return getattr(super(Recorder, self), name)(*args, **kwargs)

    return method


for _name in ("_generate", "_tokenize_prompts", "_generate_single_turn", "_tool_call_loop", "_calculate_rewards",
              "get_high_entropy_mask"):  # fmt: skip
    setattr(Recorder, _name, _recording(_name))


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """One optimizer step of TRL's trainer on the say-the-word task, with its old-log-probs forward
    (`num_iterations=2`), a reference model (`beta` > 0) and its token selection (`top_entropy_quantile` < 1)."""
    folder = tmp_path_factory.mktemp("contract")
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    build_tiny_model(tokenizer, seed=0).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    args = make_args(folder, GRPOConfig, max_steps=1, per_device_train_batch_size=8, num_iterations=2, beta=0.04,
                     top_entropy_quantile=0.5)  # fmt: skip
    trainer = make_trainer(folder, Recorder, args, model=str(folder / "model"))
    trainer.batches, trainer.losses = [], []
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    """One optimizer step of TRL's trainer with an `environment_factory` (its tool loop), old log-probs off, beta 0."""
    from tool_env import ButtonsEnv, build_tool_model, build_tool_tokenizer, buttons_dataset

    folder = tmp_path_factory.mktemp("contract-tools")
    tokenizer = build_tool_tokenizer()
    trainer = Recorder(
        model=build_tool_model(tokenizer),
        args=make_args(folder, GRPOConfig, max_steps=1, per_device_train_batch_size=8, max_completion_length=48),
        train_dataset=buttons_dataset(),
        processing_class=tokenizer,
        environment_factory=ButtonsEnv,
    )
    trainer.batches, trainer.losses = [], []
    trainer.train()
    return trainer


def test_trls_generation_calls_come_in_the_seams_order(text_run, tool_run):
    """`GENERATION_CALLS`, observed: tokenisation, generation, TRL's tool loop (with tools only), the old-log-probs
    forward, the reference forward, the rewards. The forwards are what their names say: the first policy forward
    returns the batch's `old_per_token_logps`, the reference one its `ref_per_token_logps`. A TRL that reorders these
    calls (say, rewards before the forwards, or the reference forward first) or adds a policy forward before the old
    log-probs one fails here; the trainer's override keeps the first forward's entropies as the generating policy's."""
    (batch,) = text_run.batches
    assert batch["calls"] == [call for call in trl_seam.GENERATION_CALLS if call != "_tool_call_loop"]
    old, ref = batch["forwards"]
    assert old is batch["old_per_token_logps"] and ref is batch["ref_per_token_logps"]
    (batch,) = tool_run.batches
    first_calls = list(dict.fromkeys(batch["calls"]))  # the tool loop's rounds generate again
    old_and_ref = ("_get_per_token_logps_and_entropies(policy, old log-probs)",
                   "_get_per_token_logps_and_entropies(reference)")  # fmt: skip
    assert first_calls == [call for call in trl_seam.GENERATION_CALLS if call not in old_and_ref]
    assert batch["calls"].count("_generate_single_turn") > 1  # the rounds of the tool loop ran


def test_trls_loss_calls_come_in_the_seams_order(text_run):
    """`LOSS_CALLS`, observed in every loss: one policy forward with grad, then the token selection. A TRL that makes
    another forward in its loss, or selects tokens elsewhere, fails here (the trainer keeps the first forward of a loss
    as its policy forward, and the selection made in it)."""
    assert text_run.losses and all(loss["calls"] == list(trl_seam.LOSS_CALLS) for loss in text_run.losses)


def test_trls_batch_keys_are_the_seams(text_run, tool_run):
    """The keys of `_generate_and_score_completions`'s output: `BATCH_KEYS` always, the optional ones by the run's
    settings. A TRL that renames, drops or adds a key fails here (an added one may need a place in
    `completion_token_fills`, for the rescue's splice, or in `attach_replay_tensors`)."""
    (text,) = text_run.batches
    assert text["keys"] == {*trl_seam.BATCH_KEYS, "old_per_token_logps", "ref_per_token_logps"}
    (tools,) = tool_run.batches
    assert tools["keys"] == {*trl_seam.BATCH_KEYS, "tool_mask"}


@pytest.mark.fast  # in the fast lane: no training
def test_the_rollout_func_keys_are_trls():
    """`ROLLOUT_KEYS` (what `custom_rollouts` asks of a user's `rollout_func`, and fills for the replayed rows) are the
    keys TRL's `_generate` requires of one, read from its source: a TRL that renames or adds one fails here."""
    required = re.search(r"required_keys = (\{[^}]*\})", inspect.getsource(GRPOTrainer._generate))
    assert required and ast.literal_eval(required.group(1)) == set(trl_seam.ROLLOUT_KEYS)


def test_the_per_token_tensors_are_the_ones_the_splice_widens(text_run, tool_run):
    """Every tensor of TRL's batch with one value per completion token is in `completion_token_fills` (which
    `step.splice_rescued` widens), `ref_per_token_logps` aside (rescue is off with beta != 0); `advantages` is one
    value per row. A TRL that adds a per-token tensor fails here."""
    for run in (text_run, tool_run):
        (batch,) = run.batches
        rows, width = batch["completion_ids"].shape
        per_token = {
            key for key in batch["keys"] if isinstance(batch[key], torch.Tensor) and batch[key].shape == (rows, width)
        }
        fills = trl_seam.completion_token_fills(batch, pad_token_id=0)
        assert per_token - {"ref_per_token_logps"} == set(fills) & batch["keys"]
        assert batch["advantages"].shape == (rows,)


def test_added_row_tensors_follow_their_rows_into_the_loss(text_run):
    """A tensor added to TRL's batch with the batch's rows as first dimension reaches each loss micro-batch with the
    rows it holds, through TRL's shuffle and split (`exp_mask`, `exreplay_row` and the other replay tensors ride so).
    A TRL that drops unknown keys or shuffles them apart from the rest fails here."""
    (batch,) = text_run.batches
    for loss in text_run.losses:
        inputs = loss["inputs"]
        rows = inputs["probe_row"]
        assert torch.equal(inputs["completion_ids"], batch["completion_ids"][rows])
        assert torch.equal(inputs["advantages"], batch["advantages"][rows])


def test_the_dapo_normaliser_and_the_loss_mask_are_trls(text_run, tool_run):
    """`count_loss_tokens` (what the trainer recounts after the rescue's splice) is TRL's `num_items_in_batch`, with
    and without a `tool_mask` (tool results out of the count). A TRL that counts other tokens fails here."""
    for run in (text_run, tool_run):
        (batch,) = run.batches
        assert torch.equal(trl_seam.count_loss_tokens(run.accelerator, batch), batch["num_items_in_batch"])
    (batch,) = tool_run.batches
    assert (batch["completion_mask"].bool() & (batch["tool_mask"] == 0)).any()  # tool results were left out


def test_trls_loss_reads_the_clip_range_when_it_runs(text_run):
    """`clip_range_removed` makes TRL's loss unclipped for one call and restores the range: a TRL that reads its clip
    range elsewhere than `epsilon_low` / `epsilon_high` when the loss runs (or caches it) fails here."""
    trainer, model = text_run, text_run.model
    trainer.calls, trainer.forwards = [], []  # the recorder's lists for these calls (the run's own are kept)
    (batch,) = text_run.batches
    inputs = {key: batch[key] for key in trl_seam.BATCH_KEYS}
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, ids, mask, ids.size(1) - batch["prompt_ids"].size(1)
        )
        inputs |= {
            "old_per_token_logps": logps - 1.0,
            "ref_per_token_logps": logps,
            "advantages": torch.ones(ids.size(0)),
        }
        clipped = GRPOTrainer._compute_loss(trainer, model, inputs)  # every ratio e > 1 + epsilon_high
        with trl_seam.clip_range_removed(trainer):
            unclipped = GRPOTrainer._compute_loss(trainer, model, inputs)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.2)
    assert unclipped < clipped - 0.5  # -A * e per token, where the clip would give -A * 1.2


def test_trls_train_sampler_has_the_fields_the_seam_reads(text_run):
    """`rewind_repeat_sampler` reads TRL's `RepeatSampler`: `shuffle`, `seed`, `generator`, `num_samples`, one
    permutation drawn per iteration. A TRL whose sampler is another class, renames a field or draws otherwise fails
    here (`tests/unit/test_schedule.py` holds the epoch-seeded sampler to TRL's orders)."""
    from trl.trainer.utils import RepeatSampler

    def sampler():
        return GRPOTrainer._get_train_sampler(text_run)

    inner = sampler()
    assert type(inner) is RepeatSampler
    assert (inner.shuffle, inner.seed, inner.num_samples) == (True, text_run.args.seed, len(text_run.train_dataset))
    assert isinstance(inner.generator, torch.Generator)
    orders = [list(inner) for _ in range(3)]
    for epoch in range(3):
        rewound = sampler()
        trl_seam.rewind_repeat_sampler(rewound, epoch)
        assert list(rewound) == orders[epoch]
    assert orders[1] != orders[2]


def _private_reads(path: Path, trl_private: set[str]) -> set[str]:
    """The attributes in `trl_private` that the module at `path` reads off any object, less those it defines itself
    (assigns, or names as a method or class attribute)."""
    tree = ast.parse(path.read_text())
    own, read = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in trl_private and isinstance(node.value, ast.Name):
            (own if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own |= {target.id for target in targets if isinstance(target, ast.Name)}
    return read - own


@pytest.mark.fast  # in the fast lane: no training
def test_only_the_seam_reads_trls_private_state_or_imports_below_trls_top_level():
    """TRL's private state (an underscored attribute TRL's or the Trainer's source assigns) is read only in
    `trl_seam`, and only `trl_seam` imports from a TRL submodule: the rest of the package uses `from trl import X`.
    A module that reaches around the seam fails here, naming what it reads."""
    import transformers.trainer
    import trl.trainer.base_trainer
    import trl.trainer.grpo_trainer

    sources = "".join(
        inspect.getsource(m) for m in (trl.trainer.grpo_trainer, trl.trainer.base_trainer, transformers.trainer)
    )
    trl_private = set(re.findall(r"self\.(_[a-z]\w*)\s*=", sources))
    assert {"_metrics", "_step", "_dist", "_tokenizer"} <= trl_private  # the checker sees TRL's state
    modules = [path for path in sorted(PACKAGE.rglob("*.py")) if path.name != "trl_seam.py"]
    around = {
        str(path.relative_to(PACKAGE)): reads for path in modules if (reads := _private_reads(path, trl_private))
    }
    assert around == {}
    below = []
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("trl."):
                below.append((str(path.relative_to(PACKAGE)), node.module))
            elif isinstance(node, ast.Import) and any(alias.name.startswith("trl.") for alias in node.names):
                below.append((str(path.relative_to(PACKAGE)), ast.unparse(node)))
    assert below == []


def _attributes(sources, name: str) -> tuple[set[str], set[str]]:
    """(read, assigned): the attributes of the variable `name` (`self`, `trainer`) loaded and stored in `sources`
    (classes or modules), from their source."""
    read, assigned = set(), set()
    for source in sources:
        tree = ast.parse(textwrap.dedent(inspect.getsource(source)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name:
                (assigned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read, assigned


def test_every_trl_attribute_the_trainer_reads_exists(tmp_path):
    """Derived from the code, not kept by hand: every `self.<name>` that the trainer's classes read and do not define
    themselves, and every `trainer.<name>` the seam and the parts' factories read, must be an attribute of TRL's
    trainer (a TRL that renames one fails here)."""
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
    loss, in training (with gradient accumulation and several steps per generation) and in evaluation, over the tokens
    `trl_seam.loss_mask` says TRL's loss trains (tool results, `tool_mask` 0, left out)."""
    from trl_exreplay.loss import reduce_as_trl

    tokenizer = build_tiny_tokenizer(VOCABULARY)
    build_tiny_model(tokenizer, seed=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
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
        "tool_mask": (torch.rand(rows, length, generator=generator) > 0.3).long(),  # tool results: out of the loss
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
            beta * per_token_kl, trl_seam.loss_mask(inputs), loss_type=loss_type, training=training,
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
