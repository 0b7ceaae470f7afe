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

Example:

```python
from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory

pool = ExperiencePool(experience_rbound=4)
traj = Trajectory("t1", [1, 2], [3, 4], [1, 1], [-0.5, -0.7], [1.0], 1.0, entropy=0.9, policy_version=3)
pool.record_outcome(TaskOutcome("t1", successes=2, num_fresh=4, successful=[traj], task_row='{"prompt": "hi"}'))
assert pool.bucket_of("t1") == 2 and pool.num_trajectories == 1
assert [t.traj_id for t in pool.choose(["t1"], 1)["t1"]] == [0]
```
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
