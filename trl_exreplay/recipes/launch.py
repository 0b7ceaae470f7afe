"""One stage of a launched job in processes of its own: `run_as_own_launch(module, *args)` runs `python -m module
*args` as a child of every rank, with the same ranks, devices and Accelerate/DeepSpeed settings as the launch, and
waits for it.

Why: Accelerate keeps one `AcceleratorState` per process and refuses a second `Accelerator` that brings a DeepSpeed
plugin ("You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`", accelerate 1.15), which is what
two `Trainer`s in one process under DeepSpeed do (an SFT warm start, then RL). Accelerate has no public way to end that
state. A stage run in a child process of its own gets a fresh state, and its memory (model, optimizer, DeepSpeed
engine) is all returned to the system when it ends.

The children form their own process group, rendezvousing at the launch's `MASTER_ADDR` on a port the main process
picks, so that they never meet the parents' group. Every rank must call `run_as_own_launch` (it is collective), and
the module must end with `trl_exreplay.distributed.exit_distributed()` like any launched script.

```python
# train.py, run with `accelerate launch --config_file recipes/accelerate/zero3_gpu.yaml train.py`
from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer
from trl_exreplay.recipes.launch import run_as_own_launch

args = ExReplayGRPOConfig(output_dir="rl")  # builds the launch's process group
run_as_own_launch("my_project.sft", "--output_dir", "sft")  # SFT on the same ranks, in processes of its own
trainer = ExReplayGRPOTrainer(model="sft", args=args, reward_funcs=..., train_dataset=...)  # this process's first
```

`trl_exreplay.alfworld.warmstart.warm_start` runs the ALFWorld recipe's SFT warm start this way.
"""

from __future__ import annotations

import os
import subprocess
import sys


def child_environment(master_port: int | None) -> dict[str, str]:
    """This process's environment for a child launch: a new rendezvous port when there are several ranks, the store
    hosted by the child of rank 0 (not by torchrun's agent, which knows nothing of the children), this process's torch
    thread count, and this process's `trl_exreplay` importable."""
    import torch

    env = dict(os.environ)
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # else every child waits for a store that no one serves
    env.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # the same arithmetic as in this process
    # the folder that holds the `trl_exreplay` package
    # (never the package itself: its `alfworld` would shadow ALFWorld's)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["trl_exreplay"].__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def run_as_own_launch(module: str, *args: str) -> None:
    """Runs `python -m module *args` in a child of this rank as a launch of its own (see the module's docstring) and
    waits for it; raises `RuntimeError` naming the module and the exit status if it fails. Collective: call it on
    every rank."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list
    from accelerate.utils.other import get_free_port

    state = PartialState()
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != launched:  # the children would wait for ranks that never come
        raise RuntimeError(
            f"run_as_own_launch: this process is one of {launched} launched ranks, but its distributed state has "
            f"{state.num_processes}; set the process group up first (e.g. `PartialState(cpu=True)`, or build the "
            "`TrainingArguments`, which does)."
        )
    port = None
    if state.num_processes > 1:
        port = broadcast_object_list([get_free_port() if state.is_main_process else None])[0]
    status = subprocess.run([sys.executable, "-m", module, *args], env=child_environment(port)).returncode
    if status != 0:
        raise RuntimeError(
            f"`python -m {module}` (run as its own launch) failed on rank {state.process_index} "
            f"with exit status {status}; its output is above."
        )
