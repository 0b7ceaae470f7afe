"""Text environments for multi-turn rollouts: the `TextEnv` protocol, small reference environments and
`EnvProcessPool`, which runs environments in worker processes."""

from .base import TextEnv, env_reward
from .process import EnvProcessPool, RemoteEnv, RemoteEnvError
from .toy import KeyDoorEnv

__all__ = ["EnvProcessPool", "KeyDoorEnv", "RemoteEnv", "RemoteEnvError", "TextEnv", "env_reward"]
