"""The report's statistics, every one per seed: each method's run against the baseline's run on the same seed (the
normalised area under held-out success, the paired 95% t interval, the exact sign test, exact McNemar on collapses,
the rollouts to reach a level, leaving one seed out, medians counting a seed that never reaches a level), and
`summarize`, one row of them per method of a testbed's results entry. Pure functions of the results (no I/O)."""

from __future__ import annotations

import math
import statistics

from .results_file import SPLIT_SERIES, rows_per_step

# Every figure of the tables is computed per seed, each method against the baseline's run on the same seed; the curves
# averaged over seeds (`method_curve`) only draw the plots and the appendix that shows why no figure is read off them.
AXES = {"rollouts": "fresh_rollouts", "time": "wall_s"}  # the x-axes of the area under the curve


def method_curve(runs: dict) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per evaluation point (over seeds): mean fresh rollouts, mean, min and max held-out success (plots only)."""
    return mean_curve(runs, "fresh_rollouts")


def mean_curve(runs: dict, axis: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per evaluation point (over seeds): the mean x along `axis` ("fresh_rollouts" or "wall_s"), and the mean, min and
    max held-out success."""
    series = [run["points"] for run in runs.values()]
    n = min(len(points) for points in series)
    xs = [sum(points[i][axis] for points in series) / len(series) for i in range(n)]
    ys = [[points[i]["heldout_success"] for points in series] for i in range(n)]
    return xs, [sum(y) / len(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


# 97.5% quantiles of Student's t for 1..30 degrees of freedom (no scipy needed); past 30, the value at 30 (wider than
# the exact one, never narrower).
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]  # fmt: skip


def paired_interval(differences: list[float]) -> dict | None:
    """Mean of per-seed differences to the baseline and its 95% t interval (None without two seeds)."""
    n = len(differences)
    if n < 2:
        return None
    mean = sum(differences) / n
    std = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    half = T975[min(n - 1, len(T975)) - 1] * std / math.sqrt(n)
    return {"mean": mean, "std": std, "low": mean - half, "high": mean + half, "seeds": n}


def sign_test(differences: list[float]) -> dict:
    """Seeds above and below the baseline (ties dropped) and the exact two-sided binomial p of so lopsided a split
    under "either is as likely"."""
    wins, losses = sum(d > 0 for d in differences), sum(d < 0 for d in differences)
    n = wins + losses
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2**n if n else 1.0
    return {"wins": wins, "losses": losses, "ties": len(differences) - n, "p": min(1.0, 2 * tail)}


def paired(differences: list[float]) -> dict | None:
    """The paired statistics of per-seed differences: mean and 95% t interval, median, exact sign test."""
    if not differences:
        return None
    return {"interval": paired_interval(differences), "median": statistics.median(differences),
            "sign": sign_test(differences), "seeds": len(differences)}  # fmt: skip


def collapsed(points: list[dict]) -> bool:
    """A run that ends below half its own best held-out success (and had one above 0)."""
    best = max(p["heldout_success"] for p in points)
    return best > 0 and points[-1]["heldout_success"] < best / 2


def rollouts_to_reach(xs: list[float], ys: list[float], level: float) -> float | None:
    """Fresh rollouts at which the curve first reaches `level` (linear between points); None if it never does."""
    for i, y in enumerate(ys):
        if y >= level - 1e-12:
            if i == 0:
                return xs[0]
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (xs[i] - x0) * (level - y0) / (y - y0)
    return None


def seed_curve(run: dict, axis: str = "fresh_rollouts") -> tuple[list[float], list[float]]:
    """One run's held-out curve: x (`fresh_rollouts`, or `wall_s`: training seconds) and success at each point."""
    return [p[axis] for p in run["points"]], [p["heldout_success"] for p in run["points"]]


def value_at(xs: list[float], ys: list[float], x: float) -> float:
    """The curve at `x`: linear between its points, its first value before them and its last after them."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1 = xs[i - 1], xs[i]
            return ys[i] if x1 == x0 else ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)
    return ys[-1]


def normalised_auc(xs: list[float], ys: list[float], end: float) -> float:
    """The trapezoid integral of the curve from 0 to `end` (interpolated there), divided by `end`: its mean success
    over [0, end]."""
    knots = [(0.0, value_at(xs, ys, 0.0))] + [(x, y) for x, y in zip(xs, ys) if 0 < x < end]
    knots.append((end, value_at(xs, ys, end)))
    return sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(knots, knots[1:])) / end


def seed_aucs(methods: dict, axis: str) -> dict[str, dict[str, float]]:
    """Per method and seed, the normalised area under held-out success over `axis` ("fresh_rollouts" or "wall_s") up
    to R, the smallest last x that any method of the comparison (every method of `methods` that ran the seed)
    reached on that seed: every method of a seed is read over the same range."""
    ends: dict[str, float] = {}
    for method in methods.values():
        for seed, run in method["runs"].items():
            last = run["points"][-1][axis]
            ends[seed] = min(ends.get(seed, last), last)
    return {
        name: {seed: normalised_auc(*seed_curve(run, axis), ends[seed])
               for seed, run in method["runs"].items() if ends[seed] > 0}
        for name, method in methods.items()
    }  # fmt: skip


def to_baseline_final(run: dict, base_run: dict, axis: str = "fresh_rollouts") -> dict:
    """Fresh rollouts (or, with `axis="wall_s"`, training seconds) `run` needs to reach the same seed's baseline final
    (`base_run`'s last held-out success), and its ratio to what the baseline needed to first reach it. Not scoreable
    when that target is at or below the seed's initial success (its step-0 point: every method of a seed starts from
    the same model)."""
    target = base_run["points"][-1]["heldout_success"]
    if target <= base_run["points"][0]["heldout_success"]:
        return {"target": target, "status": "not scoreable"}
    base_need = rollouts_to_reach(*seed_curve(base_run, axis), target)
    need = rollouts_to_reach(*seed_curve(run, axis), target)
    if need is None:
        return {"target": target, "status": "never", "baseline_need": base_need}
    return {"target": target, "status": "reached", "need": need, "baseline_need": base_need,
            "ratio": need / base_need}  # fmt: skip


def median_counting_never(final: dict[str, dict]) -> float | None:
    """The median ratio to the baseline's final over every scoreable seed, a seed that never reached it counted as
    never (infinite: the median is infinite when half the seeds or more never do); None without a scoreable seed.
    The median over the seeds that reached it alone leaves out the seeds where a method did worst."""
    ratios = [
        f["ratio"] if f["status"] == "reached" else math.inf for f in final.values() if f["status"] != "not scoreable"
    ]
    return statistics.median(ratios) if ratios else None


def interval_side(differences: list[float]) -> str:
    """Where the 95% t interval of the mean difference lies: "above 0", "below 0" or "contains 0"."""
    interval = paired_interval(differences)
    if interval is None:
        return "contains 0"
    return "above 0" if interval["low"] > 0 else "below 0" if interval["high"] < 0 else "contains 0"


def leave_one_out(differences: dict[str, float]) -> dict:
    """How fragile a paired interval's verdict is: its side of 0 on every seed, and the seeds whose removal alone (one
    at a time) moves it to another side."""
    side = interval_side(list(differences.values()))
    flips = [seed for seed in differences
             if interval_side([d for s, d in differences.items() if s != seed]) != side]  # fmt: skip
    return {"side": side, "flips": sorted(flips, key=int), "seeds": len(differences)}


def ratio_summary(ratios: list[float]) -> dict | None:
    """Median and geometric mean of per-seed ratios (None without any)."""
    if not ratios:
        return None
    geometric = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    return {"median": statistics.median(ratios), "geometric_mean": geometric, "seeds": len(ratios)}


def to_level(runs: dict, base_runs: dict, level: float) -> dict:
    """Fresh rollouts to a fixed held-out success `level`, per seed (None: never reached; seeds whose initial success
    is already at or above it are not scoreable); the median over the scoreable seeds with "never" counted as
    infinite (infinite when at least half never reach it), and the ratio to the baseline's need on the seeds where
    both reach it."""
    need, ratios, not_scoreable = {}, [], []
    for seed, run in runs.items():
        if run["points"][0]["heldout_success"] >= level:
            not_scoreable.append(seed)
            continue
        need[seed] = rollouts_to_reach(*seed_curve(run), level)
        base = base_runs.get(seed)
        base_need = rollouts_to_reach(*seed_curve(base), level) if base is not None else None
        if need[seed] is not None and base_need:
            ratios.append(need[seed] / base_need)
    reached = [v for v in need.values() if v is not None]
    median = statistics.median([math.inf if v is None else v for v in need.values()]) if need else None
    return {"level": level, "need": need, "median": median, "never": len(need) - len(reached),
            "not_scoreable": len(not_scoreable), "ratio": ratio_summary(ratios)}  # fmt: skip


def calibration(runs: dict) -> dict | None:
    """The spread plan's calibration, per seed, then over seeds: each run's mean predicted and observed share of its
    planned fresh groups with spread (over its steps that recorded both), their means over the runs, and the range of
    the runs' gaps (observed - predicted). None where no run recorded the plan's series."""
    per_seed = {}
    for seed, run in runs.items():
        series = zip(run["replay"].get("spread_predicted_fresh", []), run["replay"].get("spread_observed_fresh", []))
        pairs = [(p, o) for p, o in series if p is not None and o is not None]
        if pairs:
            per_seed[seed] = (sum(p for p, _ in pairs) / len(pairs), sum(o for _, o in pairs) / len(pairs))
    if not per_seed:
        return None
    gaps = [o - p for p, o in per_seed.values()]
    return {"predicted": statistics.mean(p for p, _ in per_seed.values()),
            "observed": statistics.mean(o for _, o in per_seed.values()),
            "gap_range": (min(gaps), max(gaps)), "seeds": len(per_seed)}  # fmt: skip


def _mean_of_series(series) -> float | None:
    values = [v for one in series if one for v in one if v is not None]
    return sum(values) / len(values) if values else None


def replays(run: dict) -> bool:
    return run["settings"].get("enable_experience_replay", True) is not False


# The bucket clip (`bucket_clip` in runs_before_fixes.json) counts a difficulty bucket above G as G in the "normal"
# (ExGRPO's Gaussian) bucket weighting: the "normal"-weighted runs made before it whose buckets held a count above G
# ran the case that fix changes.
def normal_weighting(settings: dict) -> bool:
    """Whether a run drew pool tasks by ExGRPO's Gaussian over buckets (`"normal"`; the `exgrpo` profile's)."""
    weighting = settings.get("replay_bucket_weighting")
    return weighting == "normal" or (weighting is None and settings.get("replay_profile") == "exgrpo")


def buckets_above_g(run: dict) -> int:
    """Steps whose recorded difficulty buckets hold a task with more successes than the run's G rollouts a group."""
    g = run["settings"].get("num_generations", 8)
    return sum(any(int(k) > g and v for k, v in b.items()) for b in run["replay"].get("buckets", []))


def summarize(
    entry: dict, baseline: str = "grpo", levels: tuple[float, ...] = (), before_fixes: dict | None = None
) -> list[dict]:
    """One row per method, every comparison per seed against the baseline's run on the same seed: final held-out
    success (and its paired difference, also on the seeds where neither run collapsed), collapses (exact McNemar
    test), the normalised area under the curve over fresh rollouts and over training time, the fresh rollouts to the
    same seed's baseline final and to each of `levels`, zero-spread groups (after replayed rows are inserted, and among
    fresh rollouts only), generation saved, training time per step; and the runs that predate a fix of
    `before_fixes` (`results_file.runs_before_fixes`) in the case it changes (`before_bucket_clip`)."""
    methods = entry["methods"]
    base_runs = methods[baseline]["runs"] if baseline in methods else {}
    aucs = {axis: seed_aucs(methods, key) for axis, key in AXES.items()}
    before_clip = tuple((before_fixes or {}).get("bucket_clip", {}).get("made_at", ()))  # commits made before it
    rows = []
    for name, method in methods.items():
        runs = method["runs"]
        seeds = sorted(runs, key=int)
        shared = [s for s in seeds if s in base_runs]
        finals = {s: runs[s]["points"][-1]["heldout_success"] for s in seeds}
        base_finals = {s: base_runs[s]["points"][-1]["heldout_success"] for s in shared}
        mean = sum(finals.values()) / len(finals)
        std = math.sqrt(sum((f - mean) ** 2 for f in finals.values()) / (len(finals) - 1)) if len(finals) > 1 else 0.0
        fell = {s: collapsed(runs[s]["points"]) for s in seeds}
        base_fell = {s: collapsed(base_runs[s]["points"]) for s in shared}
        steady = [s for s in shared if not fell[s] and not base_fell[s]]
        auc = {}
        for axis in AXES:
            mine, theirs = aucs[axis][name], aucs[axis].get(baseline, {})
            differences = {s: mine[s] - theirs[s] for s in shared if s in mine and s in theirs}
            auc[axis] = {"per_seed": mine, "mean": sum(mine.values()) / len(mine) if mine else None,
                         "paired": paired(list(differences.values())), "leave_one_out": leave_one_out(differences)}  # fmt: skip
        final = {s: to_baseline_final(runs[s], base_runs[s]) for s in shared}
        final_time = {s: to_baseline_final(runs[s], base_runs[s], "wall_s") for s in shared}
        generated = [  # the share of each run's rows that were generated, not replayed
            run["points"][-1]["fresh_rollouts"] / (rows_per_step(run["settings"]) * run["points"][-1]["step"])
            for run in runs.values()
        ]
        after = _mean_of_series(run.get("zero_std_groups") for run in runs.values())
        if not any(replays(run) for run in runs.values()):
            fresh, fresh_source = after, "every group fresh"  # no replayed row: the two shares are one
        else:
            fresh = _mean_of_series(run.get("zero_std_fresh") for run in runs.values())
            fresh_source = "recorded" if fresh is not None else "not recorded"
        early = {s: buckets_above_g(runs[s]) for s in seeds
                 if normal_weighting(runs[s]["settings"]) and runs[s]["run"]["commit"].startswith(before_clip)}  # fmt: skip
        rows.append({
            "method": name, "seeds": seeds, "final_mean": mean, "final_std": std, "final_per_seed": finals,
            "initial_mean": sum(run["points"][0]["heldout_success"] for run in runs.values()) / len(runs),
            "initial_per_seed": {s: runs[s]["points"][0]["heldout_success"] for s in seeds},
            "final": paired([finals[s] - base_finals[s] for s in shared]),
            "final_steady": paired([finals[s] - base_finals[s] for s in steady]),
            "auc_steady": paired([auc["rollouts"]["per_seed"][s] - aucs["rollouts"][baseline][s] for s in steady
                                  if s in auc["rollouts"]["per_seed"] and s in aucs["rollouts"].get(baseline, {})]),
            "collapsed": sum(fell.values()), "collapse_rate": sum(fell.values()) / len(runs),
            "collapsed_shared": sum(fell[s] for s in shared), "baseline_collapsed_shared": sum(base_fell.values()),
            # exact McNemar: the seeds where only one of the pair collapsed (wins: only the baseline did)
            "collapse_test": sign_test([int(base_fell[s]) - int(fell[s]) for s in shared]) if shared else None,
            "auc": auc,
            "to_final": {
                "per_seed": final,
                "ratio": ratio_summary([f["ratio"] for f in final.values() if f["status"] == "reached"]),
                "median_counting_never": median_counting_never(final),
                "never": sum(f["status"] == "never" for f in final.values()),
                "not_scoreable": sum(f["status"] == "not scoreable" for f in final.values()),
            },
            "to_final_time": {
                "median_counting_never": median_counting_never(final_time),
                "never": sum(f["status"] == "never" for f in final_time.values()),
                "reached": sum(f["status"] == "reached" for f in final_time.values()),
            },
            "levels": [to_level(runs, base_runs, level) for level in levels],
            "calibration": calibration(runs),
            "zero_std_groups": after, "zero_std_fresh": fresh, "zero_std_fresh_source": fresh_source,
            "split": {name: _mean_of_series(run.get("split", {}).get(name) for run in runs.values())
                      for name in SPLIT_SERIES},
            "generation_saved": 1 - sum(generated) / len(generated),
            "step_s": sum(run["step_s"] for run in runs.values()) / len(runs),
            "step_ratios": [runs[s]["step_s"] / base_runs[s]["step_s"] for s in shared if base_runs[s]["step_s"] > 0],
            "before_bucket_clip": early,
        })  # fmt: skip
    return rows


def mean_curve_ratio(entry: dict, baseline: str, level: float) -> dict[str, float | None]:
    """Appendix only, not an endpoint: the rollouts at which each method's MEAN curve (averaged over seeds at each
    evaluation point) first reaches `level`, as a ratio to the baseline's mean curve (None: never)."""
    needs = {}
    for name, method in entry["methods"].items():
        xs, ys, _, _ = method_curve(method["runs"])
        needs[name] = rollouts_to_reach(xs, ys, level)
    base = needs.get(baseline)
    return {name: (need / base if need is not None and base else None) for name, need in needs.items()}
