"""The multi-turn engine and its environments: the `TextEnv` protocol, the engine that plays a batch of games turn by
turn (`rollout`), the trainer's multi-turn part (`multiturn`), the success rate of a policy (`evaluation`), and
`EnvProcessPool` and `RayEnvPool`, which run environments in worker processes or in Ray actors. Light to import: the
engine's heavier modules are imported where used."""

from .base import TextEnv, env_reward
from .process import EnvProcessPool, RemoteEnv, RemoteEnvError
from .ray_pool import RayEnvPool

__all__ = ["EnvProcessPool", "RayEnvPool", "RemoteEnv", "RemoteEnvError", "TextEnv", "env_reward"]
