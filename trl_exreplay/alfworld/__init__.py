"""ALFWorld on the real text engine: an offline game generator and walkthrough player.

Needs `alfworld==0.4.2` and `textworld[pddl]==1.7.0` (imported lazily: importing this package does not need them).

```python
from trl_exreplay.alfworld import generate_games, play_walkthroughs

report = generate_games("data/alfworld", split="train", num_games=100, seed=0)
print(report.summary())
results = play_walkthroughs("data/alfworld")
print(sum(r.won for r in results), "won of", len(results))
```

CLI: `python -m trl_exreplay.alfworld generate --out DIR --split train --num-games N --seed S` and
`python -m trl_exreplay.alfworld play-walkthroughs DIR`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from .splits import ALL_TASK_TYPES, SPLIT_SCENES, SPLITS, TASK_TYPES, TRAIN_SCENES, VALID_UNSEEN_SCENES

_LAZY = {
    "GenerationReport": "generate",
    "generate_games": "generate",
    "build_game": "generate",
    "alfworld_version": "generate",
    "PlayResult": "engine",
    "make_env": "engine",
    "play_walkthrough": "engine",
    "play_walkthroughs": "engine",
    "find_game_files": "engine",
    "AlfWorldEnv": "textenv",
    "alfworld_tasks": "textenv",
    "parse_action": "textenv",
    "AlfWorldPrompt": "textenv",
    "goal_of": "textenv",
    "INSTRUCTIONS": "textenv",
    "REACT_INSTRUCTIONS": "textenv",
    "pair_weights": "generate",
    "install_game_cache": "engine",
    "SearchExpert": "expert",
    "ExpertEpisode": "expert",
    "play_expert": "expert",
    "alfworld_vocabulary": "warmstart",
    "alfworld_tokenizer": "warmstart",
    "expert_episodes": "warmstart",
    "sft_dataset": "warmstart",
    "score_agent": "agents",
    "random_agent": "agents",
    "AgentScore": "agents",
}

__all__ = [*_LAZY, "ALL_TASK_TYPES", "SPLIT_SCENES", "SPLITS", "TASK_TYPES", "TRAIN_SCENES", "VALID_UNSEEN_SCENES"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class InstalledPackageFinder(importlib.abc.MetaPathFinder):
    """Resolves `import alfworld` to the installed *package*, never to a plain module of that name.

    Python puts a script's folder first on `sys.path`, so a script named `alfworld.py` (our recipe,
    `recipes/alfworld.py`) would otherwise be imported in place of the `alfworld` package, in the script's process and
    in every worker process it starts (spawn and forkserver workers inherit its `sys.path`). This finder, placed first
    on `sys.meta_path` when this package is imported, takes the first `alfworld` package on `sys.path` and leaves
    `sys.path` itself alone; with no package installed it finds nothing and the usual `ImportError` follows.
    """

    name = "alfworld"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for entry in sys.path:
            spec = importlib.machinery.PathFinder.find_spec(fullname, [entry])
            if spec is not None and spec.submodule_search_locations is not None:  # a package
                return spec
        return None


def _prefer_installed_package() -> None:
    if not any(isinstance(finder, InstalledPackageFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, InstalledPackageFinder())
    shadow = sys.modules.get(InstalledPackageFinder.name)
    if shadow is not None and not hasattr(shadow, "__path__"):  # a plain module imported before us: not the package
        del sys.modules[InstalledPackageFinder.name]


_prefer_installed_package()
