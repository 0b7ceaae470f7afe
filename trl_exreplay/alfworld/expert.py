"""A searching expert for ALFWorld: what a policy can learn to do from what it sees.

A game's stored walkthrough goes straight to where the object is, which the agent cannot know from the text it
reads. `SearchExpert` acts only on the observations and admissible commands (plus the task's parameters, which the
goal text states): it visits the receptacles the opening lists, open surfaces first (one step shows all they hold)
and then the ones that open (two steps each), each group in the order listed; it opens closed ones, remembers what
it saw where, takes a target object when one is in view, goes to the appliance or lamp the task needs, and puts the
object in the first receptacle of the destination type. Its episodes are warm-start data a policy can imitate.

```python
from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks
from trl_exreplay.alfworld.expert import play_expert

task = alfworld_tasks("data/alfworld/json_2.1.1/train")[0]
episode = play_expert(AlfWorldEnv(max_steps=50, show_admissible=False), task)
print(episode.won, episode.actions)
```
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine import _IMPORT_HINT
from .splits import APPLIANCE_TASKS

try:
    import alfworld.gen.constants as C
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(_IMPORT_HINT) from e

_SEEN = re.compile(r"\ban? ([a-z]+ \d+)")
# Receptacle kinds that are closed until opened, as the game names them ("cabinet" for ALFRED's "Cabinet").
_OPENABLE = frozenset(name.lower() for name in C.OPENABLE_CLASS_SET)
_APPLIANCE = {task: (verb, appliance.lower()) for task, (_, appliance, verb) in APPLIANCE_TASKS.items()}


def _kind(name: str) -> str:
    """ "cabinet 3" -> "cabinet"."""
    return name.rsplit(" ", 1)[0]


def task_params(game_file: str) -> dict[str, str]:
    """The task of a game (type, object, destination, lamp) from the `traj_data.json` beside it, lower case."""
    with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
        traj = json.load(f)
    params = traj["pddl_params"]
    return {
        "task_type": traj["task_type"],
        "object": params["object_target"].lower(),
        "destination": params["parent_target"].lower(),
        "lamp": params["toggle_target"].lower(),
    }


class SearchExpert:
    """Chooses the next command from the latest observation and admissible commands (see the module docstring)."""

    def __init__(self, task_type: str, object: str, destination: str = "", lamp: str = ""):
        self.task_type, self.object, self.destination, self.lamp = task_type, object, destination, lamp

    def reset(self, opening: str) -> None:
        seen_part = opening.split("you see ", 1)[1].split("\n")[0] if "you see " in opening else ""
        listed = _SEEN.findall(seen_part)
        self.receptacles = [r for r in listed if _kind(r) not in _OPENABLE] + [
            r for r in listed if _kind(r) in _OPENABLE
        ]
        self.location: str | None = None
        self.holding: str | None = None
        self.transformed = False
        self.placed: set[str] = set()
        self.visited: set[str] = set()
        self.seen: dict[str, str] = {}  # object or lamp -> receptacle where it was last seen

    def observe(self, command: str, observation: str) -> None:
        """Update what the expert knows after `command` gave `observation` (the engine's text, not a prompt)."""
        if command.startswith("go to ") and not observation.startswith("Nothing happens"):
            self.location = command[len("go to ") :]
            self.visited.add(self.location)
        if self.location is not None:
            for thing in _SEEN.findall(observation.split("\n")[0]):
                if thing != self.location and thing not in self.receptacles:
                    self.seen[thing] = self.location
        if command.startswith("take ") and observation.startswith("You pick up"):
            self.holding = command[len("take ") :].split(" from ")[0]
            self.seen.pop(self.holding, None)
        elif command.startswith(("put ", "move ")) and self.holding and not observation.startswith("Nothing"):
            self.placed.add(self.holding)
            self.holding, self.transformed = None, False
        elif command.split(" ", 1)[0] in ("clean", "heat", "cool") and not observation.startswith("Nothing"):
            self.transformed = True

    def act(self, admissible: Sequence[str]) -> str:
        admissible = list(admissible)
        if self.holding is None:
            takes = [a for a in admissible if self._takes_target(a)]
            if takes:
                return takes[0]
            return self._search(admissible, lambda name: _kind(name) == self.object and name not in self.placed)
        if self.task_type == "look_at_obj_in_light":
            uses = [a for a in admissible if a.startswith(f"use {self.lamp} ")]
            return uses[0] if uses else self._search(admissible, lambda name: _kind(name) == self.lamp)
        if self.task_type in _APPLIANCE and not self.transformed:
            verb, appliance = _APPLIANCE[self.task_type]
            acts = [a for a in admissible if a.startswith(f"{verb} {self.holding} with {appliance} ")]
            return acts[0] if acts else self._go_to_kind(admissible, appliance)
        puts = [a for a in admissible if self._puts_held(a)]
        return puts[0] if puts else self._go_to_kind(admissible, self.destination)

    # ------------------------------------------------------------------------------------------------ helpers
    def _takes_target(self, command: str) -> bool:
        match = re.fullmatch(r"take ([a-z]+ \d+) from .+", command)
        return match is not None and _kind(match.group(1)) == self.object and match.group(1) not in self.placed

    def _puts_held(self, command: str) -> bool:
        for prefix, joiner in (("put ", " in/on "), ("move ", " to ")):
            if command.startswith(f"{prefix}{self.holding}{joiner}") and _kind(command.split(joiner)[-1]) == (
                self.destination
            ):
                return True
        return False

    def _open_here(self, admissible: list[str]) -> str | None:
        command = f"open {self.location}"
        return command if self.location is not None and command in admissible else None

    def _go_to_kind(self, admissible: list[str], kind: str) -> str:
        opened = self._open_here(admissible)
        if self.location is not None and _kind(self.location) == kind:
            return opened or "look"  # at the right place: open it, or there is nothing to do
        targets = [r for r in self.receptacles if _kind(r) == kind]
        return f"go to {targets[0]}" if targets else "look"

    def _search(self, admissible: list[str], wanted) -> str:
        """Open the receptacle here if it is closed, else go where a wanted thing was seen, else to the next
        receptacle not visited yet, else look."""
        opened = self._open_here(admissible)
        if opened:
            return opened
        for thing, where in self.seen.items():
            if wanted(thing) and where != self.location:
                return f"go to {where}"
        for receptacle in self.receptacles:
            if receptacle not in self.visited and receptacle != self.location:
                return f"go to {receptacle}"
        return "look"


@dataclass
class ExpertEpisode:
    """One expert episode: the opening, then each command with the observation it gave."""

    task: dict[str, Any]
    opening: str
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    won: bool = False


def play_expert(
    env, task: dict[str, Any], max_steps: int | None = None, *, params: dict[str, str] | None = None
) -> ExpertEpisode:
    """Play `SearchExpert` on `env` (an `AlfWorldEnv`, or a `RemoteEnv` of one) for `task` (a row of
    `alfworld_tasks`), at most `max_steps` steps: by default `env.max_steps` if `env` has that int attribute (an
    `AlfWorldEnv`), else 50 (ALFWorld's usual limit). A `RemoteEnv` keeps its attributes in its worker: pass
    `max_steps` for it. `params`: the task's `task_params`, if the caller read them already."""
    if max_steps is None:
        limit = getattr(env, "max_steps", None)
        max_steps = limit if type(limit) is int else 50
    expert = SearchExpert(**(params if params is not None else task_params(task["game_file"])))
    opening = env.reset(task)
    expert.reset(opening)
    episode = ExpertEpisode(task=dict(task), opening=opening)
    for _ in range(max_steps):
        command = expert.act(env.admissible_actions())
        observation, reward, done, info = env.step(command)
        expert.observe(info.get("command", command), info.get("feedback", observation))
        episode.actions.append(command)
        episode.observations.append(observation)
        if done:
            episode.won = reward > 0
            break
    return episode
