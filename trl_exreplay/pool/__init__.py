"""The experience pool: past successful trajectories per task, replayed by `ExReplayGRPOTrainer`.

One job a module, in the order a trajectory meets them:

* `records.py`: what the pool holds: `Trajectory`, `TaskOutcome`, and the keys `task_key` and
  `tokenizer_fingerprint`;
* `rules.py`: the ExGRPO rules as pure functions: skip set, buckets, what is stored, evicted and selected;
* `index.py`: `PoolIndex`, the pool's state in RAM (buckets, skip set, each task's trajectory keys), with
  `to_state` / `from_state` for saves; `TaskBuckets`, the view replay draws from;
* `experience_pool.py`: `ExperiencePool`, which applies the rules to the index and its storage and answers the
  trainer's replay queries;
* `store.py`: where the rows live: Arrow files that `datasets` memory-maps, in the live pool's scratch folder;
* `persistence.py`: a saved pool's folder: its layout, its atomic commit, an incremental save and a checked load;
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
