"""Multi-turn GRPO with experience replay on a tiny text game (CPU, no download, under a minute).

    python examples/multi_turn_key_door.py

KeyDoorEnv: "you see a red door and a key"; the agent must say "key" in one turn and the door's colour in a later one.
The trainer plays all episodes of a batch together, trains only the model's tokens, and replays past wins.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer, MultiTurnSettings  # noqa: E402
from trl_exreplay.demo import KeyDoorEnv  # noqa: E402
from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from trl_exreplay.demo.toy import KEY_DOOR_VOCABULARY, key_door_dataset  # noqa: E402
from trl_exreplay.distributed import exit_distributed  # noqa: E402

# ---- configuration -----------------------------------------------------------------------------------------
config = ExReplayGRPOConfig(
    output_dir="outputs/multi_turn_key_door",
    use_cpu=True,
    bf16=False,
    seed=0,
    max_steps=40,
    learning_rate=3e-2,
    per_device_train_batch_size=16,
    num_generations=4,
    beta=0.0,
    logging_steps=5,
    save_strategy="no",
    report_to="none",
    max_completion_length=48,  # the whole episode's tokens at most
    # experience replay
    replay_ratio=0.5,
    replay_start_ratio=0.2,
    replay_trajectories_per_group=1,
)

# ---- model, tasks, environment ----------------------------------------------------------------------------
tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
trainer = ExReplayGRPOTrainer(
    model=build_tiny_model(tokenizer, seed=0),
    args=config,
    train_dataset=key_door_dataset(num_tasks=4, repeats=200),
    processing_class=tokenizer,
    text_env_factory=KeyDoorEnv,  # reward: the environment's (trl_exreplay.envs.env_reward)
    multi_turn=MultiTurnSettings(max_turns=5, max_tokens_per_turn=4, env_step_timeout=30.0),  # the episodes
)
trainer.train()

# ---- summary -----------------------------------------------------------------------------------------------
if trainer.accelerator.is_main_process:
    print(f"{'step':>5} {'success':>8} {'turns':>6} {'replay rows':>11} {'pool':>5}")
    for e in (e for e in trainer.state.log_history if "env/success_rate" in e):
        print(
            f"{e['step']:>5} {e['env/success_rate']:>8.3f} {e['env/turns_mean']:>6.2f} "
            f"{e.get('replay/rows_fraction', 0.0):>11.3f} {e.get('replay/pool_trajectories', 0.0):>5.0f}"
        )
exit_distributed()  # under `accelerate launch`: ends each rank safely (a gloo thread may otherwise abort it at exit)
