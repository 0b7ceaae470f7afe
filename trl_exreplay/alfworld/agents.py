"""Scripted ALFWorld agents and their success on games: the floor (random) and ceilings (walkthrough, expert) that a
trained policy is measured against. A policy (a model) is evaluated by `trl_exreplay.envs.evaluation`, the one
evaluation module; this one only plays scripted agents, overall and per task type, with the alfworld version recorded.

An agent is a callable `(observation, admissible_actions, rng) -> action` (module-level, to reach worker processes
when `workers` > 1), `None` for the game's stored walkthrough (played by `play_walkthrough`, which wins only if every
command is admissible; it must score 100% on generated games), or `EXPERT` for `SearchExpert` (it finds the objects
by looking, as a policy must). `random_agent` picks uniformly among admissible commands: the floor any trained
policy must clear.

```python
from trl_exreplay.alfworld import random_agent, score_agent

result = score_agent("data/alfworld/json_2.1.1/valid_unseen", random_agent, max_steps=50, seed=0, workers=4)
print(result.summary())  # success overall and per task type, alfworld version
```
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from .engine import find_game_files, map_in_pool, play_walkthrough
from .expert import play_expert, task_params
from .generate import alfworld_version
from .textenv import AlfWorldEnv

Agent = Callable[[str, Sequence[str], random.Random], str]
EXPERT = "expert"  # pass as `agent` to play `SearchExpert`, which searches from what it sees


def random_agent(observation: str, admissible: Sequence[str], rng: random.Random) -> str:
    """Uniform over the admissible commands (never "help")."""
    choices = [a for a in admissible if a != "help"] or list(admissible)
    return rng.choice(sorted(choices))


@dataclass
class AgentScore:
    alfworld_version: str
    agent: str
    max_steps: int
    games: int = 0
    won: int = 0
    per_task_type: dict[str, list[int]] = field(default_factory=dict)  # task type -> [won, games]
    mean_steps: float = 0.0

    @property
    def success_rate(self) -> float:
        return self.won / self.games if self.games else 0.0

    def summary(self) -> str:
        lines = [
            f"{self.agent}: {self.won} won of {self.games} ({100 * self.success_rate:.1f}%), "
            f"mean steps {self.mean_steps:.1f}, max_steps {self.max_steps}, alfworld {self.alfworld_version}"
        ]
        for task_type, (won, games) in sorted(self.per_task_type.items()):
            lines.append(f"  {task_type}: {won}/{games} ({100 * won / games:.1f}%)")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "success_rate": self.success_rate}, sort_keys=True)


def _play(job: tuple) -> tuple[str, bool, int]:
    game_file, agent, max_steps, seed = job
    params = task_params(game_file)
    if agent is None:
        played = play_walkthrough(game_file, max_steps=max_steps)
        return params["task_type"], played.ok, played.steps
    env = AlfWorldEnv(max_steps=max_steps, show_admissible=False)
    try:
        if agent == EXPERT:
            episode = play_expert(env, {"game_file": game_file}, max_steps, params=params)
            return params["task_type"], episode.won, len(episode.actions)
        observation = env.reset({"game_file": game_file})
        rng = random.Random(f"{seed}|{game_file}")
        for step in range(max_steps):
            observation, reward, done, _ = env.step(agent(observation, env.admissible_actions(), rng))
            if done:
                return params["task_type"], reward > 0, step + 1
        return params["task_type"], False, max_steps
    finally:
        env.close()


def score_agent(
    games: str | os.PathLike | Sequence[str],
    agent: Agent | str | None = None,
    *,
    max_steps: int = 50,
    seed: int = 0,
    workers: int | None = 1,
    progress: bool = False,
) -> AgentScore:
    """Play `agent` (None: the stored walkthrough) once on each game (a folder searched for game.tw-pddl, or a list
    of game files); episodes run in `workers` processes (None: one per CPU). Seeded: the same call, the same result."""
    if isinstance(agent, str) and agent != EXPERT:
        raise ValueError(f"agent must be a callable, None (walkthrough) or {EXPERT!r}, got {agent!r}")
    files = find_game_files(games) if isinstance(games, (str, os.PathLike)) else sorted(games)
    name = (
        "walkthrough"
        if agent is None
        else agent
        if agent == EXPERT
        else getattr(agent, "__name__", type(agent).__name__)
    )
    result = AgentScore(alfworld_version=alfworld_version(), agent=name, max_steps=max_steps)
    jobs = [(game, agent, max_steps, seed) for game in files]
    steps = 0
    for task_type, won, used in map_in_pool(_play, jobs, workers, progress=progress, desc=f"evaluating {name}"):
        tally = result.per_task_type.setdefault(task_type, [0, 0])
        tally[0] += int(won)
        tally[1] += 1
        result.games += 1
        result.won += int(won)
        steps += used
    result.mean_steps = steps / result.games if result.games else 0.0
    return result
