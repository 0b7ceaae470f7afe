"""The experience pool: past successful trajectories per task, replayed by `ExReplayGRPOTrainer`.

One job a module, in the order a trajectory meets them:

* `records.py`: what the pool holds: `Trajectory`, `TaskOutcome`, and the keys `task_key` and
  `tokenizer_fingerprint`;
* `rules.py`: the ExGRPO rules as pure functions: skip set, buckets, what is stored, evicted and selected;
* `experience_pool.py`: `ExperiencePool`, the index that applies the rules and answers the trainer's replay queries;
* `store.py`: where the rows live: memory-mapped Arrow shards written by a background thread, and a saved folder's
  layout and atomic commit;
* `persistence.py`: `ExperiencePool.save` and `ExperiencePool.load`: incremental, atomic, checked;
* `check.py`: a saved pool is untrusted input: the checks of its state, files and rows;
* `hub.py`: sharing on the Hugging Face Hub: `push_pool` and `pool_from_hub`.

The class docstring of `ExperiencePool` shows a pool filled, queried and saved.
"""

from .experience_pool import ExperiencePool
from .hub import pool_from_hub, push_pool
from .records import TaskOutcome, Trajectory, task_key, tokenizer_fingerprint

__all__ = [
    "ExperiencePool",
    "TaskOutcome",
    "Trajectory",
    "pool_from_hub",
    "push_pool",
    "task_key",
    "tokenizer_fingerprint",
]
