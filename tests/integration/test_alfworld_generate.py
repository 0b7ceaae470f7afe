"""Offline ALFWorld game generator: reproducibility, walkthroughs winning on the real engine, splits, CLI.

Needs alfworld 0.4.2 + textworld[pddl]; skipped without them. Engine work is slow (1-9 s per game on one core),
so few games are generated and verification runs on two processes.
"""

import hashlib
import json
import os

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from trl_exreplay.alfworld import (  # noqa: E402
    ALL_TASK_TYPES,
    SPLIT_SCENES,
    TRAIN_SCENES,
    VALID_UNSEEN_SCENES,
    generate_games,
    play_walkthroughs,
)
from trl_exreplay.alfworld.__main__ import main  # noqa: E402
from trl_exreplay.alfworld.textenv import goal_of  # noqa: E402

SEED = 3
WORKERS = 2


def _tree(root):
    """{relative path: bytes} of every file under root."""
    files = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def _traj(game_file):
    with open(os.path.join(os.path.dirname(game_file), "traj_data.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def train_games(tmp_path_factory):
    out = tmp_path_factory.mktemp("alfworld_train")
    report = generate_games(out, "train", len(ALL_TASK_TYPES), SEED, workers=WORKERS)
    return out, report


def test_one_verified_game_per_task_type(train_games):
    out, report = train_games
    assert report.written == report.requested == 6 and report.failed == 0
    assert report.by_task_type == {t: 1 for t in ALL_TASK_TYPES}
    assert sorted(_traj(f)["task_type"] for f in report.game_files) == sorted(ALL_TASK_TYPES)
    for f in report.game_files:
        assert f.startswith(os.path.join(str(out), "json_2.1.1", "train") + os.sep)
        with open(f) as fh:
            game = json.load(fh)
        assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
        assert game["solvable"] is True and game["walkthrough"]
        assert "UNKNOWN GOAL" not in game["grammar"]
        traj = _traj(f)
        assert set(traj["pddl_params"]) >= {
            "object_target",
            "parent_target",
            "toggle_target",
            "mrecep_target",
            "object_sliced",
        }
        assert traj["scene"]["scene_num"] in TRAIN_SCENES
    # classic wording by default
    pick = next(f for f in report.game_files if _traj(f)["task_type"] == "pick_and_place_simple")
    with open(pick) as fh:
        assert json.load(fh)["walkthrough"][-1].startswith("put ")


def test_generation_is_byte_identical(train_games, tmp_path):
    out, _ = train_games
    again = generate_games(tmp_path, "train", len(ALL_TASK_TYPES), SEED, workers=WORKERS)
    assert again.written == 6
    first, second = _tree(out), _tree(tmp_path)
    assert len(first) == 12 and first == second
    # another seed, or another split on the same scenes, gives other games
    other = generate_games(tmp_path / "other", "train", 2, SEED + 1, verify=False)
    seen = generate_games(tmp_path / "seen", "valid_seen", 2, SEED, verify=False)
    for report in (other, seen):
        for f in report.game_files:
            with open(f, "rb") as fh:
                assert fh.read() not in first.values()


def test_walkthroughs_win_and_games_do_not_start_won(train_games):
    out, _ = train_games
    results = play_walkthroughs(out, workers=WORKERS)
    assert len(results) == 6
    for r in results:
        assert r.won_at_start is False, r
        assert r.won and r.error is None, r


def test_valid_unseen_scenes_are_never_used_in_train(tmp_path):
    assert set(SPLIT_SCENES["valid_unseen"]) == set(VALID_UNSEEN_SCENES) == {10, 219, 308, 424}
    assert not set(SPLIT_SCENES["train"]) & set(SPLIT_SCENES["valid_unseen"])
    assert set(SPLIT_SCENES["valid_seen"]) == set(SPLIT_SCENES["train"])
    unseen = generate_games(tmp_path / "u", "valid_unseen", 12, 0, verify=False)
    train = generate_games(tmp_path / "t", "train", 24, 0, verify=False)
    unseen_scenes = {_traj(f)["scene"]["scene_num"] for f in unseen.game_files}
    train_scenes = {_traj(f)["scene"]["scene_num"] for f in train.game_files}
    assert unseen.written == 12 and unseen_scenes <= set(VALID_UNSEEN_SCENES)
    assert train.written == 24 and train_scenes <= set(TRAIN_SCENES)
    assert not unseen_scenes & train_scenes


def test_cli_generate_and_play_walkthroughs(tmp_path, capsys):
    out = str(tmp_path / "cli")
    rc = main(
        [
            "generate",
            "--out",
            out,
            "--split",
            "valid_unseen",
            "--num-games",
            "2",
            "--seed",
            "1",
            "--task-types",
            "look_at_obj_in_light",
            "pick_two_obj_and_place",
            "--workers",
            str(WORKERS),
        ]
    )
    assert rc == 0
    assert "wrote 2 of 2 valid_unseen games" in capsys.readouterr().out
    rc = main(["play-walkthroughs", out, "--workers", str(WORKERS)])
    assert rc == 0
    assert "2 won of 2" in capsys.readouterr().out


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError):
        generate_games(tmp_path, "test", 1, 0)
    with pytest.raises(ValueError):
        generate_games(tmp_path, "train", 1, 0, task_types=["pick_and_place_with_movable_recep"])


# ------------------------------------------------------------------------------------------------------------------
# Task choice weighted by ALFRED's (object, receptacle) pair counts
# ------------------------------------------------------------------------------------------------------------------
def _alfred_table():
    """The package's pair table, read here directly (not through the code under test)."""
    from trl_exreplay.alfworld import generate

    with open(os.path.join(os.path.dirname(generate.__file__), "alfred_pairs.json"), encoding="utf-8") as f:
        return json.load(f)


def test_alfred_pair_table_is_well_formed():
    table = _alfred_table()
    assert "oct21.json" in table["source"] and "train" in table["source"]
    counts = table["counts"]
    assert sorted(counts) == sorted(ALL_TASK_TYPES)
    for task_type, pairs in counts.items():
        assert sum(pairs.values()) > 500, task_type  # hundreds of ALFRED train trials per task type
        for pair, n in pairs.items():
            obj, parent = pair.split("|")
            assert "Sliced" not in obj and isinstance(n, int) and n > 0
            if task_type == "look_at_obj_in_light":
                assert parent in ("DeskLamp", "FloorLamp")
            else:
                assert parent not in ("DeskLamp", "FloorLamp")
    # deterministic bytes: sorted keys, as tools/alfred_pair_counts.py writes it
    assert list(counts) == sorted(counts) and all(list(p) == sorted(p) for p in counts.values())


def test_pair_weights_are_alfred_counts_plus_prior():
    import alfworld.gen.constants as C

    from trl_exreplay.alfworld.generate import pair_weights

    counts = _alfred_table()["counts"]
    for task_type in ALL_TASK_TYPES:
        table = counts[task_type]
        frequent = max(sorted(table), key=lambda p: table[p])
        if task_type == "look_at_obj_in_light":
            hosts = {lamp: set(C.VAL_RECEPTACLE_OBJECTS["Desk"]) for lamp in ("DeskLamp", "FloorLamp")}
        else:
            hosts = C.VAL_RECEPTACLE_OBJECTS
        unseen = next(
            f"{o}|{r}"
            for r in sorted(hosts)
            for o in sorted(hosts[r])
            if f"{o}|{r}" not in table and "Sliced" not in o
        )
        pairs = [tuple(frequent.split("|")), tuple(unseen.split("|"))]
        w_frequent, w_unseen = pair_weights(task_type, pairs)
        assert w_frequent == table[frequent] + 0.5  # ALFRED's count plus the prior of an unseen pair
        assert w_unseen == 0.5
        assert w_frequent > 10 * w_unseen
        assert pair_weights(task_type, []) == []
    with pytest.raises(ValueError):
        pair_weights("pick_and_place_with_movable_recep", [("Apple", "Plate")])


def _sampled_pairs(task_type, scenes, seeds):
    """Counter of "Object|Parent" drawn by the generator's task sampler on fixed scenes (no engine)."""
    import random
    from collections import Counter

    from trl_exreplay.alfworld import generate

    drawn = Counter()
    for scene_num in scenes:
        scene = generate._load_scene(scene_num, random.Random(scene_num))
        for seed in range(seeds):
            obj, parent, lamp = generate._sample_task(task_type, scene, random.Random(seed))
            drawn[f"{obj}|{parent or lamp}"] += 1
    return drawn


def test_sampled_pairs_follow_alfred_counts(monkeypatch):
    import alfworld.gen.constants as C

    from trl_exreplay.alfworld import generate
    from trl_exreplay.alfworld.splits import room_type

    counts = _alfred_table()["counts"]
    lamp_scenes = {s for s in TRAIN_SCENES if {"DeskLamp", "FloorLamp"} & generate._layout(s)[1]}
    for task_type in ALL_TASK_TYPES:
        table = counts[task_type]
        scenes = [s for s in sorted(TRAIN_SCENES) if room_type(s) in C.GOALS_VALID[task_type]]
        if task_type == "look_at_obj_in_light":
            scenes = [s for s in scenes if s in lamp_scenes]
        scenes = scenes[:: max(1, len(scenes) // 4)][:4]
        weighted = _sampled_pairs(task_type, scenes, 100)
        with monkeypatch.context() as m:  # control: the same valid pairs, drawn uniformly
            m.setattr(generate, "pair_weights", lambda _t, pairs: [1.0] * len(pairs))
            uniform = _sampled_pairs(task_type, scenes, 100)
        n = sum(weighted.values())
        top_alfred = sorted(table, key=lambda p: (-table[p], p))[:10]
        assert weighted.most_common(1)[0][0] in top_alfred, (task_type, weighted.most_common(3))
        for pair in weighted:  # weighting never leaves the valid pairs
            obj, parent = pair.split("|")
            if task_type == "look_at_obj_in_light":
                assert parent in ("DeskLamp", "FloorLamp"), pair
            else:
                assert obj in C.VAL_RECEPTACLE_OBJECTS[parent], pair
        unseen = sum(k for p, k in weighted.items() if p not in table) / n
        unseen_uniform = sum(k for p, k in uniform.items() if p not in table) / n
        assert unseen < 0.2 and (unseen_uniform == 0 or unseen < 0.5 * unseen_uniform), (
            task_type,
            unseen,
            unseen_uniform,
        )
        # frequent ALFRED pairs are drawn more often than under the uniform control
        alfred_mass = sum(k * table.get(p, 0) for p, k in weighted.items()) / n
        alfred_mass_uniform = sum(k * table.get(p, 0) for p, k in uniform.items()) / n
        assert alfred_mass > 1.3 * alfred_mass_uniform, (task_type, alfred_mass, alfred_mass_uniform)


def test_scenes_restrict_the_floor_plans(tmp_path):
    from trl_exreplay.alfworld.splits import room_type

    bedrooms = [s for s in TRAIN_SCENES if room_type(s) == "Bedroom"][:2]
    report = generate_games(tmp_path, "train", 8, 0, ["pick_and_place_simple"], verify=False, scenes=bedrooms)
    assert report.written == 8 and {_traj(f)["scene"]["scene_num"] for f in report.game_files} == set(bedrooms)
    with pytest.raises(ValueError, match=r"`scenes`.*valid_unseen floor plans \[10, 219, 308, 424\]"):
        generate_games(tmp_path, "valid_unseen", 1, 0, scenes=bedrooms)
    with pytest.raises(ValueError, match="pick_heat_then_place_in_recep"):  # no microwave in a bedroom
        generate_games(tmp_path, "train", 1, 0, ["pick_heat_then_place_in_recep"], scenes=bedrooms)


def test_target_objects_restrict_what_tasks_ask_for(tmp_path):
    from trl_exreplay.alfworld.splits import room_type

    bedrooms = [s for s in TRAIN_SCENES if room_type(s) == "Bedroom"][:2]
    free = generate_games(tmp_path / "any", "train", 12, 0, [1, 2], verify=False, scenes=bedrooms)
    report = generate_games(
        tmp_path / "few", "train", 12, 0, [1, 2], verify=False, scenes=bedrooms, target_objects=["book", "CD"]
    )
    wanted = {_traj(f)["pddl_params"]["object_target"] for f in report.game_files}
    anything = {_traj(f)["pddl_params"]["object_target"] for f in free.game_files}
    assert report.written == 12 and wanted <= {"Book", "CD"} and len(anything - {"Book", "CD"}) >= 2
    # the goal the game states names the object too
    assert all(any(o in goal_of(f) for o in ("book", "cd")) for f in report.game_files)
    with pytest.raises(ValueError, match=r"Invalid value \['Bookk'\] for `target_objects`: .*AlarmClock, .*CD, "):
        generate_games(tmp_path, "train", 1, 0, target_objects=["Bookk"])


def test_a_seeds_games_stay_those_every_earlier_version_generated(tmp_path):
    """Seed 3's first train game, byte for byte, as generated since the generator was first written: a change to the
    draws' salt or to the files' contents (a module's move renamed both once) changes every game of every seed."""
    generate_games(tmp_path, "train", 1, SEED, workers=1, verify=False)
    digest = hashlib.sha256()
    for path, data in sorted(_tree(tmp_path).items()):
        digest.update(path.encode())
        digest.update(data)
    assert digest.hexdigest() == "70a81938c4ab97db019eba844fd1f5eade1815773abcb03f2d97a1af778b6d74"
