"""ALFWorld as a `TextEnv`: the real text engine (textworld's PDDL environment with ALFWorld's `AlfredDemangler` and
`AlfredInfos`, as `alfworld.agents.environment.AlfredTWEnv` builds it), a prompt builder and an action parser.

Works with the official data (`json_2.1.1/<split>/<task>/<trial>/game.tw-pddl`) and with generated games, which
are laid out the same way. Needs the `alfworld` extra: `pip install "trl-exreplay[alfworld]"`.

```python
from trl_exreplay.envs.alfworld import AlfWorldEnv, alfworld_tasks

tasks = alfworld_tasks("data/alfworld/json_2.1.1/train")  # official or generated
trainer = ExReplayGRPOTrainer(model=..., args=..., train_dataset=tasks, env_factory=AlfWorldEnv)
```
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .engine import make_env

WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
NOTHING_HAPPENS = "Nothing happens."

INSTRUCTIONS = (
    "You are an agent in a household. Each turn, reply with exactly one action, for example: go to cabinet 1, "
    "open fridge 1, take apple 1 from countertop 2, put apple 1 in/on sinkbasin 1, clean apple 1 with sinkbasin 1, "
    "heat mug 1 with microwave 1, cool potato 1 with fridge 1, use desklamp 1, examine book 1, inventory, look."
)

_ACTION_PREFIX = re.compile(r"^\s*(?:>\s*|action\s*:\s*|act\s*:\s*)", re.IGNORECASE)


def parse_action(text: str) -> str:
    """Model text -> one command: the first non-empty line, without an "Action:" or ">" prefix, lower case, single
    spaces, no trailing period. Text outside the grammar goes to the engine as is (which answers "Nothing happens.")."""
    for line in text.splitlines():
        line = _ACTION_PREFIX.sub("", line).strip().rstrip(".").strip()
        if line:
            return " ".join(line.lower().split())
    return ""


def strip_welcome(text: str) -> str:
    """The opening text without textworld's banner: it starts "You are in the middle of a room"."""
    text = text.strip()
    if text.startswith(WELCOME):
        text = text[len(WELCOME) :].strip()
    return text


class AlfWorldEnv:
    """One ALFWorld game at a time. Task row: `{"task_id": ..., "game_file": ".../game.tw-pddl"}`.

    Args:
        max_steps: episode length limit (ALFWorld's usual 50); the episode then ends without reward.
        show_admissible: append the admissible commands to every observation.

    The reward is 1 on a win, else 0. An action the engine cannot apply gets "Nothing happens." and
    `info["invalid_action"] = True`. Loaded games are kept: resetting the same game again skips the load.
    """

    def __init__(self, max_steps: int = 50, show_admissible: bool = True):
        self.max_steps = max_steps
        self.show_admissible = show_admissible
        self._env = None
        self._loaded = None
        self._state = None
        self.steps = 0

    def _engine(self):
        if self._env is None:
            self._env = make_env()
        return self._env

    def reset(self, task: dict[str, Any]) -> str:
        env = self._engine()
        game_file = task["game_file"]
        if self._loaded != game_file:
            env.load(game_file)
            self._loaded = game_file
        self._state = env.reset()
        self.steps = 0
        return self._observation(strip_welcome(self._state.feedback))

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        command = parse_action(action)
        state, _, done = self._engine().step(command)
        self._state = state
        self.steps += 1
        won = bool(state["won"])
        feedback = state.feedback.strip()
        done = bool(done) or won or self.steps >= self.max_steps
        info = {"invalid_action": feedback == NOTHING_HAPPENS, "won": won, "command": command}
        return self._observation(feedback), float(won), done, info

    def admissible_actions(self) -> list[str]:
        return list(self._state["admissible_commands"]) if self._state is not None else []

    def _observation(self, text: str) -> str:
        if not self.show_admissible:
            return text
        return text + "\nAdmissible actions: " + ", ".join(self.admissible_actions()) + "."

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
            self._loaded = None


def alfworld_tasks(data_dir: str, system_prompt: str | None = INSTRUCTIONS):
    """A `datasets.Dataset` of the games under `data_dir` (a json_2.1.1 split folder, official or generated):
    task_id (the trial's path relative to `data_dir`), game_file, task_type, system_prompt. Sorted, so stable."""
    from datasets import Dataset

    rows = {"task_id": [], "game_file": [], "task_type": [], "system_prompt": []}
    for root, _, files in sorted(os.walk(data_dir)):
        if "game.tw-pddl" not in files or "traj_data.json" not in files:
            continue
        with open(os.path.join(root, "traj_data.json")) as f:
            traj = json.load(f)
        rows["task_id"].append(os.path.relpath(root, data_dir))
        rows["game_file"].append(os.path.join(root, "game.tw-pddl"))
        rows["task_type"].append(traj["task_type"])
        rows["system_prompt"].append(system_prompt)
    if not rows["task_id"]:
        raise FileNotFoundError(f"No ALFWorld games (game.tw-pddl with traj_data.json) under {data_dir}.")
    return Dataset.from_dict(rows)
