"""The README's "Quick start: the swap" run offline: the same script with a tiny local model and a small local dataset
in place of the Hub's, plus `use_cpu=True` (TRL's default bf16 asks for a GPU without it). A test holds the two
scripts to exactly these differences (tests/integration/test_quick_start.py).

    python examples/quick_start_offline.py     # about 20 s on 2 CPU cores; TRL's accuracy_reward needs math-verify

It writes the tiny model to tiny-sums-model/ and the run (its last checkpoint, with the replay pool) to
Qwen2.5-0.5B-GRPO/, in the current folder.
"""

# ruff: noqa: I001 - the imports stay in the README's order, so that the two scripts compare line by line
from trl_exreplay import ExReplayGRPOConfig as GRPOConfig, ExReplayGRPOTrainer as GRPOTrainer
from trl_exreplay.distributed import exit_distributed
from trl_exreplay.demo.examples import save_sums_model, sums_dataset
from trl.rewards import accuracy_reward

dataset = sums_dataset(repeats=4)  # a few optimizer steps per epoch
args = GRPOConfig(output_dir="Qwen2.5-0.5B-GRPO", num_generations=8, gradient_accumulation_steps=4, use_cpu=True)
trainer = GRPOTrainer(model=save_sums_model(), reward_funcs=accuracy_reward, args=args, train_dataset=dataset)
trainer.train()
exit_distributed()
