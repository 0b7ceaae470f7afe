"""Launched by tests/test_multiprocess.py with `accelerate launch`: train with replay active, dump what each rank saw.

Usage: accelerate launch --config_file CONFIG tests/scripts/replay_multiprocess.py OUT_DIR
Each rank writes OUT_DIR/rank{r}.json with its pool hash, the replay plans it made, losses and generated rows.
"""

import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import trl_exreplay.trainer as trainer_module  # noqa: E402
from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer  # noqa: E402
from trl_exreplay.examples import VOCABULARY, said_target, say_word_dataset  # noqa: E402
from trl_exreplay.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402

out_dir = sys.argv[1]
plans = []
original_plan_replay = trainer_module.plan_replay


def recording_plan_replay(*args, **kwargs):
    plan = original_plan_replay(*args, **kwargs)
    plans.append({str(group): task for group, task in plan.replay_groups.items()})
    return plan


trainer_module.plan_replay = recording_plan_replay

generated_rows = []


class CountingTrainer(ExReplayGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        generate = model.generate

        def counting_generate(*a, **kw):
            generated_rows.append(int(kw["input_ids"].size(0)))
            return generate(*a, **kw)

        model.generate = counting_generate


tokenizer = build_tiny_tokenizer(VOCABULARY)
config = ExReplayGRPOConfig(
    output_dir=os.path.join(out_dir, "run"),
    use_cpu=True,
    bf16=False,
    seed=0,
    max_steps=6,
    learning_rate=5e-2,
    per_device_train_batch_size=6,  # 12 rows over 2 ranks, G=4: group 1 spans both ranks
    num_generations=4,
    max_completion_length=4,
    beta=0.0,
    logging_steps=1,
    save_strategy="steps",
    save_steps=3,
    report_to="none",
    disable_tqdm=True,
    exp_ratio=1.0,
    replay_start_ratio=0.3,
    offpolicy_trajectories_per_task=1,
)
trainer = CountingTrainer(
    model=build_tiny_model(tokenizer, seed=0),
    reward_funcs=said_target,
    args=config,
    train_dataset=say_word_dataset(num_tasks=3, repeats=20),
    processing_class=tokenizer,
)
trainer.train()

rank = trainer.accelerator.process_index
losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
replay_tasks = [e["replay/tasks"] for e in trainer.state.log_history if "replay/tasks" in e]
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(
        {
            "rank": rank,
            "world_size": trainer.accelerator.num_processes,
            "pool_hash": trainer.pool.content_hash(),
            "pool_trajectories": trainer.pool.num_trajectories,
            "plans": plans,
            "losses": losses,
            "replay_tasks": replay_tasks,
            "generated_rows": generated_rows,
        },
        f,
    )
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
