"""What removing spelled special tokens from observations costs (`env_special_tokens='remove'`, the default), as a
share of a rollout turn.

One run, on the recipe's default (recipes/configs/alfworld_tiny_cpu.yaml): generated ALFWorld games of its slice
(pick and place, a book, bedrooms 309-311), its tiny model (128 hidden, 4 layers; randomly initialised: the warm start
changes what it says, not what a turn costs), its tokenizer and its episode limits (15 turns of 12 tokens at most,
1,024 completion tokens, sampling at temperature 0.5), played by the multi-turn engine with the environments in this
process. It prints:

* the rollout: its turns (one batched generation, the environments' steps, the observations tokenized), the seconds
  of a turn, and the seconds spent in the cleaning, measured around each call, with its share of the rollout;
* the cleaning of one observation, alone (median of repeated calls): a typical (median-length) and the longest
  ALFWorld observation of that rollout, and a 100,000-character one (ALFWorld's text repeated), without and with spellings (one per 1,000 characters), with
  the recipe's tokenizer (8 special tokens) and with one holding Qwen2.5's 22 special tokens; each next to what
  tokenizing the same text costs, and as a share of the rollout's mean turn.

The cleaning never tokenizes: it is one regular-expression scan per observation (a second only where a removal
joined the pieces of another spelling). ALFWorld's text spells no special token, so nothing is removed from it and
its tokens are those of `keep` (tests/unit/test_rollout.py holds both).

    OMP_NUM_THREADS=1 python benchmarks/untrusted_observation_cost.py            # 4 games x 4 episodes
    OMP_NUM_THREADS=1 python benchmarks/untrusted_observation_cost.py --games 2 --group 2
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

# Qwen2.5's added special tokens (its tokenizer_config.json), the pattern a real run's cleaning scans with.
QWEN25_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
LONG = 100_000  # characters of the long observation


class TimedFilter:
    """A `SpecialTokenFilter` whose calls are timed and whose texts are kept."""

    def __init__(self, inner):
        self.inner, self.seconds, self.texts = inner, 0.0, []

    def __call__(self, text: str) -> str:
        start = time.perf_counter()
        cleaned = self.inner(text)
        self.seconds += time.perf_counter() - start
        self.texts.append(text)
        return cleaned

    def __getattr__(self, name):
        return getattr(self.inner, name)


def rollout(tokenizer, tasks, group: int, seed: int) -> dict:
    """One generation batch of the recipe played by the engine: `group` episodes of each task."""
    import torch

    from trl_exreplay.alfworld import AlfWorldEnv
    from trl_exreplay.demo.tiny import build_tiny_model
    from trl_exreplay.envs.rollout import MultiTurnRollout, generate_batch

    torch.manual_seed(seed)
    model = build_tiny_model(tokenizer, hidden_size=128, num_layers=4, num_heads=4, seed=seed,
                             max_position_embeddings=1024 + 256).eval()  # fmt: skip
    factory = functools.partial(AlfWorldEnv, max_steps=15, show_admissible=False, restate_goal=True)
    engine = MultiTurnRollout(factory, tokenizer, max_turns=15, max_tokens_per_turn=12, max_completion_length=1024,
                              workers=len(tasks) * group)  # fmt: skip
    engine.observation_filter = timed = TimedFilter(engine.observation_filter)
    turn_seconds: list[float] = []
    last = [time.perf_counter()]

    def generate(contexts, max_new_tokens):
        now = time.perf_counter()  # a turn: from one generation to the next (its steps and tokenizing between)
        turn_seconds.append(now - last[0])
        last[0] = now
        with torch.no_grad():
            return generate_batch(model, contexts, max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_ids={tokenizer.eos_token_id}, do_sample=True, temperature=0.5)  # fmt: skip

    rows = [dict(task) for task in tasks for _ in range(group)]
    start = time.perf_counter()
    episodes = engine.run(rows, generate)
    total = time.perf_counter() - start
    turns = turn_seconds[1:] + [time.perf_counter() - last[0]]  # the first interval is the resets
    return {"episodes": episodes, "seconds": total, "reset_seconds": turn_seconds[0], "turns": turns,
            "clean_seconds": timed.seconds, "texts": timed.texts, "removed": engine.special_tokens_removed,
            "errors": dict(engine.errors)}  # fmt: skip


def median_seconds(fn, min_seconds: float = 0.2) -> float:
    """Median seconds of one call of `fn` over 5 rounds of enough calls to last `min_seconds`."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    number = max(1, int(number * min_seconds / 0.2))
    return statistics.median(t / number for t in timer.repeat(repeat=5, number=number))


def with_spellings(text: str, spelling: str, every: int = 1000) -> str:
    return "".join(text[i : i + every] + spelling for i in range(0, len(text), every))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="episodes per game (num_generations)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from trl_exreplay.alfworld import alfworld_tasks, generate_games
    from trl_exreplay.alfworld.warmstart import alfworld_tokenizer
    from trl_exreplay.untrusted_text import SpecialTokenFilter

    tokenizer = alfworld_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        generate_games(tmp, split="train", num_games=args.games, seed=args.seed, task_types=["pick_and_place_simple"],
                       verify=False, scenes=[309, 310, 311], target_objects=["Book"])  # fmt: skip
        tasks = list(alfworld_tasks(os.path.join(tmp, "json_2.1.1", "train"), system_prompt=None))
        run = rollout(tokenizer, tasks, args.group, args.seed)

    turns, texts = run["turns"], run["texts"]
    mean_turn = statistics.fmean(turns)
    by_length = sorted(texts, key=len)
    typical, longest = by_length[len(texts) // 2], by_length[-1]  # the median-length and the longest of the rollout
    long = (typical * (LONG // len(typical) + 1))[:LONG]

    qwen = alfworld_tokenizer()
    qwen.add_special_tokens({"additional_special_tokens": QWEN25_SPECIAL_TOKENS})
    commit = subprocess.run(["git", "-C", str(REPOSITORY), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"  # fmt: skip
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")  # fmt: skip
    print(f"versions: trl-exreplay {commit}, trl {version('trl')}, transformers {version('transformers')}, "
          f"torch {version('torch')}, tokenizers {version('tokenizers')}, alfworld {version('alfworld')}")  # fmt: skip
    episodes = run["episodes"]
    print(f"rollout: {len(episodes)} episodes ({args.games} games x {args.group}), {len(turns)} turns, "
          f"{len(texts)} observations cleaned (median {len(typical)} characters), "
          f"{run['removed']} spellings removed, errors {run['errors'] or 0}")  # fmt: skip
    print(f"  {run['seconds']:.2f} s: resets {run['reset_seconds']:.2f} s, a turn {mean_turn * 1e3:.1f} ms mean "
          f"(median {statistics.median(turns) * 1e3:.1f} ms)")  # fmt: skip
    share = run["clean_seconds"] / run["seconds"]
    print(f"  cleaning: {run['clean_seconds'] * 1e3:.3f} ms in all, {share:.5%} of the rollout, "
          f"{run['clean_seconds'] / len(texts) * 1e6:.1f} us per observation")  # fmt: skip
    print(f"one observation, cleaned alone (median of 5 rounds), and as a share of the mean turn "
          f"({mean_turn * 1e3:.1f} ms):")  # fmt: skip
    print(f"  {'tokenizer':22s} {'observation':34s} {'clean':>10s} {'share':>9s} {'tokenize':>10s}")
    for name, tok, spelling in (("recipe (8 special)", tokenizer, "<eos>"),
                                ("Qwen2.5's 22 special", qwen, "<|im_end|>")):  # fmt: skip
        cases = (
            (f"typical ALFWorld ({len(typical)} chars)", typical),
            (f"longest ALFWorld ({len(longest)} chars)", longest),
            (f"{LONG:,} chars", long),
            (f"{LONG:,} chars, 1 spelling/1,000", with_spellings(long, spelling)),
        )
        for label, text in cases:
            remove = SpecialTokenFilter(tok, "remove")
            clean = median_seconds(lambda t=text, f=remove: f(t))
            tokenize = median_seconds(lambda t=text, k=tok: k(t, add_special_tokens=False))
            print(f"  {name:22s} {label:34s} {clean * 1e6:8.1f}us {clean / mean_turn:9.4%} {tokenize * 1e6:8.0f}us")


if __name__ == "__main__":
    main()
