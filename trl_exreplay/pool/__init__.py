"""The experience pool: past successful trajectories per task, replayed by `ExReplayGRPOTrainer`.

One job a module, in the order a trajectory meets them:

* `records.py`: what the pool holds: `Trajectory`, `TaskOutcome`, and the keys `task_key` and
  `tokenizer_fingerprint`;
* `rules.py`: the ExGRPO rules as pure functions: skip set, buckets, what is stored, evicted and selected;
* `index.py`: `PoolIndex`, the pool's state in RAM (buckets, skip set, each task's trajectory keys), with
  `to_state` / `from_state` for saves; `TaskBuckets`, the view replay draws from;
* `experience_pool.py`: `ExperiencePool`, which applies the rules to the index and its storage and answers the
  trainer's replay queries;
* `shards.py`: where the rows live: memory-mapped Arrow shards, written by `writer.py`'s background thread;
* `folder.py`: files that appear complete or not at all: a saved folder's layout and atomic commit, and the live
  pool's scratch folder;
* `persistence.py`: a save and a load of the storage: incremental, atomic, checked;
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
