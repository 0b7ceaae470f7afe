"""Soak: a long run with replay, checkpointing, that must not grow in memory, descriptors or disk.

Trains a tiny model on the key-and-door game (`trl_exreplay.demo.toy`, 24 tasks, so the pool fills within the first
few hundred steps and then only turns over: evictions, dead rows, compactions) with replay on for ``--steps`` steps,
saving a checkpoint (model, optimizer and pool) every ``--save-steps`` and keeping ``--keep`` of them. Every
``--every`` steps it prints the process's RSS, its open file descriptors, the bytes of the live pool's scratch folder,
of the pools in the kept checkpoints and of the whole output folder (each file counted once: the pools' shards are hard
links shared between the scratch folder and the checkpoints), and the pool's size. At the end it fits a line to each
figure over the samples after ``--warmup`` steps and prints its slope per 1,000 steps: the growth must be flat.

    OMP_NUM_THREADS=1 python benchmarks/soak.py --steps 2000 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from importlib.metadata import version

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

LIMITS = dict(max_turns=5, max_completion_length=48, max_tokens_per_turn=4)
FIGURES = ("rss_mb", "open_fds", "scratch_mb", "checkpoint_pools_mb", "output_mb")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def disk_mb(folder: str, seen: set | None = None) -> float:
    """Bytes of the files under `folder` (MB), each inode counted once (and not again if already in `seen`)."""
    seen = set() if seen is None else seen
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                info = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            key = (info.st_dev, info.st_ino)
            if key not in seen:
                seen.add(key)
                total += info.st_blocks * 512
    return total / 2**20


def slope_per_1000(steps: list[int], values: list[float]) -> float:
    if len(steps) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0] * 1000)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--every", type=int, default=100, help="print the figures every this many steps")
    parser.add_argument("--warmup", type=int, default=200, help="slopes are fitted after this many steps")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=2e-4,
        help="slow enough that the pool stays busy (at 2e-3 the game is learnt by step 300 and the pool drains)",
    )
    parser.add_argument("--json", help="write the samples and slopes here")
    args = parser.parse_args(argv)

    from transformers import TrainerCallback

    from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer, MultiTurnSettings
    from trl_exreplay.demo import KeyDoorEnv
    from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
    from trl_exreplay.demo.toy import KEY_DOOR_VOCABULARY, key_door_dataset
    from trl_exreplay.trainer import POOL_DIR, POOL_WORK_DIR

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"versions: trl {version('trl')}, transformers {version('transformers')}, torch {version('torch')}; "
          f"commit {commit}")  # fmt: skip
    samples: list[dict] = []
    started = time.time()

    with tempfile.TemporaryDirectory(prefix="soak-") as output_dir:

        class Sample(TrainerCallback):
            def on_step_end(self, _args, state, control, **kwargs):
                if state.global_step % args.every:
                    return
                seen: set = set()
                scratch = disk_mb(os.path.join(output_dir, POOL_WORK_DIR), seen)
                pools = sum(
                    disk_mb(os.path.join(output_dir, name, POOL_DIR), seen)
                    for name in sorted(os.listdir(output_dir))
                    if name.startswith("checkpoint-")
                )
                pool = trainer.pool
                row = {
                    "step": state.global_step,
                    "rss_mb": rss_mb(),
                    "open_fds": len(os.listdir("/proc/self/fd")),
                    "scratch_mb": scratch,
                    "checkpoint_pools_mb": pools,
                    "output_mb": disk_mb(output_dir),
                    "pool_trajectories": pool.num_trajectories,
                    "pool_tasks": pool.num_tasks,
                    "shards": pool.storage_stats()["trajectory_shards"],
                    "seconds": time.time() - started,
                }
                samples.append(row)
                print(
                    f"step {row['step']:5d}  RSS {row['rss_mb']:7.1f} MB  fds {row['open_fds']:4d}  scratch "
                    f"{row['scratch_mb']:6.2f} MB  checkpoint pools {row['checkpoint_pools_mb']:6.2f} MB  output "
                    f"{row['output_mb']:7.2f} MB  pool {row['pool_trajectories']} trajectories / {row['pool_tasks']} "
                    f"tasks in {row['shards']} shards  ({row['seconds']:.0f} s)",
                    flush=True,
                )

        tokenizer = build_tiny_tokenizer(KEY_DOOR_VOCABULARY)
        config = ExReplayGRPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=16,
            num_generations=8,
            max_steps=args.steps,
            learning_rate=args.learning_rate,
            replay_start_ratio=0.05,
            save_strategy="steps",
            save_steps=args.save_steps,
            save_total_limit=args.keep,
            use_cpu=True,
            bf16=False,
            report_to="none",
            seed=0,
            logging_steps=args.every,
            beta=0.0,
            disable_tqdm=True,
            max_completion_length=LIMITS["max_completion_length"],
        )
        trainer = ExReplayGRPOTrainer(
            model=build_tiny_model(tokenizer, seed=0),
            args=config,
            train_dataset=key_door_dataset(num_tasks=24, repeats=args.steps),
            processing_class=tokenizer,
            text_env_factory=KeyDoorEnv,
            multi_turn=MultiTurnSettings(
                max_turns=LIMITS["max_turns"], max_tokens_per_turn=LIMITS["max_tokens_per_turn"]
            ),
            callbacks=[Sample()],
        )
        trainer.train()

    after = [s for s in samples if s["step"] > args.warmup]
    slopes = {name: slope_per_1000([s["step"] for s in after], [s[name] for s in after]) for name in FIGURES}
    print(f"slopes per 1000 steps after step {args.warmup} ({len(after)} samples): " + ", ".join(
        f"{name} {value:+.3f}" for name, value in slopes.items()))  # fmt: skip
    result = {"steps": args.steps, "samples": samples, "slopes_per_1000_steps": slopes, "commit": commit,
              "seconds": time.time() - started}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
