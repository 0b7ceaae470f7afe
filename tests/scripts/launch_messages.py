"""Launched by tests/distributed/test_launching.py: one training step of a tiny `ExReplayGRPOTrainer`, then the script
ends as ENDING says, so that the test reads what a launch prints when it starts fewer processes than it was asked for,
and what a gloo run prints as it exits.

Usage: accelerate launch --config_file CONFIG tests/scripts/launch_messages.py OUT_DIR ENDING [no-use-cpu]
  ENDING:     plain (the script just ends) | exit_distributed (trl_exreplay.distributed.exit_distributed())
  no-use-cpu: the trainer's config leaves use_cpu out (on a CPU machine each launched process then comes up alone)
Each process prints "process R of N" (accelerate's view) to stdout.
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer  # noqa: E402
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset  # noqa: E402
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from trl_exreplay.distributed import exit_distributed  # noqa: E402

out_dir, ending = sys.argv[1:3]
if ending not in ("plain", "exit_distributed"):
    raise ValueError(f"Invalid ending {ending!r}: allowed values are 'plain' and 'exit_distributed'.")
tokenizer = build_tiny_tokenizer(VOCABULARY)
args = ExReplayGRPOConfig(
    output_dir=out_dir,
    bf16=False, report_to="none", save_strategy="no", disable_tqdm=True, max_steps=1, num_generations=4,
    per_device_train_batch_size=4, max_completion_length=4, **({} if "no-use-cpu" in sys.argv else {"use_cpu": True}),
)  # fmt: skip
trainer = ExReplayGRPOTrainer(
    model=build_tiny_model(tokenizer, seed=0), reward_funcs=said_target, args=args,
    train_dataset=say_word_dataset(num_tasks=2, repeats=4), processing_class=tokenizer,
)  # fmt: skip
print(f"process {trainer.accelerator.process_index} of {trainer.accelerator.num_processes}", flush=True)
trainer.train()
if ending == "exit_distributed":
    exit_distributed()
