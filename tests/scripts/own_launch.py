"""Launched by tests/distributed/test_launching.py: each rank runs a stage as a launch of its own (`run_as_own_launch`), this same
module run with `python -m own_launch child|fail OUT_DIR`, then uses the launch's own process group again.

Usage: accelerate launch --config_file recipes/accelerate/ddp_cpu.yaml tests/scripts/own_launch.py parent OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

from trl_exreplay.distributed import exit_distributed
from trl_exreplay.recipes.launch import run_as_own_launch


def summed(value: float) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return tensor.item()


def report(out_dir: str, name: str, **facts) -> None:
    Path(out_dir, f"{name}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    role, out_dir = sys.argv[1], sys.argv[2]
    state = PartialState(cpu=True)  # gloo, as the Trainer's arguments set it up on a CPU
    if role == "parent":
        here = os.path.dirname(os.path.abspath(__file__))  # where the children find this module
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
        run_as_own_launch("own_launch", "child", out_dir)
        try:
            run_as_own_launch("own_launch", "fail", out_dir)
            error = None
        except RuntimeError as e:
            error = str(e)
        total = summed(state.process_index + 1.0)  # the launch's group, after its children's groups came and went
        report(out_dir, f"parent{state.process_index}", sum=total, port=os.environ["MASTER_PORT"], pid=os.getpid(),
               error=error)  # fmt: skip
    elif role == "child":
        report(out_dir, f"child{state.process_index}", sum=summed(10.0 * (state.process_index + 1)),
               world=state.num_processes, port=os.environ["MASTER_PORT"], parent=os.getppid())  # fmt: skip
    else:
        sys.exit(3)
    exit_distributed()
