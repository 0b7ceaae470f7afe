"""Single-turn GRPO with experience replay on a tiny local model (CPU, no download, about a minute).

    python examples/single_turn_replay.py                      # one process
    accelerate launch --config_file recipes/accelerate/ddp_cpu.yaml examples/single_turn_replay.py

The task: "say the word X"; reward 1 when the completion contains X. The swap from TRL is one line:
`GRPOTrainer` -> `ExReplayGRPOTrainer` (and `GRPOConfig` -> `ExReplayGRPOConfig` for the replay knobs).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer  # noqa: E402
from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset  # noqa: E402
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from trl_exreplay.distributed import exit_distributed  # noqa: E402

# ---- configuration (everything visible here) -------------------------------------------------------------
config = ExReplayGRPOConfig(
    output_dir="outputs/single_turn_replay",
    use_cpu=True,
    bf16=False,
    seed=0,
    max_steps=200,
    learning_rate=1e-2,
    per_device_train_batch_size=16,
    num_generations=4,
    max_completion_length=4,
    temperature=1.0,
    beta=0.0,
    logging_steps=20,
    save_strategy="no",
    report_to="none",
    # experience replay
    replay_ratio=0.5,
    replay_start_ratio=0.2,
    replay_trajectories_per_group=1,
    replay_shaping="clip",
)

# ---- data, model, reward -----------------------------------------------------------------------------------
tokenizer = build_tiny_tokenizer(VOCABULARY)
model = build_tiny_model(tokenizer, seed=0)
dataset = say_word_dataset(num_tasks=8, repeats=50)

# ---- train -------------------------------------------------------------------------------------------------
trainer = ExReplayGRPOTrainer(
    model=model,
    reward_funcs=said_target,
    args=config,
    train_dataset=dataset,
    processing_class=tokenizer,
)
trainer.train()
trainer.save_model()

# ---- summary -----------------------------------------------------------------------------------------------
if trainer.accelerator.is_main_process:
    history = [e for e in trainer.state.log_history if "reward" in e]
    print(f"{'step':>5} {'reward':>7} {'replay rows':>11} {'pool trajs':>10}")
    for entry in history:
        print(
            f"{entry['step']:>5} {entry['reward']:>7.3f} {entry.get('replay/rows_fraction', 0.0):>11.3f} "
            f"{entry.get('replay/pool_trajectories', 0.0):>10.0f}"
        )
    print("pool:", trainer.pool.stats())
    print("saved model and pool to", config.output_dir)
exit_distributed()  # under `accelerate launch`: ends each rank safely (a gloo thread may otherwise abort it at exit)
