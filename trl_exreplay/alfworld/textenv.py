"""ALFWorld as a `TextEnv`: the real text engine (textworld's PDDL environment with ALFWorld's `AlfredDemangler` and
`AlfredInfos`, as `alfworld.agents.environment.AlfredTWEnv` builds it), a prompt builder and an action parser.

Works with the official data (`json_2.1.1/<split>/<task>/<trial>/game.tw-pddl`) and with generated games, which
are laid out the same way. Needs the `alfworld` extra: `pip install "trl-exreplay[alfworld]"`.

```python
from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

tasks = alfworld_tasks("data/alfworld/json_2.1.1/train")  # official or generated
trainer = ExReplayGRPOTrainer(model=..., args=..., train_dataset=tasks, text_env_factory=AlfWorldEnv)
```
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .engine import _ENGINE_LOCK, acquire_env, find_game_files, install_game_cache, release_env

WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
NOTHING_HAPPENS = "Nothing happens."
TASK_PREFIX = "Your task is to: "

INSTRUCTIONS = (
    "You are an agent in a household. Each turn, reply with exactly one action, for example: go to cabinet 1, "
    "open fridge 1, take apple 1 from countertop 2, put apple 1 in/on sinkbasin 1, clean apple 1 with sinkbasin 1, "
    "heat mug 1 with microwave 1, cool potato 1 with fridge 1, use desklamp 1, examine book 1, inventory, look."
)
REACT_INSTRUCTIONS = (
    'You are an agent in a household. Each turn, first think in one line that starts with "Think:", then give '
    'exactly one action in a line that starts with "Action:", for example:\nThink: the apple may be in the '
    "fridge.\nAction: go to fridge 1\nActions look like: go to cabinet 1, open fridge 1, take apple 1 from "
    "countertop 2, put apple 1 in/on sinkbasin 1, clean apple 1 with sinkbasin 1, heat mug 1 with microwave 1, cool "
    "potato 1 with fridge 1, use desklamp 1, examine book 1, inventory, look."
)

_ACTION_LINE = re.compile(r"^\s*action\s*:\s*", re.IGNORECASE)
_ACTION_PREFIX = re.compile(r"^\s*(?:>\s*|act\s*:\s*)", re.IGNORECASE)
_THOUGHT_LINE = re.compile(r"^\s*(?:think|thought)\s*:", re.IGNORECASE)
_GOAL_RULE = re.compile(r'"rhs":\s*"Your task is to: ([^"]*)"')


def check_invalid_action_penalty(penalty: float) -> float:
    """`penalty` if it is a finite number >= 0, else a ValueError that names the field and its allowed values."""
    if not 0.0 <= penalty < float("inf"):
        raise ValueError(
            f"Invalid value {penalty} for `invalid_action_penalty`: allowed values are finite numbers >= 0."
        )
    return penalty


def parse_action(text: str) -> str:
    """Model text -> one command, lower case, single spaces, no trailing period: the first line that starts with
    "Action:" (ReAct style), else the first non-empty line that is not a "Think:" line (without a ">" prefix).
    Text outside the grammar goes to the engine as is (which answers "Nothing happens.")."""
    lines = text.splitlines()
    tagged = [_ACTION_LINE.sub("", line) for line in lines if _ACTION_LINE.match(line)]
    candidates = tagged or [_ACTION_PREFIX.sub("", line) for line in lines if not _THOUGHT_LINE.match(line)]
    for line in candidates:
        line = line.strip().rstrip(".").strip()
        if line:
            return " ".join(line.lower().split())
    return ""


def strip_welcome(text: str) -> str:
    """The opening text without textworld's banner: it starts "You are in the middle of a room"."""
    text = text.strip()
    if text.startswith(WELCOME):
        text = text[len(WELCOME) :].strip()
    return text


def goal_of(game_file: str) -> str:
    """The task a game states in its opening ("put a clean mug in coffeemachine"), read from its grammar."""
    with open(game_file) as f:
        match = _GOAL_RULE.search(json.load(f).get("grammar", ""))
    if match is None:
        raise ValueError(f"{game_file}: no 'Your task is to: ...' rule in the game's grammar.")
    return match.group(1).strip().rstrip(".")


@dataclass(frozen=True)
class AlfWorldPrompt:
    """What the agent reads each turn: the observation, the admissible actions (optional) and, with
    `history_length` > 0, the task and the last `history_length` steps.

    In multi-turn training the chat transcript already holds the whole episode, so the default `history_length=0`
    adds nothing to it; the transcript is then bounded by `max_turns` and `max_completion_length`. A positive
    `history_length` makes every message self-contained, with a bounded history, for agents that see one message
    at a time (an evaluation loop that prompts a model afresh each step).
    """

    show_admissible: bool = True
    history_length: int = 0
    restate_goal: bool = False  # start every turn's message with the task (history_length > 0 always does)

    def __post_init__(self):
        if self.history_length < 0:
            raise ValueError(f"history_length must be >= 0, got {self.history_length}.")

    def opening(self, text: str, admissible: Sequence[str]) -> str:
        return self._with_admissible(text, admissible)

    def turn(self, feedback: str, admissible: Sequence[str], goal: str, history: Sequence[tuple[str, str]]) -> str:
        """`history`: the episode's (action, feedback) pairs so far, the current step's last."""
        if not self.history_length:
            text = f"{TASK_PREFIX}{goal}.\n{feedback}" if self.restate_goal else feedback
            return self._with_admissible(text, admissible)
        shown = history[:-1][-self.history_length :]
        lines = [f"{TASK_PREFIX}{goal}.", f"You have taken {len(history)} step(s)."]
        if shown:
            lines.append(f"Your last {len(shown)} step(s) before this one:")
            lines += [f"> {action}\n{result}" for action, result in shown]
        lines.append(f"Now, after > {history[-1][0]}:\n{feedback}")
        return self._with_admissible("\n".join(lines), admissible)

    def _with_admissible(self, text: str, admissible: Sequence[str]) -> str:
        if not self.show_admissible:
            return text
        return text + "\nAdmissible actions: " + ", ".join(admissible) + "."


class AlfWorldEnv:
    """One ALFWorld game at a time. Task row: `{"task_id": ..., "game_file": ".../game.tw-pddl"}`.

    Args:
        max_steps: episode length limit (ALFWorld's usual 50); the episode then ends without reward.
        show_admissible: append the admissible commands to every observation.
        history_length: steps of history restated in every observation (see `AlfWorldPrompt`; 0 for chat).
        restate_goal: start every observation after the first with the task: a small model then sees what it looks
            for next to what it sees, instead of many turns back.
        game_cache: games whose parsed form (PDDL->SAS translation) is kept in this process, shared by its engines;
            a cached game resets several times faster (`benchmarks/alfworld_env_throughput.py`). The process keeps
            the largest size any engine asked for, so 0 only means this engine asks for none.
        invalid_action_penalty: subtracted from the step's reward when the engine refuses the action (agent-RL
            codebases such as verl-agent penalise invalid actions too). Episodes that all fail then still differ in
            reward, so their GRPO group gives a gradient; a won episode's reward is at most `max_steps *
            invalid_action_penalty` below 1.

    The reward is 1 on a win, else 0, less `invalid_action_penalty` per refused action. An action the engine cannot
    apply gets "Nothing happens." and `info["invalid_action"] = True`; `info["feedback"]` is the engine's text of the
    step (without the prompt).
    Resetting the game already loaded skips the load. The engine comes from the process's free engines and `close()`
    gives it back (engines are costly to make and never unloaded; see `engine.acquire_env`).
    """

    def __init__(
        self,
        max_steps: int = 50,
        show_admissible: bool = True,
        history_length: int = 0,
        game_cache: int = 64,
        restate_goal: bool = False,
        invalid_action_penalty: float = 0.0,
    ):
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}.")
        self.max_steps = max_steps
        self.invalid_action_penalty = check_invalid_action_penalty(invalid_action_penalty)
        self.prompt = AlfWorldPrompt(show_admissible, history_length, restate_goal)
        self.game_cache = game_cache
        self._env = None
        self._loaded = None
        self._state = None
        self.steps = 0
        self.goal = ""
        self.history: list[tuple[str, str]] = []

    def _engine(self):
        if self._env is None:
            install_game_cache(self.game_cache)
            self._env = acquire_env()
            self._loaded = None  # a reused engine holds its previous user's game: load ours on reset
        return self._env

    def reset(self, task: dict[str, Any]) -> str:
        with _ENGINE_LOCK:
            return self._reset(task)

    def _reset(self, task: dict[str, Any]) -> str:
        env = self._engine()
        game_file = task["game_file"]
        if self._loaded != game_file:
            self._loaded = None  # a failed load leaves no half-loaded game behind
            env.load(game_file)
            self._loaded = game_file
        self._state = env.reset()
        self.steps = 0
        self.history = []
        opening = strip_welcome(self._state.feedback)
        self.goal = opening.rpartition(TASK_PREFIX)[2].strip().rstrip(".")
        return self.prompt.opening(opening, self.admissible_actions())

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._state is None:
            raise RuntimeError("AlfWorldEnv.step() before reset().")
        command = parse_action(action)
        with _ENGINE_LOCK:
            if self._env is None:  # closed by another thread meanwhile: never step an engine it gave back
                raise RuntimeError("AlfWorldEnv.step() before reset().")
            state, _, done = self._env.step(command)
        self._state = state
        self.steps += 1
        won = bool(state["won"])
        feedback = state.feedback.strip()
        self.history.append((command, feedback))
        done = bool(done) or won or self.steps >= self.max_steps
        invalid = feedback == NOTHING_HAPPENS
        info = {"invalid_action": invalid, "won": won, "command": command, "feedback": feedback}
        observation = self.prompt.turn(feedback, self.admissible_actions(), self.goal, self.history)
        return observation, float(won) - self.invalid_action_penalty * invalid, done, info

    def admissible_actions(self) -> list[str]:
        return list(self._state["admissible_commands"]) if self._state is not None else []

    def close(self) -> None:
        """Give the engine back to the process (for the next `AlfWorldEnv`); a later `reset` takes one again."""
        with _ENGINE_LOCK:
            env, self._env, self._loaded, self._state = self._env, None, None, None
            if env is not None:
                release_env(env)


def alfworld_tasks(data_dir: str, system_prompt: str | None = INSTRUCTIONS):
    """A `datasets.Dataset` of the games under `data_dir` (a json_2.1.1 split folder, official or generated):
    task_id (the trial's path relative to `data_dir`), game_file, task_type, goal (as the game states it),
    system_prompt. Sorted, so stable."""
    from datasets import Dataset

    rows = {"task_id": [], "game_file": [], "task_type": [], "goal": [], "system_prompt": []}
    for game_file in find_game_files(data_dir):
        root = os.path.dirname(game_file)
        if not os.path.isfile(os.path.join(root, "traj_data.json")):
            continue
        with open(os.path.join(root, "traj_data.json")) as f:
            traj = json.load(f)
        rows["task_id"].append(os.path.relpath(root, data_dir))
        rows["game_file"].append(game_file)
        rows["goal"].append(goal_of(game_file))
        rows["task_type"].append(traj["task_type"])
        rows["system_prompt"].append(system_prompt)
    if not rows["task_id"]:
        raise FileNotFoundError(f"No ALFWorld games (game.tw-pddl with traj_data.json) under {data_dir}.")
    return Dataset.from_dict(rows)
