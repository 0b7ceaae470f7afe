"""The replay-vs-GRPO harness end to end on its smallest setting: `results.json` follows its schema, every method of a
seed starts from the same model and measures the same held-out draws, fresh rollouts count what was generated, TRL's
own `GRPOTrainer` gives exactly the `grpo` run (the drop-in claim), and the plot and tables are made. No test asserts
that replay wins: that is a measurement (`docs/results.md`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import benchmark_module, load_script


@pytest.fixture(scope="module")
def harness():
    """The command line (`main`), and the names it calls, which tests replace."""
    return load_script("benchmarks/replay_vs_grpo.py", "replay_vs_grpo")


@pytest.fixture(scope="module")
def parts():
    """The harness's parts, by module name."""
    names = ("presets", "runs", "results_file", "statistics", "report")
    return SimpleNamespace(**{name: benchmark_module(f"replay_harness.{name}") for name in names})


def test_harness_writes_results_that_follow_the_schema(harness, parts, tmp_path, capsys, monkeypatch):
    from trl import GRPOTrainer

    # Completions TRL generated, counted where TRL generates them (not from the trainer's own logs).
    generated = []
    trl_generate = GRPOTrainer._generate_single_turn

    def counting(self, prompt_ids, *args, **kwargs):
        generated.append(len(prompt_ids))
        return trl_generate(self, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", counting)
    out = tmp_path / "out"
    argv = ["--testbed", "single-turn", "--methods", "grpo,exreplay", "--seeds", "3", "--max-steps", "4",
            "--out", str(out), "--no-progress", "--set", "replay_start_ratio=0.25"]  # fmt: skip
    harness.main(argv)
    per_run = [sum(generated[i : i + 4]) for i in range(0, len(generated), 4)]  # one generation a step, 4 steps
    results = json.loads((out / "results.json").read_text())
    parts.results_file.validate_results(results)
    entry = results["testbeds"]["single-turn"]
    assert entry["training"]["max_steps"] == 4 and entry["training"]["replay_start_ratio"] == 0.25
    grpo, replay = (entry["methods"][m]["runs"]["3"] for m in ("grpo", "exreplay"))
    assert [p["step"] for p in grpo["points"]] == [0, 4] == [p["step"] for p in replay["points"]]
    # The same initial model and the same held-out draws for every method.
    assert grpo["points"][0]["heldout_success"] == replay["points"][0]["heldout_success"]
    rows = entry["rows_per_step"]
    assert len(generated) == 12  # grpo, TRL's GRPOTrainer (the check on the first seed), exreplay: 4 steps each
    assert per_run[0] == per_run[1] == grpo["points"][-1]["fresh_rollouts"] == 4 * rows  # GRPO generates every row
    assert replay["replay"]["rows_fraction"][0] == 0.0  # before replay's start every row is fresh
    assert max(replay["replay"]["rows_fraction"]) > 0  # and after it some rows are replayed, not generated
    assert replay["points"][-1]["fresh_rollouts"] == per_run[2] < 4 * rows
    assert entry["methods"]["exreplay"]["preset"] == parts.presets.REPLAY_ONLY and replay["settings"]["seed"] == 3
    # TRL's GRPOTrainer on the first seed: every loss and held-out point identical to `grpo`.
    assert entry["trl_check"]["identical"] is True, entry["trl_check"]
    assert entry["trl_check"]["max_loss_diff"] == 0.0
    assert (out / "single-turn.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "| `grpo` | " in table and "identical to `grpo`: **True**" in table
    # `--set replay_start_ratio=0.25` is a replay setting of the testbed's: the replay method is named by it ("over" them:
    # its preset, replay alone, sets fields on top).
    assert "| `exreplay` (over the testbed's replay settings) | " in table and "replay_start_ratio=0.25" in table
    # Each run names the library it imported (a worktree's harness may import another checkout's library), and the
    # machine's load before and after it.
    import trl_exreplay

    for run in (grpo, replay):
        record = run["run"]
        assert record["library"]["path"] == str(Path(trl_exreplay.__file__).resolve().parent)
        assert record["library"]["commit"] == parts.runs.git_commit(Path(trl_exreplay.__file__).parent) != ""
        assert set(record["load"]) == {"before", "after"} and all(v >= 0 for v in record["load"].values())
        assert record["machine"]["cores_allowed"] >= 1
    # One value per step of the fresh rollouts' own zero-spread share (logged by replay runs; None where not logged).
    assert len(replay["zero_std_fresh"]) == 4 == len(grpo["zero_std_fresh"]) == len(replay["zero_std_groups"])
    # The split of the fresh groups that teach nothing, per step: logged by replay, probed for GRPO; for GRPO (every
    # group fresh) the two shares add up to its zero-spread share
    for run in (grpo, replay):
        assert set(run["split"]) == {"all_fail_fresh", "all_win_fresh"} and all(
            len(v) == 4 for v in run["split"].values()
        )
    for fail, win, zero in zip(
        grpo["split"]["all_fail_fresh"], grpo["split"]["all_win_fresh"], grpo["zero_std_groups"]
    ):
        assert fail + win == pytest.approx(zero)

    # A call with another model or other training fields is refused before it trains: one entry, one set of settings.
    assert entry["model"] == {"hidden_size": 64, "num_layers": 2, "num_heads": 4}
    for other in (["--model", "hidden_size=32"], ["--set", "learning_rate=0.1"]):
        with pytest.raises(
            ValueError, match="results.json holds single-turn runs with (model|training) .* another --out"
        ):
            harness.main([*argv[:3], "grpo", "--seeds", "4", *argv[6:], "--no-trl-check", *other])
    assert len(generated) == 12  # nothing trained
    # A second call on another seed merges into the same file; --report rebuilds tables and plots from it alone.
    harness.main([*argv[:3], "grpo", "--seeds", "4", *argv[6:], "--no-trl-check"])
    results = parts.results_file.load_results(out)
    assert sorted(results["testbeds"]["single-turn"]["methods"]["grpo"]["runs"]) == ["3", "4"]
    assert sorted(results["testbeds"]["single-turn"]["methods"]["exreplay"]["runs"]) == ["3"]
    (out / "single-turn.png").unlink()
    harness.main(["--report", "--out", str(out)])
    assert (out / "single-turn.png").exists()


def test_a_results_file_off_the_schema_is_refused_naming_the_field(parts, tmp_path):
    results = {"schema": 1, "testbeds": {"t": {"summary": "s", "training": {}, "eval_every": 1, "rows_per_step": 8,
               "methods": {"grpo": {"preset": {}, "runs": {"0": {
                   "points": [{"step": 0, "fresh_rollouts": 0, "heldout_success": 1.5, "train_success": None,
                               "wall_s": 0.0}],
                   "losses": [], "replay": {}, "wall_s": 0.0, "step_s": 0.0, "settings": {},
                   "run": {"command": "", "commit": "", "versions": {}, "machine": {}, "date": ""}}}}}}}}  # fmt: skip
    with pytest.raises(ValueError, match=r"testbeds\.t\.methods\.grpo\.runs\.0\.points\[0\]\.heldout_success"):
        parts.results_file.validate_results(results)
    (tmp_path / "results.json").write_text(json.dumps({**results, "schema": 0}))
    with pytest.raises(ValueError, match="schema is 0, expected 1"):
        parts.results_file.load_results(tmp_path)


def test_unknown_methods_and_testbeds_are_refused(harness, tmp_path, capsys):
    with pytest.raises(SystemExit):
        harness.main(["--testbed", "single-turn", "--methods", "grpo,ppo", "--out", str(tmp_path)])
    assert "unknown method(s) ppo: allowed values are grpo, exreplay" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        harness.main(["--testbed", "chess", "--out", str(tmp_path)])


def test_the_guided_preset_records_what_guidance_did(harness, parts, tmp_path, capsys):
    out = tmp_path / "out"
    harness.main(["--testbed", "single-turn", "--methods", "exreplay-guided", "--seeds", "3", "--max-steps", "3",
                  "--out", str(out), "--no-progress"])  # fmt: skip
    entry = parts.results_file.load_results(out)["testbeds"]["single-turn"]
    run = entry["methods"]["exreplay-guided"]["runs"]["3"]
    assert entry["methods"]["exreplay-guided"]["preset"] == {**parts.presets.REPLAY_ONLY, **parts.presets.GUIDED}
    assert run["settings"]["guidance_train"] == "mixed"
    guidance = run["guidance"]
    assert set(guidance) == set(parts.results_file.GUIDE_SERIES) and all(len(v) == 3 for v in guidance.values())
    assert guidance["guided_fraction"][0] == 0.0  # nothing to retrieve before the first summaries land
    assert guidance["store_records"][-1] > 0
    assert "`exreplay-guided` (1 seeds):" in capsys.readouterr().out
    harness.main(["--report", "--out", str(out), "--baseline", "exreplay-guided"])
    assert "Δ final vs `exreplay-guided` [95% CI]" in capsys.readouterr().out


def test_the_doors_testbed_gives_guidance_its_vocabulary_can_spell(parts):
    """The default template and summary come out mostly <unk> in the doors game's word-level tokenizer; the testbed's
    own (the `-env` presets) spell every token."""
    from replay_testbeds.multi_turn import VOCABULARY, MultiTurn

    from trl_exreplay import GuidanceSettings
    from trl_exreplay.demo.tiny import build_tiny_tokenizer
    from trl_exreplay.guidance import SummaryInput
    from trl_exreplay.guidance.offline import default_summary
    from trl_exreplay.guidance.template import format_experience

    tokenizer = build_tiny_tokenizer(VOCABULARY)
    won = SummaryInput(
        "r", "r", "you see a red door . goal open the red door", ["take red key", "open red door"], 1.0, 0
    )

    def unknown(template, summary):
        ids = tokenizer(format_experience(template, [summary]), add_special_tokens=False)["input_ids"]
        return sum(i == tokenizer.unk_token_id for i in ids), len(ids)

    default_template = GuidanceSettings.__dataclass_fields__["guidance_template"].default
    assert unknown(default_template, default_summary(won)) == (18, 24)
    testbed = MultiTurn()
    provider = testbed.experience_provider()
    [record] = provider.summarize([won])
    assert record.content == "take red key and open red door"
    assert unknown(testbed.experience_settings["guidance_template"], record.content) == (0, 8)
    assert parts.presets.PRESETS["exreplay-guided-env"]["experience_from_testbed"] is True


def test_the_statistics_of_the_tables(parts):
    """The paired 95% t interval uses Student's t for the seeds' degrees of freedom (20 seeds: 2.093, not 1.96); the
    sign test is the exact two-sided binomial over seeds that differ; a collapse ends below half the run's best."""
    differences = [0.1] * 10 + [0.3] * 10
    interval = parts.statistics.paired_interval(differences)
    half = 2.093 * interval["std"] / 20**0.5
    assert interval["low"] == pytest.approx(0.2 - half) and interval["high"] == pytest.approx(0.2 + half)
    test = parts.statistics.sign_test([1.0] * 12 + [-1.0] * 6 + [0.0] * 2)
    assert (test["wins"], test["losses"], test["ties"]) == (12, 6, 2)
    assert test["p"] == pytest.approx(2 * sum(__import__("math").comb(18, k) for k in range(7)) / 2**18)  # 0.238
    assert parts.statistics.sign_test([-1.0] * 20)["p"] == pytest.approx(2 / 2**20)
    assert parts.statistics.sign_test([0.0, 0.0])["p"] == 1.0
    points = [{"heldout_success": s} for s in (0.4, 0.6, 0.29)]
    collapsed = parts.statistics.collapsed
    assert collapsed(points) and not collapsed(points[:2]) and not collapsed(points[:1])


def test_the_report_gives_held_out_success_by_part(parts):
    def run(first, last):
        return {"points": [{"heldout_detail": first}, {"heldout_detail": last}]}

    entry = {"methods": {"a": {"runs": {"1": run({"x": 0.2, "y": 0.0}, {"x": 0.4, "y": 1.0}),
                                        "2": run({"x": 0.4, "y": 0.0}, {"x": 0.8, "y": 0.0})}}}}  # fmt: skip
    lines = parts.report.detail_lines(entry)
    assert lines[-1] == "- `a` (2 seeds): x 0.30 -> 0.60, y 0.00 -> 0.50"


def test_the_report_says_which_seeds_collapsed_replayed_and_retired(parts):
    def run(successes, rows_fraction=(), skip_set=(), zero=None):
        points = [{"heldout_success": v} for v in successes]
        replay = {"rows_fraction": list(rows_fraction), "skip_set": list(skip_set)}
        return {"points": points, "replay": replay, **({"zero_std_groups": zero} if zero else {})}

    entry = {"methods": {
        "grpo": {"runs": {"1": run((0.0, 0.4, 0.1)), "2": run((0.0, 0.2, 0.2))}},
        "exgrpo": {"runs": {"1": run((0.0, 0.3, 0.3), (0, 0, 0.5, 0.5), (0, 2, 5), zero=[1.0]),
                            "2": run((0.0, 0.0, 0.0), (0, 0, 0, 0), (0, 0, 1)),
                            "10": run((0.0, 0.6, 0.2), (0, 0.25, 0, 0), (1, 3, 4), zero=[0.5])}},
    }}  # fmt: skip
    assert parts.report.run_lines(entry) == [
        "",
        "Runs by seed:",
        "- `grpo` (2 seeds): collapsed: 1",
        "- `exgrpo` (3 seeds): collapsed: 10; first replayed at step 2-3; never replayed: 2; skip set at the end 1-5 "
        "tasks; zero-spread groups recorded on seeds 1, 10",
    ]


def _results(runs: dict, training: dict | None = None, preset: dict | None = None) -> dict:
    """A results file of testbed "t" with `runs` {method: {seed: final held-out success}}."""

    def run(final):
        return {"points": [{"step": 0, "fresh_rollouts": 0, "heldout_success": 0.0, "train_success": None,
                            "wall_s": 0.0},
                           {"step": 1, "fresh_rollouts": 8, "heldout_success": final, "train_success": None,
                            "wall_s": 1.0}],
                "losses": [0.0], "replay": {"rows_fraction": []}, "wall_s": 1.0, "step_s": 1.0, "settings": {"per_device_train_batch_size": 8},
                "run": {"command": "", "commit": "", "versions": {}, "machine": {}, "date": ""}}  # fmt: skip

    methods = {
        m: {"preset": preset or {}, "runs": {str(s): run(v) for s, v in seeds.items()}} for m, seeds in runs.items()
    }
    return {"schema": 1, "testbeds": {"t": {"summary": "s", "training": training or {"learning_rate": 1.0},
                                            "model": {}, "eval_every": 1, "rows_per_step": 8, "methods": methods}}}  # fmt: skip


def test_merge_joins_per_seed_folders_and_refuses_runs_that_disagree(harness, parts, tmp_path, capsys):
    """`--merge` is the committed way per-seed folders (one per core or machine) become one results file."""
    folders = []
    for name, runs in {"a": {"grpo": {1: 0.5}, "teach": {1: 0.6}}, "b": {"grpo": {2: 0.4}, "teach": {2: 0.3}},
                       "again": {"grpo": {1: 0.5}}}.items():  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(_results(runs)))
        folders.append(tmp_path / name)
    out = tmp_path / "merged"
    harness.main(["--merge", *map(str, folders), "--out", str(out)])
    merged = parts.results_file.load_results(out)["testbeds"]["t"]["methods"]
    assert {m: {s: r["points"][-1]["heldout_success"] for s, r in e["runs"].items()} for m, e in merged.items()} == {
        "grpo": {"1": 0.5, "2": 0.4}, "teach": {"1": 0.6, "2": 0.3}}  # fmt: skip
    assert "| `teach` |" in capsys.readouterr().out  # the report of the merged folder
    before = (out / "results.json").read_bytes()
    conflicts = {
        "same seed, another run": (_results({"grpo": {2: 0.9}}), "t grpo seed 2 is recorded twice"),
        "other settings": (_results({"grpo": {3: 0.9}}, training={"learning_rate": 2.0}), "learning_rate"),
        "other preset": (_results({"teach": {3: 0.9}}, preset={"replay_rescue": 0}), "preset"),
    }
    for case, (results, message) in conflicts.items():
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "results.json").write_text(json.dumps(results))
        with pytest.raises(ValueError, match=message):
            harness.main(["--merge", str(tmp_path / "bad"), "--out", str(out)])
        assert (out / "results.json").read_bytes() == before, case  # nothing written


def test_the_methods_of_a_seed_run_back_to_back_in_turning_order(harness, tmp_path, monkeypatch):
    ran = []

    class Testbed:
        name, trl_comparable = "t", False

        def build(self, seed):
            return None

        def close(self):
            pass

    monkeypatch.setitem(harness.TESTBEDS, "t", Testbed)
    monkeypatch.setattr(harness, "check_same_settings", lambda out, testbed: None)
    monkeypatch.setattr(harness, "train_one", lambda testbed, method, seed, initial, **kw: ran.append((seed, method)))
    monkeypatch.setattr(harness, "record_run", lambda *args: {"testbeds": {"t": {}}})
    monkeypatch.setattr(harness, "plot", lambda *args: None)
    monkeypatch.setattr(harness, "markdown_table", lambda *args: "")
    monkeypatch.setattr(harness, "parse_args", lambda argv: __import__("argparse").Namespace(
        report=False, merge=None, testbed="t", set=None, model=None, max_steps=None, methods=["a", "b", "c"],
        seeds=[1, 2, 3, 4], progress=False, trl_check=False, out=tmp_path))  # fmt: skip
    harness.main([])
    assert ran == [(1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a"), (3, "c"), (3, "a"), (3, "b"),
                   (4, "a"), (4, "b"), (4, "c")]  # fmt: skip
