"""trl-exreplay: experience replay (ExGRPO / AgentEvolver) for TRL's GRPOTrainer.

The public names are imported on first use, so `import trl_exreplay.envs...` (environment worker processes, the
ALFWorld CLI) does not pay for importing trl, transformers and torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0.dev0"

_LAZY = {
    "ExReplayGRPOConfig": "config",
    "ExReplayGRPOTrainer": "trainer",
    "ExperiencePool": "pool",
    "GuidanceSettings": "guidance",
    "MultiTurnSettings": "envs.settings",
    "TaskOutcome": "pool",
    "Trajectory": "pool",
    "off_policy_loss": "loss",
}

__all__ = [
    "ExReplayGRPOConfig",
    "ExReplayGRPOTrainer",
    "ExperiencePool",
    "GuidanceSettings",
    "MultiTurnSettings",
    "TaskOutcome",
    "Trajectory",
    "off_policy_loss",
]

if TYPE_CHECKING:  # for type checkers and IDEs
    from .config import ExReplayGRPOConfig
    from .envs.settings import MultiTurnSettings
    from .guidance import GuidanceSettings
    from .loss import off_policy_loss
    from .pool import ExperiencePool, TaskOutcome, Trajectory
    from .trainer import ExReplayGRPOTrainer


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
