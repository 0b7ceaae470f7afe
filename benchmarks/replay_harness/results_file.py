"""The results file of the harness: its schema, and reading, validating, writing and merging it.

`DIR/results.json` (merged across calls: a run is keyed by testbed, method and seed, and a later call replaces it; a
call whose testbed settings differ from those of the runs already there is refused):

    {
      "schema": 1,
      "testbeds": {
        "<testbed>": {
          "summary": str, "training": {config fields shared by every method}, "model": {tiny model fields},
          "eval_every": int,
          "rows_per_step": int,                       # completions (episodes) per optimizer step
          "methods": {
            "<method>": {
              "preset": {config fields the method sets (`experience_from_testbed`: the testbed's experience)},
              "runs": {
                "<seed>": {
                  "points": [{"step": int, "fresh_rollouts": int, "heldout_success": float,
                              "train_success": float | null, "wall_s": float}, ...],  # step 0 is the initial model
                  "replay": {"rows_fraction": [float per step], "pool_tasks": [...], "pool_trajectories": [...],
                             "skip_set": [...], "importance_ratio_mean": [...], "policy_age": [...],
                             "buckets": [{successes: tasks} per step],                 # empty without replay
                             "rescued_groups": [...], ...},  # TEACH_SERIES and SPREAD_SERIES, in runs that log them
                  "guidance": {"guided_fraction": [float per step], "success_guided": [float | null], ...},
                                                 # GUIDE_SERIES, only in experience-guided runs
                  "wall_s": float, "step_s": float,   # training time (evaluation excluded), per optimizer step
                  "losses": [float per step], "settings": {every config field this run set},
                  "zero_std_groups": [float per step],  # after rescued and replayed rows are in the groups:
                                 # replay/zero_std_trained (TRL's frac_reward_zero_std before the library kept TRL's
                                 # meaning, and in runs without replay; absent in older runs)
                  "zero_std_fresh": [float | null per step],  # the share of groups whose fresh rollouts alone
                                 # have no reward spread (TRL's frac_reward_zero_std since the library keeps TRL's
                                 # meaning; replay/zero_std_fresh before; null without replay; absent in older runs)
                  "split": {"all_fail_fresh": [...], "all_win_fresh": [...]},  # the fresh groups whose rollouts all
                                 # failed / all won, per step (replay runs since issue 69; absent otherwise)
                  "run": {"command": str, "commit": str, "versions": {...}, "machine": {...}, "date": str,
                          "library": {"path": str, "commit": str}, "load": {"before": float, "after": float}}
                                 # library and load: absent in runs recorded before them
                }
              }
            }
          },
          "trl_check": {"seed": int, "identical": bool, "max_loss_diff": float, "max_point_diff": float, "run": {...}}
        }
      }
    }

`train_success` is the mean total reward of the step's fresh rollouts (their success rate: rewards are 0 or 1 in
these testbeds); `wall_s` in a point is training time so far.

`runs_before_fixes.json`, in a results folder or a folder above it (docs/results/ has one for the committed runs), is
not written by the harness: it names the fixes of the library that committed runs predate, each with the commit of
the fix and the commits (or their prefixes) the runs made before it were made at, so that the report marks them
(`statistics.summarize`, the tables' † notes):

    {"bucket_clip": {"fix": str, "made_at": [str, ...], "what": str}}   # what: the fix, for the reader
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from .presets import PRESETS

SCHEMA = 1
FIXES_FILE = "runs_before_fixes.json"


def rows_per_step(settings: dict) -> int:
    """Completions (episodes) per optimizer step of a one-process run: its batch times its accumulation steps."""
    return settings["per_device_train_batch_size"] * settings.get("gradient_accumulation_steps", 1)


REPLAY_SERIES = ("rows_fraction", "pool_tasks", "pool_trajectories", "skip_set", "importance_ratio_mean", "policy_age")
SPLIT_SERIES = ("all_fail_fresh", "all_win_fresh")  # per step: the fresh groups whose rollouts all failed, all won
# What rescue and retired questions log (their revisits too), per step, in runs that log them (None where a step does
# not: `returned_tasks` only in steps with a revisit).
TEACH_SERIES = ("rescued_groups", "zero_std_rescued", "retired_tasks", "revisited_groups", "returned_tasks")
# The spread plan's (`replay_spread_plan`), per step: the groups it redirected, and the predicted and observed share of
# its planned fresh groups with spread (its calibration; None in a step without planned outcomes). Recorded since
# issue 69's report runs.
SPREAD_SERIES = ("spread_replanned_groups", "spread_predicted_fresh", "spread_observed_fresh")
# The `guide/` metrics of experience-guided runs, per step (None where a step has no value, e.g. no guided row).
GUIDE_SERIES = ("guided_fraction", "discarded_fraction", "records_per_rollout", "success_guided", "success_unguided",
                "store_records", "summarizer_backlog", "summarizer_failures", "retrieve_failures")  # fmt: skip


def load_results(out: Path) -> dict:
    path = out / "results.json"
    if not path.exists():
        return {"schema": SCHEMA, "testbeds": {}}
    results = json.loads(path.read_text())
    validate_results(results)
    return results


POINT_FIELDS = {
    "step": int,
    "fresh_rollouts": int,
    "heldout_success": float,
    "train_success": (float, type(None)),
    "wall_s": float,
}
RUN_FIELDS = {
    "points": list,
    "losses": list,
    "replay": dict,
    "wall_s": float,
    "step_s": float,
    "settings": dict,
    "run": dict,
}

OPTIONAL_SERIES = ("zero_std_groups", "zero_std_fresh")


def validate_results(results: dict) -> None:
    """Raise `ValueError` naming the first field of `results` off the schema (this module's docstring)."""

    def need(value, kind, where):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds:
            kinds = (*kinds, int)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ValueError(f"results.json: {where} is {value!r}, expected {' or '.join(k.__name__ for k in kinds)}")

    need(results.get("schema"), int, "schema")
    if results["schema"] != SCHEMA:
        raise ValueError(f"results.json: schema is {results['schema']}, expected {SCHEMA}")
    need(results.get("testbeds"), dict, "testbeds")
    for name, entry in results["testbeds"].items():
        for key, kind in (("summary", str), ("training", dict), ("eval_every", int), ("rows_per_step", int),
                          ("methods", dict)):  # fmt: skip
            need(entry.get(key), kind, f"testbeds.{name}.{key}")
        for method, method_entry in entry["methods"].items():
            need(method_entry.get("preset"), dict, f"testbeds.{name}.methods.{method}.preset")
            for seed, run in method_entry.get("runs", {}).items():
                where = f"testbeds.{name}.methods.{method}.runs.{seed}"
                for key, kind in RUN_FIELDS.items():
                    need(run.get(key), kind, f"{where}.{key}")
                for key in OPTIONAL_SERIES:  # absent in runs recorded before the series was
                    if key in run:
                        need(run[key], list, f"{where}.{key}")
                for key in ("command", "commit", "versions", "machine", "date"):
                    if key not in run["run"]:
                        raise ValueError(f"results.json: {where}.run.{key} is missing")
                steps = [point.get("step") for point in run["points"]]
                if not steps or steps[0] != 0 or steps != sorted(set(steps)):
                    raise ValueError(f"results.json: {where}.points steps are {steps}, expected 0 first, increasing")
                for i, point in enumerate(run["points"]):
                    for key, kind in POINT_FIELDS.items():
                        need(point.get(key), kind, f"{where}.points[{i}].{key}")
                    if not 0.0 <= point["heldout_success"] <= 1.0:
                        raise ValueError(f"results.json: {where}.points[{i}].heldout_success is out of [0, 1]")
        check = entry.get("trl_check")
        if check is not None:
            need(check.get("identical"), bool, f"testbeds.{name}.trl_check.identical")


def update_results(out: Path, change) -> dict:
    """Apply `change(results)` to `out/results.json` as it is on disk now, and write it back; returns the results.

    Harness calls may run at once (one per core, on the same testbed or not): the read-modify-write holds an exclusive
    lock, and the file is replaced atomically (`write_atomic`, the package's one atomic writer), so a killed run leaves
    the old file or the new.
    """
    import fcntl

    from trl_exreplay.pool.store import write_atomic

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)

    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        results = load_results(out)
        change(results)
        write_atomic(str(out / "results.json"), write)
    return results


def testbed_entry(results: dict, testbed) -> dict:
    """The entry of `testbed` in `results` (created if missing), with its current settings."""
    entry = results["testbeds"].setdefault(testbed.name, {"methods": {}})
    entry.update(
        summary=testbed.summary,
        measure=testbed.measure,
        training={**testbed.training, **testbed.trainer_kwargs()},
        model=testbed.model_kwargs,
        eval_every=testbed.eval_every,
        rows_per_step=rows_per_step(testbed.training),
    )
    return entry


def check_same_settings(out: Path, testbed) -> None:
    """Refuse, before any training, a call whose testbed settings (training fields, model) differ from those of the
    runs already in `out/results.json`: one entry records one set of settings for all its runs."""
    entry = load_results(out)["testbeds"].get(testbed.name)
    if entry is None or not any(m.get("runs") for m in entry["methods"].values()):
        return
    ours = json.loads(json.dumps({"training": {**testbed.training, **testbed.trainer_kwargs()},
                                  "model": testbed.model_kwargs}))  # fmt: skip
    for key, value in ours.items():
        if key in entry and entry[key] != value:
            raise ValueError(
                f"{out / 'results.json'} holds {testbed.name} runs with {key} {entry[key]}, and this call's is {value}: "
                "give it another --out (one results file, one set of settings per testbed)."
            )


def record_run(out: Path, testbed, method: str, seed: int, run: dict) -> dict:
    def change(results):
        method_entry = testbed_entry(results, testbed)["methods"].setdefault(method, {"runs": {}})
        method_entry["preset"] = PRESETS[method]
        method_entry["runs"][str(seed)] = run

    return update_results(out, change)


def merge_results(sources: list[Path], out: Path) -> dict:
    """Merge the runs of the results folders `sources` (e.g. one per seed, made on several machines or cores) into
    `out/results.json`. Refused, before anything is written: a testbed whose settings (training fields, model,
    evaluation) differ between two folders, a method whose preset differs, and one (testbed, method, seed) recorded
    twice with different runs; the same run found twice is kept once."""
    incoming = [(source, load_results(source)) for source in sources]

    def change(results):
        for source, other in incoming:
            for name, theirs in other["testbeds"].items():
                ours = results["testbeds"].get(name)
                if ours is None:
                    results["testbeds"][name] = copy.deepcopy(theirs)
                    continue
                for key in ("training", "model", "eval_every", "rows_per_step"):
                    if ours.get(key) != theirs.get(key):
                        raise ValueError(f"{source}: testbed {name}'s {key} {theirs.get(key)} differs from "
                                         f"{ours.get(key)} in the runs merged before it; merge it into another --out")  # fmt: skip
                if "trl_check" in theirs:
                    ours.setdefault("trl_check", theirs["trl_check"])
                for method, method_entry in theirs["methods"].items():
                    mine = ours["methods"].setdefault(method, {"preset": method_entry["preset"], "runs": {}})
                    if mine["preset"] != method_entry["preset"]:
                        raise ValueError(f"{source}: {name} method {method}'s preset {method_entry['preset']} differs "
                                         f"from {mine['preset']} in the runs merged before it")  # fmt: skip
                    for seed, run in method_entry["runs"].items():
                        if mine["runs"].get(seed, run) != run:
                            raise ValueError(f"{source}: {name} {method} seed {seed} is recorded twice, with "
                                             "different runs; merge only one of them")  # fmt: skip
                        mine["runs"][seed] = run

    return update_results(out, change)


def record_trl_check(out: Path, testbed, check: dict) -> dict:
    return update_results(out, lambda results: testbed_entry(results, testbed).update(trl_check=check))


def runs_before_fixes(out: Path) -> dict:
    """The fixes the runs of the results folder `out` may predate: `runs_before_fixes.json` in `out` or the nearest
    folder above it that has one ({} where none has)."""
    for folder in (out.resolve(), *out.resolve().parents):
        path = folder / FIXES_FILE
        if path.is_file():
            return json.loads(path.read_text())
    return {}
