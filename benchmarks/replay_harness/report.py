"""The report: a testbed's results as markdown tables and notes (`markdown_table`), every figure per seed
(`statistics.summarize`), and the appendix of the ratio read off curves averaged over seeds (`mean_curve_lines`)."""

from __future__ import annotations

import math
import statistics

from replay_testbeds import TESTBEDS

from .results_file import SPLIT_SERIES
from .statistics import collapsed, mean_curve_ratio, method_curve, replays, summarize


def mean_curve_lines(entry: dict, baseline: str, levels: list[str]) -> list[str]:
    """The appendix table of the mean-curve ratio at several levels ("final": the baseline's mean final)."""
    xs, ys, _, _ = method_curve(entry["methods"][baseline]["runs"])
    values = [ys[-1] if level == "final" else float(level) for level in levels]
    names = list(entry["methods"])
    lines = ["", f"Appendix, not an endpoint: fresh rollouts at which the mean curve over seeds first reaches a level, "
             f"as a ratio to {baseline}'s mean curve (the figure the tables used to give, at {baseline}'s mean final; "
             "read per seed above):", "",
             "| level | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for level, value in zip(levels, values):
        ratios = mean_curve_ratio(entry, baseline, value)
        cells = " | ".join("never" if ratios[n] is None else f"{ratios[n]:.2f}x" for n in names)
        label = f"{value:.4f} ({baseline}'s mean final)" if level == "final" else f"{value:.3f}"
        lines.append(f"| {label} | {cells} |")
    return lines


def method_label(name: str, entry_name: str, entry: dict) -> str:
    """A method named by what it ran: on a testbed whose own training fields set replay settings (a recipe's YAML),
    a replay method runs those (with its preset's fields on top), not the library's defaults."""
    method = entry["methods"][name]
    if not replay_fields(entry) or not any(replays(run) for run in method["runs"].values()):
        return name
    what = getattr(TESTBEDS.get(entry_name), "replay_settings", None) or "the testbed's replay settings"
    return f"{name} ({what})" if not method.get("preset") else f"{name} (over {what})"


# The replay fields' names before they were all `replay_*` (runs recorded then keep them).
FORMER_REPLAY_FIELDS = ("exp_", "off_policy", "offpolicy_", "max_trajectories_per_task", "use_current_policy_entropy")


def replay_fields(entry: dict) -> dict:
    """The replay settings the testbed's own training fields set (beside `enable_experience_replay`)."""
    return {k: v for k, v in entry.get("training", {}).items() if k.startswith(("replay_", *FORMER_REPLAY_FIELDS))}


def _cell_name(label: str) -> str:
    """`method` (what it ran): the method's key in code, its label beside."""
    key, _, rest = label.partition(" ")
    return f"`{key}` {rest}" if rest else f"`{key}`"


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def _p(p: float) -> str:
    return f"{p:.2g}"


def _paired_cell(stats: dict | None) -> str:
    if stats is None or stats["interval"] is None:
        return ""
    d, t = stats["interval"], stats["sign"]
    return f"{d['mean']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]; {t['wins']}/{t['losses']}, p = {_p(t['p'])}"


def _ratio_cell(summary: dict | None) -> str:
    return "no seed" if summary is None else f"{summary['median']:.2f}x ({summary['geometric_mean']:.2f}x)"


def _times(value: float | None) -> str:
    return "no seed" if value is None else "never" if math.isinf(value) else f"{value:.2f}x"


def _rollouts(value: float | None) -> str:
    return "never" if value is None or math.isinf(value) else f"{value:,.0f}"


def markdown_table(name: str, entry: dict, baseline: str = "grpo", before_fixes: dict | None = None) -> str:
    """The report of testbed `name`'s results entry against `baseline`: its tables and notes, in markdown. The runs
    that predate a fix of `before_fixes` (`results_file.runs_before_fixes`) are marked †."""
    levels = tuple(getattr(TESTBEDS.get(name), "target_levels", ()))
    rows = summarize(entry, baseline, levels, before_fixes)
    label = {r["method"]: method_label(r["method"], name, entry) for r in rows}
    mark = {r["method"]: " †" if r["before_bucket_clip"] else "" for r in rows}
    b = f"`{baseline}`"
    lines = [
        f"### {name}: {entry['summary']}",
        "",
        f"| method | final (mean ± std) | initial | Δ final vs {b} [95% CI]; sign test | AUC, fresh rollouts "
        f"| Δ AUC vs {b} [95% CI]; sign test | AUC, training time | Δ AUC (time) vs {b} [95% CI]; sign test "
        f"| collapsed (McNemar p vs {b}) | generation saved | s / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        other = r["method"] != baseline
        rollouts, time_ = r["auc"]["rollouts"], r["auc"]["time"]
        test = r["collapse_test"]
        mcnemar = f" (p = {_p(test['p'])})" if other and test is not None else ""
        lines.append(
            f"| {_cell_name(label[r['method']])}{mark[r['method']]} | {r['final_mean']:.3f} ± {r['final_std']:.3f} "
            f"| {r['initial_mean']:.3f} | {_paired_cell(r['final']) if other else ''} | {rollouts['mean']:.3f} "
            f"| {_paired_cell(rollouts['paired']) if other else ''} | {time_['mean']:.3f} "
            f"| {_paired_cell(time_['paired']) if other else ''} | {r['collapsed']} of {len(r['seeds'])}{mcnemar} "
            f"| {100 * r['generation_saved']:.1f}% | {r['step_s']:.2f} |"
        )
    lines += [
        "",
        f"(Per seed, against {b}'s run on the same seed. AUC: held-out success integrated over fresh rollouts (or "
        "training seconds) from 0 to the fewest any method consumed on that seed, divided by it; sign test: seeds "
        "above/below, exact two-sided p; collapsed: ended below half its own best; McNemar: exact, on the seeds where "
        "only one of the two collapsed.)",
        "",
        f"| method | rollouts to {b}'s final on the same seed: median ratio (geometric mean) | reached / never / not "
        "scoreable | median ratio, never counted as never |" + "".join(f" to {level:.2f}: median rollouts; never / not scoreable "
                                  f"| to {level:.2f}: ratio vs {b}, median (geometric mean); seeds |"
                                  for level in levels),
        "|---|---|---|---|" + "---|---|" * len(levels),
    ]  # fmt: skip
    for r in rows:
        f = r["to_final"]
        cells = [_ratio_cell(f["ratio"]), f"{f['ratio']['seeds'] if f['ratio'] else 0} / {f['never']} / "
                 f"{f['not_scoreable']}", _times(f["median_counting_never"])]  # fmt: skip
        for level in r["levels"]:
            cells += [f"{_rollouts(level['median'])}; {level['never']} / {level['not_scoreable']}",
                      f"{_ratio_cell(level['ratio'])}; {level['ratio']['seeds'] if level['ratio'] else 0}"]  # fmt: skip
        lines.append(f"| {_cell_name(label[r['method']])} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"(Ratio: the fresh rollouts a method needs to first reach the target on a seed (linear between evaluation "
        f"points) over those {b} needs on that seed, summarised over the seeds where it reached it; never: seeds "
        "where it did not; not scoreable: seeds where the target is at or below the initial success; never counted "
        "as never: the median over every scoreable seed, a seed that never reached it counted as infinite. A median "
        'is "never" when half the seeds or more never reach the target.)',
    ]
    lines += collapse_lines(rows, baseline)
    lines += leave_one_out_lines(rows, baseline)
    lines += step_time_lines(rows, baseline)
    lines += zero_spread_lines(rows, label)
    lines += per_seed_lines(rows, baseline)
    lines += label_lines(name, entry, rows, label, before_fixes)
    lines += detail_lines(entry)
    lines += run_lines(entry)
    guidance = guidance_lines(entry)
    if guidance:
        lines += ["", *guidance]
    check = entry.get("trl_check")
    if check:
        lines += ["", f"TRL's own `GRPOTrainer`, seed {check['seed']}: identical to `grpo`: **{check['identical']}** "
                      f"(max loss difference {check['max_loss_diff']:.3g}, max held-out difference "
                      f"{check['max_point_diff']:.3g})."]  # fmt: skip
    return "\n".join(lines)


def collapse_lines(rows: list[dict], baseline: str) -> list[str]:
    """Per method, the final difference and the AUC difference (fresh rollouts) to the baseline on every seed and on
    the seeds where neither run collapsed, and the collapses of each on the seeds they share (exact McNemar test)."""
    lines = []
    for r in rows:
        if r["method"] == baseline or r["final"] is None:
            continue
        everything, steady, test = r["final"], r["final_steady"], r["collapse_test"]
        auc, auc_steady = r["auc"]["rollouts"]["paired"], r["auc_steady"]
        n = everything["seeds"]
        cell = (f"- `{r['method']}` - `{baseline}`: final {_paired_cell(everything)}, median {everything['median']:+.3f}; "
                f"AUC {_paired_cell(auc)}, median {auc['median']:+.3f} ({n} seeds); ")  # fmt: skip
        if r["collapsed_shared"] == r["baseline_collapsed_shared"] == 0:
            lines.append(cell + "no run of either collapsed")
            continue
        if steady is None or steady["interval"] is None:
            cell += f"{0 if steady is None else 1} seed where neither collapsed; "
        else:
            cell += (f"on the {steady['seeds']} seeds where neither collapsed: final {_paired_cell(steady)}, median "
                     f"{steady['median']:+.3f}; AUC {_paired_cell(auc_steady)}, median {auc_steady['median']:+.3f}; ")  # fmt: skip
        cell += (f"collapsed: `{r['method']}` {r['collapsed_shared']} of {n}, `{baseline}` "
                 f"{r['baseline_collapsed_shared']} of {n}, exact McNemar p = {_p(test['p'])} ({_seeds(test['wins'])} "
                 f"where only `{baseline}` collapsed, {test['losses']} where only `{r['method']}` did)")  # fmt: skip
        lines.append(cell)
    return ["", "Final success and AUC by collapse (per seed):", *lines] if lines else []


def leave_one_out_lines(rows: list[dict], baseline: str) -> list[str]:
    """Per method, how many single seeds, dropped alone, move the AUC difference's 95% interval (fresh rollouts, and
    training time) to another side of 0: a verdict that one seed can flip is a fragile one."""
    lines = []
    for r in rows:
        if r["method"] == baseline or r["auc"]["rollouts"]["paired"] is None:
            continue
        cells = []
        for axis, label in (("rollouts", "fresh rollouts"), ("time", "training time")):
            loo = r["auc"][axis]["leave_one_out"]
            dropped = f" ({', '.join(loo['flips'])})" if loo["flips"] else ""
            cells.append(f"over {label}, {loo['side']} on {loo['seeds']} seeds; dropping one seed moves it on "
                         f"{len(loo['flips'])} of {loo['seeds']}{dropped}")  # fmt: skip
        lines.append(f"- `{r['method']}` - `{baseline}`: " + "; ".join(cells))
    return ["", "AUC difference's 95% interval, leaving one seed out:", *lines] if lines else []


def step_time_lines(rows: list[dict], baseline: str) -> list[str]:
    """Per method, its seconds per step over the baseline's on the same seed: the median and range over seeds. Read
    only where the runs of a seed shared one machine load (the harness runs a seed's methods back to back)."""
    lines = [f"- `{r['method']}`: median {statistics.median(r['step_ratios']):.2f} (range {min(r['step_ratios']):.2f}-"
             f"{max(r['step_ratios']):.2f}, {len(r['step_ratios'])} seeds)"
             for r in rows if r["method"] != baseline and r["step_ratios"]]  # fmt: skip
    if not lines:
        return []
    to_final = [f"- `{r['method']}`: {_times(r['to_final_time']['median_counting_never'])} "
                f"({r['to_final_time']['reached']} reached, {r['to_final_time']['never']} never)"
                for r in rows if r["method"] != baseline]  # fmt: skip
    return ["", f"Seconds per step over `{baseline}`'s on the same seed:", *lines, "",
            f"Training seconds to `{baseline}`'s final on the same seed over `{baseline}`'s, median counting a seed "
            "that never reaches it as never:", *to_final]  # fmt: skip


def zero_spread_lines(rows: list[dict], label: dict) -> list[str]:
    """Zero-spread groups: after rescued and replayed rows are in the groups, among the fresh rollouts alone, and the
    fresh groups by cause (every rollout failed, or won; recorded by replay runs since issue 69)."""
    if all(r["zero_std_groups"] is None and r["zero_std_fresh"] is None for r in rows):
        return ["", "Zero-spread groups: not recorded by these runs."]
    lines = ["", "| method | zero-spread groups, after rescued and replayed rows are inserted "
             "| zero-spread groups, fresh rollouts only | of the fresh groups: all failed / all won |",
             "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        after = "not recorded" if r["zero_std_groups"] is None else f"{100 * r['zero_std_groups']:.1f}%"
        fresh = {"every group fresh": f"{after} (every group fresh)", "not recorded": "not recorded"}.get(
            r["zero_std_fresh_source"], f"{100 * (r['zero_std_fresh'] or 0):.1f}%"
        )
        fail, win = (r["split"][name] for name in SPLIT_SERIES)
        split = "not recorded" if fail is None or win is None else f"{100 * fail:.1f}% / {100 * win:.1f}%"
        lines.append(f"| {_cell_name(label[r['method']])} | {after} | {fresh} | {split} |")
    calibrated = [f"- `{r['method']}`: predicted {100 * c['predicted']:.1f}%, observed {100 * c['observed']:.1f}% "
                  f"(observed - predicted per seed: {100 * c['gap_range'][0]:+.1f} to {100 * c['gap_range'][1]:+.1f} "
                  f"points; {c['seeds']} seeds)" for r in rows if (c := r["calibration"])]  # fmt: skip
    if calibrated:
        lines += [
            "",
            "The spread plan's calibration: its planned fresh groups with spread, each seed's mean over its steps, "
            "then the mean over seeds:",
            *calibrated,
        ]
    return lines


def per_seed_lines(rows: list[dict], baseline: str) -> list[str]:
    """Every seed: the initial success, and per method the final, the AUC over fresh rollouts and the rollouts to the
    baseline's final (the baseline's own need in rollouts; the others' as a ratio to it)."""
    base = next((r for r in rows if r["method"] == baseline), None)
    if base is None:
        return []
    names = [r["method"] for r in rows]
    lines = ["", f"Per seed: final / AUC over fresh rollouts / rollouts to `{baseline}`'s final on the seed ("
             f"`{baseline}`: its own need; the others: ratio to it; n/s: not scoreable):", "",
             "| seed | initial | " + " | ".join(f"`{n}`" for n in names) + " |", "|---|---|" + "---|" * len(names)]  # fmt: skip
    for seed in base["seeds"]:
        cells = []
        for r in rows:
            if seed not in r["final_per_seed"]:
                cells.append("")
                continue
            f = r["to_final"]["per_seed"].get(seed, {})
            if f.get("status") == "not scoreable":
                need = "n/s"
            elif f.get("status") == "never":
                need = "never"
            elif r["method"] == baseline:
                need = _rollouts(f["baseline_need"])
            else:
                need = f"{f['ratio']:.2f}x"
            auc = r["auc"]["rollouts"]["per_seed"].get(seed)
            cells.append(f"{r['final_per_seed'][seed]:.3f} / {auc:.3f} / {need}")
        initial = base["initial_per_seed"][seed]  # the step-0 point: the same model for every method
        lines.append(f"| {seed} | {initial:.3f} | " + " | ".join(cells) + " |")
    return lines


def label_lines(name: str, entry: dict, rows: list[dict], label: dict, before_fixes: dict | None = None) -> list[str]:
    """What the labels stand for: the replay settings a testbed's own training fields set, and the runs made before
    the bucket clip of `before_fixes` (with how many of their steps held buckets above G)."""
    lines = []
    fields = replay_fields(entry)
    relabelled = [r["method"] for r in rows if label[r["method"]] != r["method"]]
    if fields and relabelled:
        what = getattr(TESTBEDS.get(name), "replay_settings", None) or "the testbed's replay settings"
        settings = ", ".join(f"{k}={v}" for k, v in fields.items())
        lines.append(f"- {what}: the testbed's training fields set {settings}; every replay method here runs over "
                     f"them ({', '.join(f'`{m}`' for m in relabelled)}), so none of them is the library's defaults.")  # fmt: skip
    for r in rows:
        early = r["before_bucket_clip"]
        if not early:
            continue
        steps = ", ".join(f"{seed}: {n}" for seed, n in sorted(early.items(), key=lambda kv: int(kv[0])))
        fix = before_fixes["bucket_clip"]["fix"]  # `early` holds runs only where `before_fixes` names the fix
        lines.append(f"- † `{r['method']}`: {len(early)} of its {len(r['seeds'])} runs were made before {fix}, "
                     "which counts a bucket above G as G in ExGRPO's Gaussian bucket weighting (`\"normal\"`, which "
                     "it uses); steps whose buckets held a count above G, per seed: " + steps + ".")  # fmt: skip
    return ["", *lines] if lines else []


def detail_lines(entry: dict) -> list[str]:
    """Held-out success by part (`heldout_detail`: problem length, doors, split), mean over each method's seeds, from
    the first point to the last: where a method gains or loses."""
    lines = []
    for name, method in entry["methods"].items():
        runs = [run["points"] for run in method["runs"].values() if run["points"][0].get("heldout_detail")]
        if not runs:
            continue
        cells = ", ".join(
            f"{part} {_mean_part(runs, 0, part):.2f} -> {_mean_part(runs, -1, part):.2f}"
            for part in sorted(runs[0][0]["heldout_detail"])
        )
        lines.append(f"- `{name}` ({len(runs)} seeds): {cells}")
    return ["", "Held-out success by part (mean over seeds, first point -> last):", *lines] if lines else []


def run_lines(entry: dict) -> list[str]:
    """Per method, which seeds did what: those that collapsed; with replay, the first step that replayed a row (and the
    seeds on which none did) and the tasks in the skip set at the end; the seeds whose runs recorded zero-spread groups
    (the table's column is over those)."""

    def seeds(values) -> str:
        return ", ".join(sorted(values, key=int)) or "none"

    lines = []
    for name, method in entry["methods"].items():
        runs = method["runs"]
        cells = [f"collapsed: {seeds(s for s, r in runs.items() if collapsed(r['points']))}"]
        series = {s: r["replay"] for s, r in runs.items() if r["replay"].get("rows_fraction")}
        if series:  # the steps are the optimizer steps logged, 1 the first
            first = {
                s: next((i + 1 for i, v in enumerate(r["rows_fraction"]) if v > 0), None) for s, r in series.items()
            }
            started = [step for step in first.values() if step is not None]
            if started:
                cells.append(f"first replayed at step {min(started)}-{max(started)}")
            cells.append(f"never replayed: {seeds(s for s, step in first.items() if step is None)}")
            ends = [r["skip_set"][-1] for r in series.values() if r.get("skip_set")]
            if ends:
                cells.append(f"skip set at the end {min(ends):.0f}-{max(ends):.0f} tasks")
        commits: dict[str, list[str]] = {}
        for s, r in runs.items():
            if "run" in r:
                commits.setdefault(r["run"]["commit"][:7], []).append(s)
        if commits:
            cells.append("made at " + ", ".join(f"{c} ({seed_ranges(ss)})" for c, ss in commits.items()))
        recorded = [s for s, r in runs.items() if r.get("zero_std_groups")]
        if recorded and len(recorded) < len(runs):
            cells.append(f"zero-spread groups recorded on seeds {seed_ranges(recorded)}")
        fresh = [s for s, r in runs.items() if any(v is not None for v in r.get("zero_std_fresh") or [])]
        if fresh and len(fresh) < len(runs):
            cells.append(f"fresh zero-spread groups recorded on seeds {seed_ranges(fresh)}")
        lines.append(f"- `{name}` ({len(runs)} seeds): " + "; ".join(cells))
    return ["", "Runs by seed:", *lines] if lines else []


def seed_ranges(seeds) -> str:
    """Seeds as runs of consecutive numbers: "200-204, 207"."""
    numbers, parts = sorted(int(s) for s in seeds), []
    for n in numbers:
        if parts and n == parts[-1][1] + 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _mean_part(runs: list[list[dict]], index: int, part: str) -> float:
    return sum(points[index]["heldout_detail"][part] for points in runs) / len(runs)


def guidance_lines(entry: dict) -> list[str]:
    """What guidance did in each guided method's runs: the share of rows sampled with experience, the success of
    guided and unguided fresh rollouts over the whole run (pooled over steps, weighted alike), the records retrieved
    per guided rollout and the store's final size (means over seeds)."""

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else float("nan")

    lines = []
    for name, method in entry["methods"].items():
        runs = [run["guidance"] for run in method["runs"].values() if "guidance" in run]
        if not runs:
            continue
        per_seed = [(mean(g["guided_fraction"]), mean(g["success_guided"]), mean(g["success_unguided"]),
                     mean(g["records_per_rollout"]), g["store_records"][-1], g["summarizer_failures"][-1])
                    for g in runs]  # fmt: skip
        fraction, guided, unguided, records, store, failures = (mean(column) for column in zip(*per_seed))
        lines.append(
            f"`{name}` ({len(runs)} seeds): {100 * fraction:.1f}% of rows guided; fresh success {guided:.3f} guided "
            f"vs {unguided:.3f} unguided (run means); {records:.2f} records per guided rollout; {store:.0f} records "
            f"in the store at the end; {failures:.0f} summariser failures."
        )
    return lines
