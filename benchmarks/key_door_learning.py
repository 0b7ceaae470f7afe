"""Does ExReplay GRPO learn where learning is easy? A randomly initialised tiny model trains on the key-and-door game
(`trl_exreplay.demo.toy`) with replay on; its success is measured on sampled episodes played apart from training,
before and after, with the same draws. `--fault` breaks one input of the loss, to show that the measure sees it:

    OMP_NUM_THREADS=1 python benchmarks/key_door_learning.py
    OMP_NUM_THREADS=1 python benchmarks/key_door_learning.py --fault negated --fault shifted --fault replayed-negated

* `negated`: every advantage's sign flipped (the policy is pushed away from the reward).
* `shifted`: each row gets its neighbour's advantage (advantages paired with the wrong episodes).
* `replayed-negated`: only the replayed rows' advantages flipped (the replay path alone is wrong).

`tests/integration/test_learning.py` runs the unbroken case and asserts the gain.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import tempfile
import time
from importlib.metadata import version

LIMITS = dict(max_turns=5, max_completion_length=48, max_tokens_per_turn=4)
FAULTS = ("none", "negated", "shifted", "replayed-negated")
TRAINING = dict(
    per_device_train_batch_size=32,
    num_generations=8,
    max_steps=60,
    learning_rate=1e-2,
    replay_start_ratio=0.3,
    replay_trajectories_per_group=4,  # half of a replayed task's group: the replay path carries real weight
    use_cpu=True,
    bf16=False,
    report_to="none",
    seed=0,
    logging_steps=1,
    save_strategy="no",
    beta=0.0,
    disable_tqdm=True,
)


def _corrupt(advantages, exp_mask, fault: str):
    if fault == "negated":
        return -advantages
    if fault == "shifted":
        return advantages.roll(1, dims=0)
    if fault == "replayed-negated":
        replayed = exp_mask.bool().any(dim=1)
        return advantages.where(~replayed, -advantages)
    return advantages


@contextlib.contextmanager
def fault_in_loss(fault: str):
    """Within the block, the trainer's loss sees advantages broken as `fault` says."""
    from trl_exreplay import ExReplayGRPOTrainer

    if fault not in FAULTS:
        raise ValueError(f"Invalid value {fault!r} for `fault`: allowed values are {', '.join(map(repr, FAULTS))}.")
    compute_loss = ExReplayGRPOTrainer._compute_loss

    def broken(self, model, inputs):
        advantages = _corrupt(inputs["advantages"], inputs["exp_mask"], fault)
        return compute_loss(self, model, {**inputs, "advantages": advantages})

    ExReplayGRPOTrainer._compute_loss = broken
    try:
        yield
    finally:
        ExReplayGRPOTrainer._compute_loss = compute_loss


def train_key_door(output_dir: str, fault: str = "none", episodes_per_task: int = 16) -> dict:
    """Sampled success before and after ExReplay GRPO on the key-and-door game, and how many steps replayed rows."""
    import torch

    from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer, MultiTurnSettings
    from trl_exreplay.demo import KeyDoorEnv
    from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
    from trl_exreplay.demo.toy import KEY_DOOR_VOCABULARY, key_door_dataset
    from trl_exreplay.envs.evaluation import evaluate_policy

    tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
    model = build_tiny_model(tokenizer, seed=0)
    tasks = list(key_door_dataset(num_tasks=6)) * episodes_per_task

    def sampled_success() -> float:
        torch.manual_seed(0)  # the same draws before and after training
        result = evaluate_policy(
            model, tokenizer, tasks, KeyDoorEnv, do_sample=True, temperature=1.0, top_k=0, workers=1, **LIMITS
        )
        if result.errors:
            raise RuntimeError(f"{result.errors} key-and-door episodes failed in the environment")
        return result.success_rate

    before = sampled_success()
    args = ExReplayGRPOConfig(output_dir=output_dir, **TRAINING, max_completion_length=LIMITS["max_completion_length"])
    trainer = ExReplayGRPOTrainer(
        model=model,
        args=args,
        train_dataset=key_door_dataset(num_tasks=6, repeats=400),
        processing_class=tokenizer,
        text_env_factory=KeyDoorEnv,
        multi_turn=MultiTurnSettings(max_turns=LIMITS["max_turns"], max_tokens_per_turn=LIMITS["max_tokens_per_turn"]),
    )
    with fault_in_loss(fault):
        trainer.train()
    fractions = [e["replay/rows_fraction"] for e in trainer.state.log_history if "replay/rows_fraction" in e]
    return {
        "before": before,
        "after": sampled_success(),
        "replay_steps": sum(fraction > 0 for fraction in fractions),
        "replayed_rows_fraction": max(fractions, default=0.0),
        "episodes": len(tasks),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", action="append", choices=FAULTS, help="Repeat for several runs; default: none.")
    options = parser.parse_args(argv)
    print(
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    print(f"versions: trl {version('trl')}, transformers {version('transformers')}, torch {version('torch')}")
    results = []
    for fault in options.fault or ["none"]:
        started = time.time()
        with tempfile.TemporaryDirectory() as output_dir:
            result = train_key_door(output_dir, fault)
        results.append({"fault": fault, **result})
        print(f"fault {fault}: sampled success {result['before']:.3f} -> {result['after']:.3f} "
              f"({result['episodes']} episodes), {result['replay_steps']} of {TRAINING['max_steps']} steps replayed "
              f"(up to {100 * result['replayed_rows_fraction']:.0f}% of rows), {time.time() - started:.0f} s")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
