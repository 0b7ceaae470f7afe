"""Shared builders for the trainer tests: a tiny model, the say-the-word task and a trainer around them; and the
loader of the repository's scripts (recipes, benchmarks), which are files, not modules of the package."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer, GuidanceSettings, MultiTurnSettings, Trajectory
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

REPOSITORY = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str):
    """The script at `path` (relative to the repository) imported as module `name`."""
    spec = importlib.util.spec_from_file_location(name, REPOSITORY / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def benchmark_module(name: str):
    """The module `name` of a package beside the benchmarks' scripts (e.g. `replay_harness.statistics`), imported as
    those scripts import it: with benchmarks/ on the path."""
    folder = str(REPOSITORY / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


# The trainer tests train on the CPU unless EXREPLAY_TEST_DEVICE=cuda (tools/gpu_check.sh sets it on a lent GPU):
# then the same tests train the model on the GPU, and EXREPLAY_TEST_BF16=1 adds bf16 autocast for the runs whose
# assertions allow it. conftest.py makes CUDA deterministic, so that tests of bit-equality still compare like with like.
ON_CUDA = os.environ.get("EXREPLAY_TEST_DEVICE", "cpu") == "cuda"
BF16 = ON_CUDA and os.environ.get("EXREPLAY_TEST_BF16", "0") == "1"

TRAINER_DEFAULTS = dict(
    use_cpu=not ON_CUDA,
    bf16=BF16,
    report_to="none",
    seed=0,
    per_device_train_batch_size=16,
    num_generations=4,
    max_completion_length=4,
    max_steps=6,
    learning_rate=5e-2,
    logging_steps=1,
    save_strategy="no",
    replay_start_ratio=0.3,
    beta=0.0,
    disable_tqdm=True,
)
# Replay alone, without rescue, retired questions or the spread plan (the library's defaults before issue 55): for tests
# of replay's own mechanics whose exact figures those would change, from the first step on.
REPLAY_ONLY = dict(replay_rescue=0, replay_retire_solved=False, replay_spread_plan=False)
# Rescue and retired questions with revisits, without the spread plan: the defaults from issue 55 to issue 69 (`teach`).
TEACH = dict(replay_retire_solved=True, replay_spread_plan=False)


def make_args(tmp_path, config_cls=ExReplayGRPOConfig, **overrides):
    """`config_cls` with the tests' defaults and `overrides` (the names it has; the optional parts' settings go to
    `part_settings`). The default `replay_start_ratio` is left out where replay starts by capability."""
    kwargs = {**TRAINER_DEFAULTS, "output_dir": str(tmp_path / "out"), **overrides}
    solved = kwargs.get("replay_start") == "solved" or (
        kwargs.get("replay_start") is None and kwargs.get("replay_profile") == "exgrpo"
    )
    if solved and "replay_start_ratio" not in overrides:
        del kwargs["replay_start_ratio"]
    known = config_cls.__dataclass_fields__
    return config_cls(**{name: value for name, value in kwargs.items() if name in known})


def config_and_parts(config_cls=ExReplayGRPOConfig, **kwargs) -> tuple:
    """`config_cls(**kwargs)` without the optional parts' settings, and the trainer's keyword arguments for those
    (`part_settings`)."""
    parts = part_settings(kwargs)
    skip = {*MultiTurnSettings.__dataclass_fields__, *GuidanceSettings.__dataclass_fields__}
    return config_cls(**{k: v for k, v in kwargs.items() if k not in skip}), parts


def part_settings(overrides: dict) -> dict:
    """The trainer's keyword arguments for the optional parts' settings among `overrides` (`multi_turn`,
    `guidance`), as `make_trainer` passes them."""
    multi_turn = {k: v for k, v in overrides.items() if k in MultiTurnSettings.__dataclass_fields__}
    guidance = {k: v for k, v in overrides.items() if k in GuidanceSettings.__dataclass_fields__}
    parts = {}
    if multi_turn:
        parts["multi_turn"] = MultiTurnSettings(**multi_turn)
    if guidance:
        parts["guidance"] = GuidanceSettings(**guidance)
    return parts


def make_trainer(
    tmp_path,
    trainer_cls=ExReplayGRPOTrainer,
    args=None,
    num_tasks=4,
    *,
    model=None,
    reward_funcs=said_target,
    trainer_kwargs: dict | None = None,
    **overrides,
):
    """`trainer_cls` on the say-the-word task: the tiny model (or `model`, e.g. a saved one's path), `overrides` of
    the config's fields (or `args`), and further keyword arguments of the trainer in `trainer_kwargs`."""
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    args = args if args is not None else make_args(tmp_path, **overrides)
    return trainer_cls(
        model=build_tiny_model(tokenizer, seed=0) if model is None else model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=say_word_dataset(num_tasks=num_tasks, repeats=8),
        processing_class=tokenizer,
        **{**part_settings(overrides), **(trainer_kwargs or {})},
    )


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def reseal_pool(path: str) -> None:
    """Record the current sizes and checksums of the files of the pool saved at `path` in its ``state.json`` (and
    that file's own checksum): a hand-edited pool that passes the checksums, as a careful attacker would publish."""
    import json
    import os

    from trl_exreplay.pool.check import file_checksum, state_checksum
    from trl_exreplay.pool.store import read_arrow

    state_path = os.path.join(path, "state.json")
    with open(state_path) as f:
        state = json.load(f)
    for entry in [state["tasks"], *state["shards"]]:
        file = os.path.join(path, entry["name"])
        if os.path.isfile(file):
            entry.update(size=os.path.getsize(file), xxh3_64=file_checksum(file))
            rows = read_arrow(file).num_rows if "rows" in entry else None
            if rows is not None and rows != entry["rows"]:  # a shard with rows added or removed
                entry.update(rows=rows, live=min(entry["live"], rows))
    state["checksum"] = state_checksum(state)
    with open(state_path, "w") as f:
        json.dump(state, f)


class RecordingTrainer(ExReplayGRPOTrainer):
    """Keeps every generation batch as the trainer builds it (before TRL shuffles it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = []
        self.generated_rows = []
        generate = self.model.generate

        def counting_generate(*a, **kw):
            self.generated_rows.append(kw["input_ids"].size(0))
            return generate(*a, **kw)

        self.model.generate = counting_generate

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            # the pool as the plan saw it: pending outcomes are flushed before planning, the new ones only queued
            self.batches.append((output, {t: self.pool.trajectories(t) for t in self.pool.stored_tasks()}))
        return output


def traj(task_id, entropy, version=0, n=3, first=10):
    return Trajectory(
        task_id,
        prompt_ids=[1, 2],
        completion_ids=list(range(first, first + n)),
        completion_mask=[1] * (n - 1) + [0],
        logps=[-0.25 * (i + 1) for i in range(n)],
        rewards=[1.0, 0.5],
        reward=1.0,
        entropy=entropy,
        policy_version=version,
    )


def ids(tokenizer, text: str) -> list[int]:
    """Token ids of whitespace-separated words, by vocabulary look-up (every word must be known)."""
    out = tokenizer.convert_tokens_to_ids(text.split())
    assert tokenizer.unk_token_id not in out, text
    return out


class ScriptedGenerate:
    """`generate(contexts, max_new_tokens)` returning a fixed action per turn (a string, or a function of the
    context's ids returning one); records every call."""

    def __init__(self, tokenizer, turns):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.calls: list[tuple[list[list[int]], int]] = []

    def __call__(self, contexts, max_new_tokens):
        self.calls.append(([list(c) for c in contexts], max_new_tokens))
        action = self.turns[len(self.calls) - 1]
        return [ids(self.tokenizer, action(c) if callable(action) else action) for c in contexts]


def gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether process `pid` has exited and been reaped (waits up to `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def kill_a_save_at_random(
    command: list[str], chooser, target: int, env: dict, on_saved=None
) -> tuple[str, str | None]:
    """Run a saver script that prints `saving N DIGEST` before and `saved N DIGEST SECONDS` after its N-th save, and
    SIGKILL it at a random instant (drawn from `chooser`) of save `target`. `on_saved()` runs after each completed
    save. Returns the digest of the last completed save and that of the save in flight (None: killed between saves)."""
    import subprocess

    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    lines, seconds = [], 0.01
    for line in child.stdout:
        lines.append(line.split())
        if lines[-1][0] == "saved":
            seconds = float(lines[-1][3])
            if on_saved is not None:
                on_saved()
        elif int(lines[-1][1]) == target:  # save `target` has begun: kill it at a random instant
            time.sleep(chooser.uniform(0.0, 1.2 * seconds))
            break
    child.kill()
    # only whole lines: the kill can cut the child's last line short (a line without its newline)
    lines += [line.split() for line in child.stdout.read().split("\n")[:-1] if line.strip()]
    child.wait()
    committed = [words[2] for words in lines if words[0] == "saved"][-1]
    return committed, lines[-1][2] if lines[-1][0] == "saving" else None


def spelling_episodes(factory) -> tuple[list[tuple], int]:
    """`process_envs.SpellingEnv`'s game (or `PlainEnv`'s) played for 4 tasks through `factory` (the class, or a pool
    of it): each episode's (prompt ids, completion ids, env mask, reward), and the special-token spellings the engine
    removed."""
    from collections import Counter

    from process_envs import SPELLING_VOCABULARY

    from trl_exreplay.envs.rollout import MultiTurnRollout

    tokenizer = build_tiny_tokenizer(SPELLING_VOCABULARY)
    tasks = [{"task_id": f"door-{i}", "door": door} for i, door in enumerate(["red", "blue", "red", "blue"])]
    engine = MultiTurnRollout(factory, tokenizer, max_turns=4, max_completion_length=64, workers=4)
    played = engine.run(tasks, ScriptedGenerate(tokenizer, ["look <eos>", "open <eos>"]))
    engine.close()
    assert engine.errors == Counter()
    return [(e.prompt_ids, e.completion_ids, e.env_mask, e.reward) for e in played], engine.special_tokens_removed


def part_of(trainer, kind):
    """The trainer's optional part of class `kind` (`trl_exreplay.parts.StepHooks`), or None."""
    return next((part for part in trainer._parts if isinstance(part, kind)), None)
