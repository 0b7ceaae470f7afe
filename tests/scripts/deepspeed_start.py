"""Launched by tests/distributed/test_launching.py: start DeepSpeed's process group as a training launch does (which
JIT-builds DeepSpeed's shared-memory op on a CPU), then write OUT_DIR/rank{r}.json.

Usage: accelerate launch --config_file recipes/accelerate/zero2_cpu.yaml tests/scripts/deepspeed_start.py OUT_DIR
"""

import json
import sys
from pathlib import Path

from accelerate import PartialState

from trl_exreplay.distributed import exit_distributed

# Under a DeepSpeed config this calls deepspeed.init_distributed, as the Trainer's arguments do on a CPU (gloo)
state = PartialState(backend="gloo")
Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
Path(sys.argv[1], f"rank{state.process_index}.json").write_text(
    json.dumps({"distributed_type": str(state.distributed_type)})
)
exit_distributed()
