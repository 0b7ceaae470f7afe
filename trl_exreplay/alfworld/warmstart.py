"""Warm-start data for ALFWorld: a word-level vocabulary for tiny models, expert episodes, and an SFT dataset laid out
token for token like the trainer's multi-turn rollouts.

RL from a random policy never wins an ALFWorld game, so there is nothing to reinforce or replay. A short SFT on
`SearchExpert` episodes gives the policy partial success first. The SFT rows are built by replaying each expert
episode through `MultiTurnRollout` itself (a scripted "model" and an environment that repeats the recorded
observations), so the prompt, the chat-template pieces and which tokens are trained are exactly those of RL.

```python
from trl_exreplay.alfworld import alfworld_tasks
from trl_exreplay.alfworld.warmstart import alfworld_tokenizer, expert_episodes, sft_dataset

tokenizer = alfworld_tokenizer()
episodes = expert_episodes(alfworld_tasks("data/alfworld/json_2.1.1/train"), workers=4)
dataset = sft_dataset(episodes, tokenizer, max_completion_length=1024, max_turns=30)  # input_ids, assistant_masks
```
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .engine import map_in_pool
from .expert import ExpertEpisode, play_expert

PUNCTUATION = ",.:;!?()\"'>"
ENTITY_MAX_NUMBER = 50  # ALFWorld numbers instances of a type from 1; a kitchen has at most a few dozen cabinets
_WORD = re.compile(r"[a-z]+(?:/[a-z]+)?|\d+")


def alfworld_vocabulary() -> list[str]:
    """Every word ALFWorld's texts can contain (the grammar, goal templates, ALFRED object and receptacle names, our
    instructions), numbers 0-99 and `PUNCTUATION`, lower case, sorted: the same list on every machine."""
    import os

    import alfworld
    import alfworld.gen.constants as C
    import alfworld.gen.goal_library as glib

    from .textenv import INSTRUCTIONS, NOTHING_HAPPENS, REACT_INSTRUCTIONS

    with open(os.path.join(os.path.dirname(alfworld.__file__), "data", "alfred.twl2")) as f:
        grammar = re.sub(r"\\[nt]", " ", f.read())  # JSON escapes: "\nAvailable" is the word "available"
    texts = [grammar, INSTRUCTIONS, REACT_INSTRUCTIONS, NOTHING_HAPPENS]
    texts += [" ".join(entry["templates"]) for entry in glib.gdict.values() if "templates" in entry]
    texts += [name for name in (*C.OBJECTS, *C.RECEPTACLES)]
    texts.append("Admissible actions Your task is to You have taken step steps last before this one Now after")
    words = set()
    for text in texts:
        words.update(_WORD.findall(text.lower()))
    words.update(str(n) for n in range(100))
    words.update(PUNCTUATION)
    return sorted(words)


def alfworld_entities(max_number: int = ENTITY_MAX_NUMBER) -> list[str]:
    """Every name ALFWorld gives an object or a receptacle ("book 2", "drawer 11"), numbers 1 to `max_number`,
    lower case: ALFRED's object and receptacle types, each with every number, in a fixed order."""
    import alfworld.gen.constants as C

    types = sorted({name.lower() for name in (*C.OBJECTS, *C.RECEPTACLES)})
    return [f"{kind} {number}" for kind in types for number in range(1, max_number + 1)]


def alfworld_tokenizer(entity_tokens: bool = False):
    """A word-level tokenizer over `alfworld_vocabulary()` (lower case, punctuation split off), with a chat
    template. With `entity_tokens`, each of `alfworld_entities()` is one token: "take book 2 from shelf 1" is 4
    tokens, not 6, and a model copies an object's name from what it sees with one token instead of two (a tiny
    model learns that more easily: see `benchmarks/alfworld_warmstart_probe.py`); a larger number stays two tokens."""
    from ..demo.tiny import build_tiny_tokenizer

    phrases = alfworld_entities() if entity_tokens else ()
    return build_tiny_tokenizer(alfworld_vocabulary(), lowercase=True, isolate=PUNCTUATION, phrases=phrases)


def _play(task: dict[str, Any], env_kwargs: dict[str, Any]) -> ExpertEpisode:
    from .textenv import AlfWorldEnv

    env = AlfWorldEnv(**env_kwargs)
    try:
        return play_expert(env, task, env.max_steps)
    finally:
        env.close()


def expert_episodes(tasks, *, workers: int | None = None, progress: bool = False, **env_kwargs) -> list[ExpertEpisode]:
    """One `SearchExpert` episode per task row (in order), `workers` processes in parallel. `env_kwargs` go to
    `AlfWorldEnv` and must match the environment used in training (e.g. `show_admissible`)."""
    rows = [dict(row) for row in tasks]
    play = functools.partial(_play, env_kwargs=env_kwargs)
    return list(map_in_pool(play, rows, workers, progress=progress, desc="expert episodes"))


class _Replay:
    """Repeats a recorded episode as an environment."""

    def __init__(self, episode: ExpertEpisode):
        self.episode, self.turn = episode, 0

    def reset(self, task):
        self.turn = 0
        return self.episode.opening

    def step(self, action):
        turn, self.turn = self.turn, self.turn + 1
        last = turn == len(self.episode.actions) - 1
        reward = 1.0 if last and self.episode.won else 0.0
        return self.episode.observations[turn], reward, last, {}

    def close(self):
        pass


def sft_dataset(
    episodes: Sequence[ExpertEpisode],
    tokenizer,
    *,
    max_completion_length: int,
    max_turns: int,
    max_tokens_per_turn: int | None = None,
    system_prompt_column: str = "system_prompt",
    chat_template_kwargs: dict | None = None,
):
    """A `datasets.Dataset` of the won episodes that fit the rollout limits: `input_ids` (prompt + completion, as
    `MultiTurnRollout` lays them out) and `assistant_masks` (1 on the tokens the model generates, as `env_mask`), for
    TRL's `SFTTrainer`. Episodes that lose, or need more turns or tokens than the limits allow, are left out."""
    from datasets import Dataset

    from ..envs.rollout import MultiTurnRollout

    rows: dict[str, list] = {"input_ids": [], "assistant_masks": [], "task_id": []}
    replay = _Replay(None)
    rollout = MultiTurnRollout(
        lambda: replay,  # the one replay environment, pointed at each episode in turn
        tokenizer,
        max_turns=max_turns,
        max_completion_length=max_completion_length,
        max_tokens_per_turn=max_tokens_per_turn,
        step_timeout=None,
        workers=1,
        system_prompt_column=system_prompt_column,
        chat_template_kwargs=chat_template_kwargs,
    )
    close = rollout.turns.close_ids[:1]  # what the model generates to end its turn (eos / <|im_end|>)
    for episode in episodes:
        if not episode.won or len(episode.actions) > max_turns:
            continue
        replay.episode = episode
        actions = iter(episode.actions)
        fits = [True]

        def generate(contexts, max_new_tokens, actions=actions, close=close, fits=fits):
            ids = tokenizer(next(actions), add_special_tokens=False)["input_ids"] + close
            fits[0] = fits[0] and len(ids) <= max_new_tokens
            return [ids[:max_new_tokens]]

        (played,) = rollout.run([episode.task], generate)
        if not fits[0] or played.truncated or played.error is not None or played.reward != 1.0:
            continue
        rows["input_ids"].append(played.prompt_ids + played.completion_ids)
        rows["assistant_masks"].append([0] * len(played.prompt_ids) + played.env_mask)
        rows["task_id"].append(str(episode.task.get("task_id", "")))
    return Dataset.from_dict(rows)


# ------------------------------------------------------------------------------------------- the recipe's warm start
def expert_sft_dataset(script_args, training_args, tokenizer, train_tasks, env_kwargs: dict):
    """The warm start's data: the searching expert plays every train game; its won episodes, laid out as rollouts."""
    episodes = expert_episodes(train_tasks, workers=None, progress=True, **env_kwargs)
    dataset = sft_dataset(
        episodes[: script_args.warm_start_max_episodes],
        tokenizer,
        max_completion_length=training_args.max_completion_length,
        max_turns=script_args.max_turns,
        max_tokens_per_turn=script_args.max_tokens_per_turn,
        chat_template_kwargs=training_args.chat_template_kwargs,
    )
    print(f"warm start: {len(dataset)} expert episodes won of {len(episodes)} games")
    return dataset


def build_tiny(script_args, tokenizer, training_args, path: str, state) -> str:
    """The embedded default model, saved to `path` so every rank and every later step loads the same weights."""
    from ..demo.tiny import build_tiny_model
    from ..recipes.models import save_atomically

    if state.is_main_process and not os.path.isfile(os.path.join(path, "config.json")):
        model = build_tiny_model(
            tokenizer,
            hidden_size=script_args.tiny_hidden_size,
            num_layers=script_args.tiny_num_layers,
            num_heads=script_args.tiny_num_heads,
            seed=training_args.seed,
            max_position_embeddings=max(512, training_args.max_completion_length + 256),
        )
        save_atomically(path, model, tokenizer)
    state.wait_for_everyone()
    return path


def warm_start(script_args, training_args, model_args, tokenizer, train_tasks, env_kwargs, state) -> str:
    """SFT with TRL's `SFTTrainer` on the searching expert's won episodes of the train games, laid out token for token
    as the RL rollouts; returns the folder of the warm-started model (cached by its settings). Collective: every rank
    calls it. The SFT runs in processes of its own (`trl_exreplay.recipes.launch.run_as_own_launch`), on the launch's
    ranks and with its DeepSpeed settings, so that the RL trainer's `Accelerator` is this process's first."""
    from accelerate.utils import broadcast_object_list

    from ..recipes.launch import run_as_own_launch
    from ..recipes.models import merge_adapter

    key = {
        "model": asdict(model_args),  # base, revision, dtype, LoRA settings
        "tiny": [script_args.tiny_hidden_size, script_args.tiny_num_layers, script_args.tiny_num_heads],
        "tokenizer": [sorted(tokenizer.get_vocab().items()), tokenizer.chat_template],
        "games": sorted(train_tasks["game_file"]),
        "system_prompt": train_tasks[0]["system_prompt"] if len(train_tasks) else None,
        "env": {k: v for k, v in env_kwargs.items() if k != "invalid_action_penalty"},  # rewards only: not SFT's
        "limits": [script_args.max_turns, training_args.max_completion_length, script_args.max_tokens_per_turn],
        "sft": [
            script_args.warm_start_epochs,
            script_args.warm_start_learning_rate,
            script_args.warm_start_batch_size,
            script_args.warm_start_max_episodes,
            training_args.seed,
            state.num_processes,
        ],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = os.path.abspath(os.path.join(script_args.data_dir, "warmstart", digest))
    # The main process decides for all ranks (a job finishing the same warm start meanwhile must not split them),
    # and names this run's own temporary folders.
    decision = [os.path.isfile(os.path.join(path, "config.json")), f"{path}.tmp-{os.getpid()}"]
    cached, tmp = broadcast_object_list(decision) if state.num_processes > 1 else decision
    if cached:
        if state.is_main_process:
            print(f"warm start: reusing {path}")
        return path

    won = [0]
    if state.is_main_process:
        dataset = expert_sft_dataset(script_args, training_args, tokenizer, train_tasks, env_kwargs)
        won = [len(dataset)]
        if won[0]:  # `datasets` cannot load back a dataset saved with no rows
            dataset.save_to_disk(tmp + ".sft-data")
    won = broadcast_object_list(won) if state.num_processes > 1 else won
    if won[0] == 0:  # every rank knows, so every rank stops here
        raise ValueError(
            f"Warm start: the expert won no train game within max_turns={script_args.max_turns} and "
            f"max_completion_length={training_args.max_completion_length}; raise them, or set warm_start false."
        )
    state.wait_for_everyone()
    spec = {
        "dataset": tmp + ".sft-data",
        "tokenizer": tmp + ".tokenizer",
        "tiny": None,  # the folder of the tiny model, for `model_args` without a model
        "model_args": asdict(model_args),
        "output_dir": tmp,
        "sft": {
            "output_dir": tmp + ".sft",
            "num_train_epochs": script_args.warm_start_epochs,
            "per_device_train_batch_size": script_args.warm_start_batch_size,
            "learning_rate": script_args.warm_start_learning_rate,
            "lr_scheduler_type": "cosine",
            "warmup_steps": 10,
            "logging_steps": 10,
            "save_strategy": "no",
            "report_to": "none",
            "max_length": None,
            "seed": training_args.seed,
            "use_cpu": training_args.use_cpu,
            "bf16": training_args.bf16,
            "gradient_checkpointing": training_args.gradient_checkpointing,
        },
    }
    if model_args.model_name_or_path is None:
        spec["tiny"] = build_tiny(script_args, tokenizer, training_args, tmp + ".init", state)
    if state.is_main_process:
        tokenizer.save_pretrained(tmp + ".tokenizer")
        with open(tmp + ".sft.json", "w") as f:
            json.dump(spec, f)
    state.wait_for_everyone()
    # SFT in processes of its own: two Trainers cannot share one process under DeepSpeed (see
    # `trl_exreplay.recipes.launch`).
    run_as_own_launch(__name__, tmp + ".sft.json")
    if state.is_main_process:
        if model_args.use_peft:  # RL trains a fresh adapter on top of the merged warm start
            merge_adapter(tmp, model_args)
        for leftover in (".sft-data", ".init", ".sft", ".tokenizer"):
            shutil.rmtree(tmp + leftover, ignore_errors=True)
        os.remove(tmp + ".sft.json")
        from ..pool.store import write_atomic  # the package's one atomic writer

        try:  # the folder the SFT processes wrote at `tmp`, fsynced and renamed: never a half-written warm start
            write_atomic(path, lambda staging: os.replace(tmp, staging))
        except OSError:  # another job finished the same warm start first: use theirs (ours was removed)
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    state.wait_for_everyone()
    return path


def sft_from_spec(spec_file: str) -> None:
    """The warm start's SFT, run by `warm_start` in processes of its own (`python -m` this module, on every rank):
    TRL's `SFTTrainer` on the saved dataset, the model saved to the spec's `output_dir` with its tokenizer."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import ModelConfig, SFTConfig, SFTTrainer, get_peft_config

    from ..recipes.models import model_init_kwargs

    with open(spec_file) as f:
        spec = json.load(f)
    model_args = ModelConfig(**spec["model_args"])
    if spec["tiny"] is not None:
        model, init_kwargs = AutoModelForCausalLM.from_pretrained(spec["tiny"]), None
    else:
        model, init_kwargs = model_args.model_name_or_path, model_init_kwargs(model_args)
    sft = SFTTrainer(
        model=model,
        args=SFTConfig(**spec["sft"], model_init_kwargs=init_kwargs),
        train_dataset=datasets.load_from_disk(spec["dataset"]).remove_columns("task_id"),
        processing_class=AutoTokenizer.from_pretrained(spec["tokenizer"]),
        peft_config=get_peft_config(model_args),
    )
    sft.train()
    sft.save_model(spec["output_dir"])  # every rank: under ZeRO-3 saving gathers the shards; the tokenizer too


if __name__ == "__main__":
    import sys

    from ..distributed import exit_distributed

    sft_from_spec(sys.argv[1])
    exit_distributed()
