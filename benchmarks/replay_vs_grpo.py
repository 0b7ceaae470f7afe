"""Does experience replay learn more per fresh rollout than plain GRPO? One harness for every testbed.

    OMP_NUM_THREADS=1 python benchmarks/replay_vs_grpo.py --testbed single-turn \\
        --methods grpo,exreplay,exreplay-exgrpo --seeds 0,1,2,3,4 --out results/tuning
    python benchmarks/replay_vs_grpo.py --report --out results/tuning      # tables (markdown) and plots again

Each method of a testbed starts, per seed, from the same model (the testbed's tiny model initialised with the seed,
then its warm start), trains with the same batch size for the same number of optimizer steps, and is measured every
`eval_every` steps on held-out problems that training never sees, with the same sampling draws for every method
(evaluation runs under `torch.random.fork_rng`, so it never moves the training's random stream). Replay generates
fewer fresh rollouts per step, so curves are drawn against **fresh rollouts consumed** (generated completions, or
environment episodes), not steps.

The methods of a seed run back to back in one process (their order turning by one each seed), so that their training
seconds were spent under the same machine load; each run records that load (`run.load`: the 1-minute load average
before and after it), the cores it was allowed, and the commit of the harness and of the `trl_exreplay` it imported.
For time-axis figures run one call at a time, pinned to a core nothing else uses (`taskset -c 1 ...`); per-seed calls
made apart (other cores, other machines) are merged with `--merge DIR... --out DIR`.

`grpo` is `ExReplayGRPOTrainer` with `enable_experience_replay=False`. For the first seed of a testbed TRL's own
`GRPOTrainer` can train (the single-turn one; multi-turn testbeds use this library's `text_env_factory`), the harness also
trains `GRPOTrainer` on the same run and records whether every logged loss and every point of its curve is identical
to `grpo`'s (the drop-in claim, measured; `--no-trl-check` skips it).

`DIR/results.json` holds every run (merged across calls: a run is keyed by testbed, method and seed, and a later call
replaces it; a call whose testbed settings differ from those of the runs already there is refused); its schema is
`replay_harness/results_file.py`'s docstring. `DIR/<testbed>.png` plots held-out success against fresh rollouts and,
beside it, against training seconds: the mean over seeds and the min-max band, one line per method.

The report (`--report`) reads every figure per seed, each method against the baseline's run on the same seed: the
normalised area under held-out success over fresh rollouts (and over training seconds) up to the fewest any method
consumed on that seed, the fresh rollouts to the seed's baseline final and to the testbed's `target_levels` (median and
geometric mean of the ratios, with the seeds that never reach a target and those where it is not above the start),
final success (also on the seeds where neither run collapsed) and collapses (exact McNemar). The ratio read off curves
averaged over seeds is printed only as an appendix that shows how fragile it is (`--mean-curve`).

This file is the command line; the harness's parts are in `replay_harness/` (presets, runs, results_file, statistics,
report, plots) and the testbeds in `replay_testbeds/`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the harness's parts and the testbeds live beside it

from replay_harness.plots import plot  # noqa: E402
from replay_harness.presets import PRESETS  # noqa: E402
from replay_harness.report import markdown_table, mean_curve_lines  # noqa: E402
from replay_harness.results_file import (  # noqa: E402
    check_same_settings,
    load_results,
    merge_results,
    record_run,
    record_trl_check,
    runs_before_fixes,
)
from replay_harness.runs import compare_with_trl, train_one  # noqa: E402
from replay_testbeds import TESTBEDS  # noqa: E402


def report(out: Path, baseline: str = "grpo", mean_curve: list[str] | None = None) -> str:
    """Redraw the plots of the results folder `out` and return its tables (with the mean-curve appendix at the levels
    `mean_curve`)."""
    results = load_results(out)
    before_fixes = runs_before_fixes(out)
    parts = []
    for name, entry in results["testbeds"].items():
        if entry["methods"]:
            plot(out, name, entry)
            table = markdown_table(name, entry, baseline, before_fixes)
            if mean_curve and baseline in entry["methods"]:
                table += "\n" + "\n".join(mean_curve_lines(entry, baseline, mean_curve))
            parts.append(table)
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------------- command line
def parse_args(argv=None):
    testbeds = "\n".join(f"  {name}: {cls.summary}" for name, cls in TESTBEDS.items())
    presets = "\n".join(f"  {name}: {preset or '(config defaults)'}" for name, preset in PRESETS.items())
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"testbeds:\n{testbeds}\n\nmethod presets:\n{presets}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--testbed", choices=sorted(TESTBEDS), help="Testbed to run (see below).")
    parser.add_argument("--methods", default="grpo,exreplay,exreplay-exgrpo", help="Comma-separated presets.")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="Comma-separated seeds.")
    parser.add_argument("--out", required=True, type=Path, help="Folder of results.json and the plots.")
    parser.add_argument("--max-steps", type=int, help="Override the testbed's optimizer steps (smoke runs).")
    parser.add_argument("--set", action="append", metavar="FIELD=JSON",
                        help="Override a training field of the testbed for every method (tuning), e.g. learning_rate=1e-4.")  # fmt: skip
    parser.add_argument("--model", action="append", metavar="FIELD=JSON",
                        help="Override a field of the testbed's tiny model (`trl_exreplay.demo.tiny.build_tiny_model`), e.g. "
                             "hidden_size=256; with `--set use_cpu=false` the runs train on the GPU.")  # fmt: skip
    parser.add_argument("--no-trl-check", dest="trl_check", action="store_false",
                        help="Skip the run of TRL's GRPOTrainer on the first seed.")  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="No progress bars.")
    parser.add_argument("--report", action="store_true", help="Only print the tables and redraw the plots of --out.")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                        help="Merge the runs of these results folders into --out (refusing runs that disagree), then "
                             "redraw its plots.")  # fmt: skip
    parser.add_argument("--baseline", default="grpo",
                        help="With --report: the method the paired differences and rollout ratios are taken against.")  # fmt: skip
    parser.add_argument("--mean-curve", metavar="LEVELS",
                        help="With --report: also print the appendix of the ratio read off the curves averaged over "
                             "seeds, at these comma-separated levels ('final': the baseline's mean final), to show how "
                             "fragile it is. Not an endpoint: the tables' figures are per seed.")  # fmt: skip
    options = parser.parse_args(argv)
    if not options.report and not options.merge and options.testbed is None:
        parser.error("--testbed is required unless --report or --merge")
    options.methods = [m for m in options.methods.split(",") if m]
    unknown = [m for m in options.methods if m not in PRESETS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}: allowed values are {', '.join(PRESETS)}")
    try:
        options.seeds = [int(s) for s in options.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {options.seeds!r}")
    return options


def main(argv=None) -> dict:
    options = parse_args(argv)
    if options.merge:
        merge_results(options.merge, options.out)
    if options.report or options.merge:
        levels = [level for level in (options.mean_curve or "").split(",") if level]
        print(report(options.out, options.baseline, levels))
        return load_results(options.out)
    testbed = TESTBEDS[options.testbed]()
    for field_value in options.set or []:
        name, _, value = field_value.partition("=")
        testbed.training = {**testbed.training, name: json.loads(value)}
    for field_value in options.model or []:
        name, _, value = field_value.partition("=")
        testbed.model_kwargs = {**testbed.model_kwargs, name: json.loads(value)}
    if options.max_steps is not None:
        testbed.training = {**testbed.training, "max_steps": options.max_steps}
        testbed.eval_every = min(testbed.eval_every, options.max_steps)
    check_same_settings(options.out, testbed)
    results = None
    try:
        for k, seed in enumerate(options.seeds):
            initial = testbed.build(seed)
            # The methods of a seed run back to back in this process, so that their training seconds compare (the
            # same machine load); their order turns by one each seed, so that no method always runs first.
            turn = k % len(options.methods)
            for method in options.methods[turn:] + options.methods[:turn]:
                run = train_one(testbed, method, seed, initial, progress=options.progress)
                results = record_run(options.out, testbed, method, seed, run)
                if method == "grpo" and options.trl_check and testbed.trl_comparable and seed == options.seeds[0]:
                    theirs = train_one(testbed, method, seed, initial, progress=options.progress, trl=True)
                    check = {"seed": seed, **compare_with_trl(run, theirs), "run": theirs["run"]}
                    results = record_trl_check(options.out, testbed, check)
    finally:
        testbed.close()
    entry = results["testbeds"][testbed.name]
    plot(options.out, testbed.name, entry)
    print(markdown_table(testbed.name, entry, "grpo", runs_before_fixes(options.out)))
    return results


if __name__ == "__main__":
    main()
