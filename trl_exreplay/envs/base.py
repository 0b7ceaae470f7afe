"""`TextEnv`: what a text environment implements to be rolled out by `ExReplayGRPOTrainer(text_env_factory=...)`."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class TextEnv(Protocol):
    """A text environment, one episode at a time. Instances are reused across episodes (`reset` starts a new one).

    * `reset(task)`: `task` is the dataset row (task id column plus whatever the environment needs); returns the
      first observation, which becomes the user message of the prompt.
    * `step(action)`: `action` is the model's turn as text; returns `(observation, reward, done, info)`. The
      episode's reward is the sum of its step rewards. `info["invalid_action"] = True` marks an action the
      environment could not apply (counted in `env/invalid_actions`).
    * `close()`: release resources.
    * optional `admissible_actions()`: the actions valid now (for prompts or baselines).

    An exception in `reset` or `step`, or a step slower than `env_step_timeout`, ends the episode (reward 0), is
    counted in `env/errors` and the instance is discarded; training goes on. Such an episode trains none of its
    tokens and does not count in its task's outcome: the environment failed, not the model.

    Example:

    ```python
    class Echo:
        def reset(self, task):
            self.word = task["word"]
            return f"say {self.word}"

        def step(self, action):
            won = self.word in action.split()
            return ("well done" if won else "try again"), float(won), won, {}

        def close(self):
            pass


    env = Echo()
    assert env.reset({"word": "blue"}) == "say blue"
    assert env.step("say red") == ("try again", 0.0, False, {})
    assert env.step("blue") == ("well done", 1.0, True, {})
    ```
    """

    def reset(self, task: dict[str, Any]) -> str: ...

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...

    def close(self) -> None: ...


def env_reward(completions, env_reward=None, **kwargs) -> list[float]:
    """Reward function that returns each rollout's environment reward (the default when no reward_funcs are given)."""
    if env_reward is None:
        raise ValueError("env_reward needs the `env_reward` column that multi-turn rollouts add to each row.")
    return [float(r) for r in env_reward]


def renamed_env_factory(text_env_factory, env_factory, where: str):
    """The factory given as `text_env_factory`, or under its name before 0.1, `env_factory` (with a FutureWarning;
    it is not TRL's `environment_factory`, a different contract)."""
    import warnings

    if env_factory is not None:
        if text_env_factory is not None:
            raise TypeError(
                f"{where} got both `text_env_factory` and its old name `env_factory`; pass only the first."
            )
        warnings.warn(
            f"{where}: `env_factory` is renamed `text_env_factory` (a factory of reset/step `TextEnv` games; not "
            "TRL's `environment_factory`).",
            FutureWarning,
            stacklevel=3,
        )
        return env_factory
    if text_env_factory is None:
        raise TypeError(f"{where} needs `text_env_factory` (a callable that builds a `TextEnv`).")
    return text_env_factory
