"""Text environments for multi-turn rollouts: the `TextEnv` protocol and small reference environments."""

from .base import TextEnv, env_reward
from .toy import KeyDoorEnv

__all__ = ["KeyDoorEnv", "TextEnv", "env_reward"]
