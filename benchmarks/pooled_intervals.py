"""Wilson 95% intervals of each method's final success, pooled over its seeds' episodes.

    python benchmarks/pooled_intervals.py docs/results/guided/results.json multi-turn 256 alfworld-few-games 64

Arguments after the results file: pairs of a testbed and the episodes one held-out measurement plays (multi-turn:
256; alfworld-few-games: 8 games x 8 episodes = 64; alfworld: 80 greedy games). A pooled interval says how precisely
the episodes measure the mean; it ignores the spread between seeds, which the paired intervals of
`replay_vs_grpo.py --report` carry.
"""

from __future__ import annotations

import json
import math
import sys


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return centre - half, centre + half


def main(argv: list[str]) -> None:
    results = json.loads(open(argv[0]).read())["testbeds"]
    for name, episodes in zip(argv[1::2], map(int, argv[2::2])):
        for method, entry in results[name]["methods"].items():
            finals = [run["points"][-1]["heldout_success"] for run in entry["runs"].values()]
            won, played = round(sum(f * episodes for f in finals)), episodes * len(finals)
            low, high = wilson(won, played)
            print(f"{name} {method}: {won}/{played} = {won / played:.3f} [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main(sys.argv[1:])
