"""Launched by tests/integration/test_trl_tools.py with `accelerate launch`: TRL's `environment_factory` tool loop with replay
under DDP or ZeRO-3 (2 ranks), then a dump of what each rank saw in OUT_DIR/rank{r}.json.

Usage: accelerate launch --config_file CONFIG tests/scripts/tool_replay_multiprocess.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/, for tool_env

from helpers import make_args  # noqa: E402
from loss_check import CheckingTrainer  # noqa: E402
from tool_env import ButtonsEnv, build_tool_model, build_tool_tokenizer, buttons_dataset  # noqa: E402

from trl_exreplay.distributed import exit_distributed  # noqa: E402

out_dir = sys.argv[1]
replayed_rows, masked_tool_tokens, fresh_tool_tokens, generation_calls = [], [], [], []


class RecordingTrainer(CheckingTrainer):
    def _generate_single_turn(self, *args, **kwargs):
        generation_calls[-1] += 1
        return super()._generate_single_turn(*args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        generation_calls.append(0)
        output = super()._generate_and_score_completions(inputs)
        replayed = output["exp_mask"].bool().any(-1)
        tool_tokens = (output["completion_mask"] == 1) & (output["tool_mask"] == 0)
        replayed_rows.append(int(replayed.sum()))
        masked_tool_tokens.append(int(tool_tokens[replayed].sum()))
        fresh_tool_tokens.append(int(tool_tokens[~replayed].sum()))
        assert not (output["exp_mask"].bool() & tool_tokens).any()  # tool results never trained as replayed tokens
        return output


tokenizer = build_tool_tokenizer()
# The test suite's trainer settings (tests/helpers.py), with this run's batch, length and replay.
config = make_args(
    Path(out_dir),
    per_device_train_batch_size=8,
    max_completion_length=48,
    max_steps=8,
    replay_ratio=1.0,
    replay_trajectories_per_group=2,
    replay_start_ratio=0.3,
)
trainer = RecordingTrainer(
    model=build_tool_model(tokenizer),
    args=config,
    train_dataset=buttons_dataset(),
    processing_class=tokenizer,
    environment_factory=ButtonsEnv,
)
trainer.train()
rank = trainer.accelerator.process_index
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(
        {
            "rank": rank,
            "pool_hash": trainer.pool.index_hash(),  # equal on every rank; rank 0 alone holds the rows
            "pool_trajectories": trainer.pool.num_trajectories,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "replayed_rows": replayed_rows,
            "masked_tool_tokens": masked_tool_tokens,
            "fresh_tool_tokens": fresh_tool_tokens,
            "generation_calls": generation_calls,
            # each replaying loss call: the trainer's loss, TRL's part and the replayed term (tests/loss_check.py)
            "loss_checks": [[float(loss), float(trl), float(term)] for loss, trl, term, _ in trainer.checks],
        },
        f,
    )
exit_distributed()
