"""CLI: `python -m trl_exreplay.alfworld {generate,play-walkthroughs,evaluate} ...`."""

from __future__ import annotations

import argparse
import sys

from .splits import ALL_TASK_TYPES, SPLITS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trl_exreplay.alfworld", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate ALFWorld games (json_2.1.1 layout) with verified walkthroughs")
    g.add_argument("--out", required=True, help="output directory (games go to OUT/json_2.1.1/SPLIT/...)")
    g.add_argument("--split", default="train", choices=SPLITS)
    g.add_argument("--num-games", type=int, required=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--task-types",
        nargs="+",
        default=None,
        metavar="TYPE",
        help="task type names or ids 1-6 (default: all six: {})".format(", ".join(ALL_TASK_TYPES)),
    )
    g.add_argument(
        "--wording",
        default="put",
        choices=("put", "move"),
        help='"put X in/on Y" (classic ALFWorld, default) or "move X to Y" (alfworld 0.4.2 grammar)',
    )
    g.add_argument(
        "--scenes",
        nargs="+",
        type=int,
        default=None,
        metavar="N",
        help="floor plans to use, a subset of the split's (default: all of them)",
    )
    g.add_argument(
        "--target-objects",
        nargs="+",
        default=None,
        metavar="TYPE",
        help="what the tasks may ask for: ALFRED object types, e.g. Book CD (default: any)",
    )
    g.add_argument("--workers", type=int, default=None, help="verification processes (default: one per CPU)")
    g.add_argument("--no-verify", action="store_true", help="skip playing walkthroughs on the engine (debugging only)")

    w = sub.add_parser("play-walkthroughs", help="play every game's stored walkthrough on the engine")
    w.add_argument("dir", help="directory searched recursively for game.tw-pddl files")
    w.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    w.add_argument("--quiet", action="store_true", help="no progress bar")

    e = sub.add_parser(
        "evaluate", help="success rate of the walkthrough, the searching expert or a random agent, per task type"
    )
    e.add_argument("dir", help="directory searched recursively for game.tw-pddl files")
    e.add_argument("--agent", default="random", choices=("random", "walkthrough", "expert"))
    e.add_argument("--max-steps", type=int, default=50)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--workers", type=int, default=None, help="processes (default: one per CPU)")
    e.add_argument("--json", default=None, help="also write the result (with the alfworld version) to this file")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "evaluate":
        from .agents import EXPERT, random_agent, score_agent

        agent = {"walkthrough": None, "expert": EXPERT, "random": random_agent}[args.agent]
        result = score_agent(
            args.dir, agent, max_steps=args.max_steps, seed=args.seed, workers=args.workers, progress=True
        )
        print(result.summary())
        if args.json:
            with open(args.json, "w") as f:
                f.write(result.to_json())
        return 0
    if args.command == "generate":
        from .generate import generate_games

        report = generate_games(
            args.out,
            args.split,
            args.num_games,
            args.seed,
            args.task_types,
            wording=args.wording,
            verify=not args.no_verify,
            workers=args.workers,
            progress=True,
            scenes=args.scenes,
            target_objects=args.target_objects,
        )
        print(report.summary())
        return 0 if report.written == report.requested else 1

    from .engine import play_walkthroughs

    results = play_walkthroughs(args.dir, workers=args.workers, progress=not args.quiet)
    for r in results:
        if not r.ok:
            print(f"LOST {r.game}: {r.error}")
    won = sum(r.ok for r in results)
    print(f"{won} won of {len(results)}")
    return 0 if results and won == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
