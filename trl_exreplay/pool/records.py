"""The records an `ExperiencePool` holds, and the keys that tie them to data.

* `Trajectory`: one stored rollout of a task, as token ids (replayed exactly as it was generated), with its
  behaviour log-probs, rewards, entropy and the policy version that generated it.
* `TaskOutcome`: what one generation step says about a task (its successes among its fresh rollouts, and the
  successful ones as trajectories); the pool's rules (`rules.py`) turn it into buckets, skip set and store.
* `task_key`: a dataset row's task id. `tokenizer_fingerprint`: what says a pool's token ids mean the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

__all__ = ["TaskOutcome", "Trajectory", "task_key", "tokenizer_fingerprint"]


@dataclass
class Trajectory:
    """One stored rollout of a task (token ids, not text, so it is replayed exactly as it was generated)."""

    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]  # 1 on model tokens (trained), 0 on environment / template tokens
    logps: list[float]  # behaviour-policy log-prob of each completion token (0 where completion_mask is 0)
    rewards: list[float]  # one per reward function, as recorded
    reward: float  # total (weighted) reward
    entropy: float  # mean entropy over model tokens under the generating policy
    policy_version: int  # optimizer step of the generating policy
    traj_id: int = -1  # assigned by the pool

    def __post_init__(self):
        # Normalise to the stored dtypes so a saved and reloaded pool is bit-identical to the live one.
        for name in ("rewards", "reward", "entropy", "policy_version", "traj_id", "logps"):
            if getattr(self, name) is None:
                raise ValueError(f"Trajectory of task {self.task_id!r}: `{name}` is missing.")
        if not isinstance(self.rewards, (list, tuple, np.ndarray)):
            raise ValueError(f"Trajectory of task {self.task_id!r}: `rewards` must be a list, got {self.rewards!r}.")
        self.traj_id = int(self.traj_id)
        self.prompt_ids = [int(x) for x in self.prompt_ids]
        self.completion_ids = [int(x) for x in self.completion_ids]
        self.completion_mask = [int(x) for x in self.completion_mask]
        self.logps = np.asarray(self.logps, dtype=np.float32).tolist()
        self.rewards = np.asarray(self.rewards, dtype=np.float32).tolist()
        self.reward = float(np.float32(self.reward))
        self.entropy = float(np.float32(self.entropy))
        self.policy_version = int(self.policy_version)
        n = len(self.completion_ids)
        if len(self.completion_mask) != n or len(self.logps) != n:
            raise ValueError(
                f"Trajectory of task {self.task_id!r}: completion_ids ({n}), completion_mask "
                f"({len(self.completion_mask)}) and logps ({len(self.logps)}) must have the same length."
            )


@dataclass
class TaskOutcome:
    """What one generation step says about a task: its fresh rollouts, and the successful ones as trajectories."""

    task_id: str
    successes: int
    num_fresh: int
    successful: list[Trajectory] = field(default_factory=list)
    task_row: str | None = None  # JSON of the dataset row, so a replayed task can be rolled out again


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of what maps text to token ids: the tokenizer's vocabulary, merges, added tokens and normalisation.

    Padding / truncation settings, special-token roles and the chat template do not change what an id means and are
    left out. A processor is fingerprinted by its tokenizer.
    """
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:
        spec = {"class": type(tokenizer).__name__, "vocab": sorted(tokenizer.get_vocab().items())}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def task_key(row: dict, task_id_column: str) -> str:
    """A task's id: its `task_id_column` value, else a stable hash of its prompt."""
    if task_id_column in row and row[task_id_column] is not None:
        return str(row[task_id_column])
    prompt = row.get("prompt")
    blob = json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)
    return "prompt-" + hashlib.sha1(blob.encode()).hexdigest()[:16]
