"""`ExperiencePool`: past successful trajectories per task, difficulty buckets and the skip set.

Semantics follow the ExGRPO / AgentEvolver design (seed 000, section 3.1; seed 001, section 2.11):

* a task's difficulty is its number of successes among its fresh rollouts of one step; a task lives in exactly one
  bucket, the one of its latest difficulty;
* a task solved by every fresh rollout enters the skip set and leaves the buckets and the store; a task of the skip
  set that stops being fully solved leaves it;
* a task's successful trajectories are stored only when ``lbound < successes < rbound``;
* each task stores at most ``max_trajectories_per_task``; at capacity, ``argmin`` keeps the lowest-entropy
  trajectories, ``argmax`` the highest, ``random`` evicts the oldest (FIFO).

Storage is an Arrow table written with `datasets` (no pickle); `save` writes to a temporary folder and renames it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

FORMAT_VERSION = 1
STATE_FILE = "state.json"
TRAJECTORIES_DIR = "trajectories"


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


class ExperiencePool:
    """Replay pool of successful trajectories per task.

    Args:
        max_trajectories_per_task: capacity per task.
        experience_lbound, experience_rbound: a task's trajectories are stored when lbound < successes < rbound.
        exp_select_mode: ``"argmin"``, ``"argmax"`` or ``"random"``: replay selection and eviction policy.
        pool_store_mode: ``"all"`` stores every success of a qualifying task, ``"best"`` only the best by entropy.
        seed: seed of the random choices the pool makes itself (``random`` store/eviction ties).

    Example:

    ```python
    from trl_exreplay import ExperiencePool
    from trl_exreplay.pool import TaskOutcome, Trajectory

    pool = ExperiencePool(experience_rbound=4)
    traj = Trajectory("t1", [1, 2], [3, 4], [1, 1], [-0.5, -0.7], [1.0], 1.0, entropy=0.9, policy_version=3)
    pool.record_outcome(TaskOutcome("t1", successes=2, num_fresh=4, successful=[traj]))
    assert pool.bucket_of("t1") == 2 and pool.num_trajectories == 1
    pool.save("pool_dir")
    assert ExperiencePool.load("pool_dir").content_hash() == pool.content_hash()
    ```
    """

    def __init__(
        self,
        max_trajectories_per_task: int = 5,
        experience_lbound: int = 0,
        experience_rbound: int = 8,
        exp_select_mode: str = "argmin",
        pool_store_mode: str = "all",
        max_policy_age: int | None = None,
        seed: int = 0,
    ):
        self.max_trajectories_per_task = max_trajectories_per_task
        self.experience_lbound = experience_lbound
        self.experience_rbound = experience_rbound
        self.exp_select_mode = exp_select_mode
        self.pool_store_mode = pool_store_mode
        self.max_policy_age = max_policy_age
        self.seed = seed
        self._difficulty: dict[str, int] = {}  # task -> latest difficulty (its bucket), insertion ordered
        self._skip: dict[str, None] = {}  # ordered set
        self._store: dict[str, list[Trajectory]] = {}
        self._task_rows: dict[str, str] = {}
        self._next_traj_id = 0
        self._num_outcomes = 0
        self.rejected_rows = 0  # rows refused at load or insertion (counted, logged by the caller)

    # ----------------------------------------------------------------------------------------------- updates
    def record_outcome(self, outcome: TaskOutcome) -> None:
        """Update buckets, skip set and store with one task's outcome of one step."""
        task_id = outcome.task_id
        self._num_outcomes += 1
        if outcome.task_row is not None:
            self._task_rows[task_id] = outcome.task_row
        if outcome.num_fresh > 0 and outcome.successes == outcome.num_fresh:
            self._skip[task_id] = None
            self._difficulty.pop(task_id, None)
            self._store.pop(task_id, None)
            return
        self._skip.pop(task_id, None)
        self._difficulty.pop(task_id, None)  # re-insert: bucket order follows the latest update
        self._difficulty[task_id] = outcome.successes
        if not (self.experience_lbound < outcome.successes < self.experience_rbound):
            return
        successful = list(outcome.successful)
        if self.pool_store_mode == "best" and successful:
            successful = [self._best(successful)]
        for trajectory in successful:
            self.add(trajectory)

    def add(self, trajectory: Trajectory) -> bool:
        """Store one trajectory under its task, evicting at capacity; returns whether it was kept."""
        trajectory.traj_id = self._next_traj_id
        self._next_traj_id += 1
        stored = self._store.setdefault(trajectory.task_id, [])
        if len(stored) < self.max_trajectories_per_task:
            stored.append(trajectory)
            return True
        if self.max_policy_age is not None:
            # Trajectories too old to replay would otherwise hold their slots forever: they go first.
            stale = [
                i for i, t in enumerate(stored) if trajectory.policy_version - t.policy_version > self.max_policy_age
            ]
            if stale:
                oldest = min(stale, key=lambda i: (stored[i].policy_version, stored[i].traj_id))
                stored.pop(oldest)
                stored.append(trajectory)
                return True
        if self.exp_select_mode == "argmin":
            worst = max(range(len(stored)), key=lambda i: (stored[i].entropy, stored[i].traj_id))
            if trajectory.entropy < stored[worst].entropy:
                stored[worst] = trajectory
                return True
            return False
        if self.exp_select_mode == "argmax":
            worst = min(range(len(stored)), key=lambda i: (stored[i].entropy, -stored[i].traj_id))
            if trajectory.entropy > stored[worst].entropy:
                stored[worst] = trajectory
                return True
            return False
        stored.pop(0)  # FIFO
        stored.append(trajectory)
        return True

    def configure(self, **settings) -> list[str]:
        """Apply settings (the constructor's keyword arguments); returns the names whose value changed."""
        changed = []
        for name, value in settings.items():
            if name not in _SETTINGS:
                raise ValueError(f"Unknown ExperiencePool setting {name!r}: allowed {', '.join(_SETTINGS)}.")
            if getattr(self, name) != value:
                changed.append(name)
                setattr(self, name, value)
        return changed

    def _best(self, trajectories: Sequence[Trajectory]) -> Trajectory:
        if self.exp_select_mode == "argmin":
            return min(trajectories, key=lambda t: t.entropy)
        if self.exp_select_mode == "argmax":
            return max(trajectories, key=lambda t: t.entropy)
        rng = np.random.default_rng([self.seed, self._num_outcomes])
        return trajectories[int(rng.integers(len(trajectories)))]

    # ---------------------------------------------------------------------------------------------- queries
    def bucket_of(self, task_id: str) -> int | None:
        return self._difficulty.get(task_id)

    def buckets(self) -> dict[int, list[str]]:
        """Difficulty -> tasks (each task in exactly one bucket)."""
        out: dict[int, list[str]] = {}
        for task_id, difficulty in self._difficulty.items():
            out.setdefault(difficulty, []).append(task_id)
        return dict(sorted(out.items()))

    @property
    def skip_set(self) -> list[str]:
        return list(self._skip)

    @property
    def num_tasks(self) -> int:
        """Tasks with at least one stored trajectory."""
        return sum(1 for trajectories in self._store.values() if trajectories)

    @property
    def num_trajectories(self) -> int:
        return sum(len(trajectories) for trajectories in self._store.values())

    def trajectories(self, task_id: str) -> list[Trajectory]:
        return list(self._store.get(task_id, []))

    def task_row(self, task_id: str) -> dict | None:
        row = self._task_rows.get(task_id)
        return None if row is None else json.loads(row)

    def candidates(self, task_id: str, current_step: int | None = None, max_policy_age: int | None = None):
        """Stored trajectories of a task young enough to replay."""
        stored = self._store.get(task_id, [])
        if max_policy_age is None or current_step is None:
            return list(stored)
        return [t for t in stored if current_step - t.policy_version <= max_policy_age]

    def replayable_tasks(
        self, min_trajectories: int = 1, current_step: int | None = None, max_policy_age: int | None = None
    ) -> list[tuple[str, int]]:
        """(task, difficulty) of bucketed tasks outside the skip set with enough replayable trajectories."""
        return [
            (task_id, difficulty)
            for task_id, difficulty in self._difficulty.items()
            if task_id not in self._skip
            and task_id in self._task_rows
            and len(self.candidates(task_id, current_step, max_policy_age)) >= min_trajectories
        ]

    def select(
        self,
        candidates: Sequence[Trajectory],
        num: int,
        entropies: Sequence[float] | None = None,
        rng: np.random.Generator | None = None,
    ) -> list[Trajectory]:
        """Pick `num` of `candidates` by entropy (the saved one, or `entropies` under the current policy)."""
        if num > len(candidates):
            raise ValueError(f"Cannot select {num} trajectories out of {len(candidates)} candidates.")
        keys = [t.entropy for t in candidates] if entropies is None else list(entropies)
        order = list(range(len(candidates)))
        if self.exp_select_mode == "argmin":
            order.sort(key=lambda i: (keys[i], candidates[i].traj_id))
        elif self.exp_select_mode == "argmax":
            order.sort(key=lambda i: (-keys[i], candidates[i].traj_id))
        else:
            rng = rng if rng is not None else np.random.default_rng(self.seed)
            order = [int(i) for i in rng.permutation(len(candidates))]
        return [candidates[i] for i in order[:num]]

    def stats(self) -> dict[str, float]:
        out = {
            "pool_tasks": float(self.num_tasks),
            "pool_trajectories": float(self.num_trajectories),
            "skip_set": float(len(self._skip)),
        }
        for difficulty, tasks in self.buckets().items():
            out[f"bucket_{difficulty}"] = float(len(tasks))
        return out

    # ------------------------------------------------------------------------------------------ persistence
    def _state(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "settings": {
                "max_trajectories_per_task": self.max_trajectories_per_task,
                "experience_lbound": self.experience_lbound,
                "experience_rbound": self.experience_rbound,
                "exp_select_mode": self.exp_select_mode,
                "pool_store_mode": self.pool_store_mode,
                "max_policy_age": self.max_policy_age,
                "seed": self.seed,
            },
            "difficulty": list(self._difficulty.items()),
            "skip_set": list(self._skip),
            "task_rows": self._task_rows,
            "next_traj_id": self._next_traj_id,
            "num_outcomes": self._num_outcomes,
            "store_order": [[task_id, [t.traj_id for t in ts]] for task_id, ts in self._store.items()],
            "num_trajectories": self.num_trajectories,
        }

    def _rows(self) -> list[dict]:
        return [asdict(t) for ts in self._store.values() for t in ts]

    def content_hash(self) -> str:
        """SHA-256 of the pool's whole content (state and trajectories): equal pools, equal hashes."""
        digest = hashlib.sha256()
        digest.update(json.dumps(self._state(), sort_keys=True).encode())
        for row in self._rows():
            digest.update(json.dumps(row, sort_keys=True).encode())
        return digest.hexdigest()

    def save(self, path: str) -> None:
        """Write the pool to folder `path` atomically: a crash leaves either the old pool or the new one."""
        import datasets

        path = os.path.abspath(path)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            rows = self._rows()
            if rows:
                table = datasets.Dataset.from_list(rows, features=_features())
                table.save_to_disk(os.path.join(tmp, TRAJECTORIES_DIR))
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(self._state(), f)
                f.flush()
                os.fsync(f.fileno())
            old = None
            if os.path.exists(path):
                old = os.path.join(parent, f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
                os.rename(path, old)
            os.rename(tmp, path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, path: str) -> ExperiencePool:
        """Load a pool written by `save` (falls back to the previous copy if a save was interrupted mid-rename)."""
        import datasets

        path = os.path.abspath(path)
        if not os.path.exists(os.path.join(path, STATE_FILE)):
            parent, name = os.path.dirname(path), os.path.basename(path)
            olds = [d for d in os.listdir(parent) if d.startswith(f".{name}.old-")] if os.path.isdir(parent) else []
            if not olds:
                raise FileNotFoundError(f"No experience pool at {path} (missing {STATE_FILE}).")
            path = os.path.join(parent, max(olds, key=lambda d: os.path.getmtime(os.path.join(parent, d))))
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        if state.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"Experience pool at {path} has format_version {state.get('format_version')!r}; this version of "
                f"trl_exreplay reads format_version {FORMAT_VERSION}."
            )
        pool = cls(**state["settings"])
        pool._difficulty = {task_id: int(d) for task_id, d in state["difficulty"]}
        pool._skip = dict.fromkeys(state["skip_set"])
        pool._task_rows = dict(state["task_rows"])
        pool._next_traj_id = int(state["next_traj_id"])
        pool._num_outcomes = int(state["num_outcomes"])
        by_id = {}
        # `datasets` cannot reload a table saved with zero rows, so an empty store is not read back at all.
        rows = datasets.load_from_disk(os.path.join(path, TRAJECTORIES_DIR)) if state["num_trajectories"] else []
        for row in rows:
            try:
                trajectory = Trajectory(**row)
            except (TypeError, ValueError):
                pool.rejected_rows += 1
                continue
            by_id[trajectory.traj_id] = trajectory
        for task_id, traj_ids in state["store_order"]:
            pool._store[task_id] = [by_id[i] for i in traj_ids if i in by_id]
        return pool


_SETTINGS = (
    "max_trajectories_per_task",
    "experience_lbound",
    "experience_rbound",
    "exp_select_mode",
    "pool_store_mode",
    "max_policy_age",
    "seed",
)


def _features():
    import datasets

    return datasets.Features(
        {
            "task_id": datasets.Value("string"),
            "prompt_ids": datasets.Sequence(datasets.Value("int32")),
            "completion_ids": datasets.Sequence(datasets.Value("int32")),
            "completion_mask": datasets.Sequence(datasets.Value("int8")),
            "logps": datasets.Sequence(datasets.Value("float32")),
            "rewards": datasets.Sequence(datasets.Value("float32")),
            "reward": datasets.Value("float32"),
            "entropy": datasets.Value("float32"),
            "policy_version": datasets.Value("int64"),
            "traj_id": datasets.Value("int64"),
        }
    )


def task_key(row: dict, task_id_column: str) -> str:
    """A task's id: its `task_id_column` value, else a stable hash of its prompt."""
    if task_id_column in row and row[task_id_column] is not None:
        return str(row[task_id_column])
    prompt = row.get("prompt")
    blob = json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)
    return "prompt-" + hashlib.sha1(blob.encode()).hexdigest()[:16]
