"""Text environments for multi-turn rollouts: the `TextEnv` protocol, small reference environments and
`EnvProcessPool` and `RayEnvPool`, which run environments in worker processes or in Ray actors."""

from .base import TextEnv, env_reward
from .process import EnvProcessPool, RemoteEnv, RemoteEnvError
from .ray_pool import RayEnvPool
from .toy import KeyDoorEnv

__all__ = ["EnvProcessPool", "KeyDoorEnv", "RayEnvPool", "RemoteEnv", "RemoteEnvError", "TextEnv", "env_reward"]
