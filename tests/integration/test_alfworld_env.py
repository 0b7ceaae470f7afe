"""AlfWorldEnv (TextEnv adapter) on the real ALFWorld engine, over generated games laid out like json_2.1.1."""

from __future__ import annotations

import json
import sys

import pytest

from trl_exreplay.alfworld.textenv import parse_action, strip_welcome

pytest.importorskip("alfworld", reason="needs the [alfworld] extra")


def test_parse_action_takes_one_command():
    assert parse_action("Action: Go to Cabinet 1.\nThought: then open it") == "go to cabinet 1"
    assert parse_action("\n\n> take apple 1 from countertop 2") == "take apple 1 from countertop 2"
    assert parse_action("  put   mug 1  in/on  coffeemachine 1 ") == "put mug 1 in/on coffeemachine 1"
    assert parse_action("") == ""
    # ReAct style: the "Action:" line wins wherever it is; "Think:" lines are never actions
    assert parse_action("Think: the mug may be in the cabinet.\nAction: open cabinet 2") == "open cabinet 2"
    assert parse_action("Thought: first look\n> look") == "look"
    assert parse_action("Think: nothing to do") == ""


def test_strip_welcome():
    assert strip_welcome("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle") == "You are in the middle"


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    from trl_exreplay.alfworld import generate_games

    root = tmp_path_factory.mktemp("alfworld")
    report = generate_games(str(root), split="valid_unseen", num_games=2, seed=3, task_types=["pick_and_place_simple"])
    assert report.written == 2
    return root / "json_2.1.1" / "valid_unseen"


def test_tasks_dataset_reads_the_json_2_1_1_layout(games):
    from trl_exreplay.alfworld import alfworld_tasks

    tasks = alfworld_tasks(str(games))
    assert len(tasks) == 2
    assert set(tasks["task_type"]) == {"pick_and_place_simple"}
    for row in tasks:
        assert row["game_file"].endswith("game.tw-pddl") and row["task_id"].count("/") == 1
        assert row["task_id"].startswith("pick_and_place_simple-")
        traj = json.loads(open(row["game_file"].replace("game.tw-pddl", "traj_data.json")).read())
        assert row["goal"] == traj["turk_annotations"]["anns"][0]["task_desc"].rstrip(".")  # what the game states
    assert alfworld_tasks(str(games))["task_id"] == tasks["task_id"]  # stable order


def test_adapter_opening_valid_invalid_and_win(games):
    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

    row = alfworld_tasks(str(games))[0]
    walkthrough = json.loads(open(row["game_file"]).read())["walkthrough"]
    env = AlfWorldEnv(max_steps=50)
    opening = env.reset(row)
    assert opening.startswith("You are in the middle of a room. Looking quickly around you, you see ")
    assert "\n\nYour task is to: put " in opening
    assert "Admissible actions: " in opening and walkthrough[0] in env.admissible_actions()

    observation, reward, done, info = env.step("fly to the moon")
    assert observation.startswith("Nothing happens.") and info["invalid_action"] and (reward, done) == (0.0, False)

    before = env.admissible_actions()
    observation, reward, done, info = env.step(f"Action: {walkthrough[0]}")
    assert observation.startswith("You arrive at ") and not info["invalid_action"]
    assert env.admissible_actions() != before  # the state changed
    for command in walkthrough[1:]:
        observation, reward, done, info = env.step(command)
    assert (reward, done, info["won"]) == (1.0, True, True)

    import fast_downward

    game = json.loads(open(row["game_file"]).read())
    argv = list(sys.argv)
    # a problem text never translated before (so not cached): fast-downward's translator rewrites sys.argv ...
    fast_downward.pddl2sas(game["pddl_domain"], game["pddl_problem"] + "\n; fresh")
    assert sys.argv == argv  # ... and the caller's is given back (TrlParser and friends read it)

    again = env.reset(row)  # same game: no reload, same opening
    assert again == opening and env.steps == 0
    env.close()


def test_max_steps_ends_the_episode(games):
    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

    env = AlfWorldEnv(max_steps=2, show_admissible=False)
    opening = env.reset(alfworld_tasks(str(games))[1])
    assert "Admissible actions" not in opening
    assert env.step("look")[2] is False
    assert env.step("look")[2] is True
    env.close()


def test_invalid_action_penalty_is_taken_off_refused_steps_only(games):
    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

    row = alfworld_tasks(str(games))[0]
    walkthrough = json.loads(open(row["game_file"]).read())["walkthrough"]
    env = AlfWorldEnv(max_steps=50, show_admissible=False, invalid_action_penalty=0.25)
    env.reset(row)
    rewards = [env.step(command)[1] for command in ["fly to the moon", walkthrough[0], "fly to the moon"]]
    rewards += [env.step(command)[1] for command in walkthrough[1:]]
    assert rewards == [-0.25, 0.0, -0.25] + [0.0] * (len(walkthrough) - 2) + [1.0]
    env.close()
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="invalid_action_penalty.*allowed values are finite numbers >= 0"):
            AlfWorldEnv(invalid_action_penalty=bad)


def test_evaluation_walkthrough_scores_100_and_random_is_a_seeded_baseline(games):
    from trl_exreplay.alfworld import random_agent, score_agent
    from trl_exreplay.alfworld.generate import alfworld_version

    expert = score_agent(str(games), None, max_steps=50)
    assert (expert.won, expert.games) == (2, 2)
    assert expert.per_task_type == {"pick_and_place_simple": [2, 2]}
    assert expert.alfworld_version == alfworld_version() == "0.4.2"
    assert "alfworld 0.4.2" in expert.summary() and '"alfworld_version": "0.4.2"' in expert.to_json()

    baseline = score_agent(str(games), random_agent, max_steps=5, seed=0, workers=2)
    again = score_agent(str(games), random_agent, max_steps=5, seed=0, workers=1)
    assert baseline.games == 2 and baseline.success_rate < 1.0  # 5 random steps cannot reach and place an object
    assert (baseline.won, baseline.mean_steps) == (again.won, again.mean_steps)  # seeded, independent of workers
    assert baseline.mean_steps == 5.0


def test_prompt_history_is_bounded(games):
    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

    row = alfworld_tasks(str(games))[0]
    env = AlfWorldEnv(history_length=2, show_admissible=False)
    env.reset(row)
    actions = ["look", "inventory", "fly", "look"]
    for action in actions:
        observation, *_ = env.step(action)
    assert observation.startswith(f"Your task is to: {row['goal']}.\nYou have taken 4 step(s).\n")
    assert "Your last 2 step(s) before this one:\n> inventory\n" in observation
    assert "\n> fly\nNothing happens.\nNow, after > look:\n" in observation
    assert observation.count("\n> ") == 2 and "Admissible" not in observation  # step 1 fell out of the window
    chat = AlfWorldEnv(show_admissible=False)  # history_length=0: the chat transcript is the history
    chat.reset(row)
    assert chat.step("fly")[0] == "Nothing happens."
    reminded = AlfWorldEnv(show_admissible=False, restate_goal=True)
    assert "Your task is to:" in reminded.reset(row)  # the opening states it anyway
    assert reminded.step("fly")[0] == f"Your task is to: {row['goal']}.\nNothing happens."
    reminded.close()
    with pytest.raises(ValueError, match="history_length"):
        AlfWorldEnv(history_length=-1)
    env.close()
    chat.close()


def test_translation_memo_is_bounded_and_keyed_on_inputs():
    from trl_exreplay.alfworld.engine import _TranslationMemo

    calls = []

    def translate(domain, problem, verbose=False, optimize=False):
        calls.append((domain, problem, optimize))
        return object()

    memo = _TranslationMemo(translate, max_entries=2)
    first = memo("d", "p1")
    assert memo("d", "p1") is first and memo("d", "p1", optimize=True) is not first
    memo("d", "p2")  # evicts the oldest entry, ("d", "p1", False)
    assert memo("d", "p1") is not first
    assert calls == [("d", "p1", False), ("d", "p1", True), ("d", "p2", False), ("d", "p1", False)]


def test_text_parse_memo_is_bounded_and_keyed_on_text_and_arguments():
    from trl_exreplay.alfworld.engine import _TextParseMemo

    class Parser:
        calls = []
        semantics = "kept"

        def parse(self, text, rule_name=None, trace=False):
            self.calls.append((text, rule_name, trace))
            return object()

    memo = _TextParseMemo(Parser(), max_entries=2)
    first = memo.parse("take {o}", rule_name="symbols", trace=False)
    assert memo.parse("take {o}", rule_name="symbols", trace=False) is first and memo.hits == 1
    assert memo.parse("take {o}", rule_name="other") is not first
    memo.parse("take {o}", rule_name="symbols", trace=True)  # traced: parsed again, not stored
    memo.parse("look", rule_name="symbols")  # evicts the oldest entry ("take {o}", "symbols")
    assert memo.parse("take {o}", rule_name="symbols", trace=False) is not first
    assert [c[:2] for c in Parser.calls] == [("take {o}", "symbols"), ("take {o}", "other"), ("take {o}", "symbols"),
                                             ("look", "symbols"), ("take {o}", "symbols")]  # fmt: skip
    assert memo.semantics == "kept"


def test_text_parse_memo_changes_nothing_the_engine_says(games, monkeypatch):
    """Episodes (cold loads, then seeded random admissible moves) read the same with textworld's own parsers as
    with the memoized ones, word for word."""
    import random

    import textworld.envs.pddl.logic
    import textworld.logic
    from textworld.envs.pddl import textgen

    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks, engine
    from trl_exreplay.alfworld.engine import _TextParseMemo, install_text_parse_cache

    rows = [dict(row) for row in alfworld_tasks(str(games))]

    def play():
        env, rng, transcript = AlfWorldEnv(max_steps=30, show_admissible=True, game_cache=0), random.Random(0), []
        for row in rows:
            transcript.append(env.reset(row))
            for _ in range(12):
                transcript.append(env.step(rng.choice(env.admissible_actions()))[:3])
        env.close()
        return transcript

    install_text_parse_cache()
    modules = (textgen, textworld.logic, textworld.envs.pddl.logic)
    memos = [module._PARSER for module in modules]
    assert all(isinstance(memo, _TextParseMemo) for memo in memos)
    hits = [memo.hits for memo in memos]
    memoized = play()
    assert all(memo.hits > before for memo, before in zip(memos, hits))  # every memo served this play
    for module, memo in zip(modules, memos):
        monkeypatch.setattr(module, "_PARSER", memo.parser)
    monkeypatch.setattr(engine, "install_text_parse_cache", lambda: None)  # a new engine must not put it back
    assert play() == memoized
    assert not any(isinstance(module._PARSER, _TextParseMemo) for module in modules)


def test_engines_sharing_a_cached_game_play_independently(games):
    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

    row = alfworld_tasks(str(games))[0]
    walkthrough = json.loads(open(row["game_file"]).read())["walkthrough"]
    alone = AlfWorldEnv(game_cache=8)
    transcript = [alone.reset(row)] + [alone.step(c)[:3] for c in walkthrough]
    first, second = AlfWorldEnv(game_cache=8), AlfWorldEnv(game_cache=8)  # the game's translation is shared now
    assert first.reset(row) == second.reset(row) == transcript[0]
    played = [[], []]
    for command in walkthrough:  # interleaved, with a wasted move in between on the second engine
        played[0].append(first.step(command)[:3])
        second.step("look")
        played[1].append(second.step(command)[:3])
    assert played[0] == transcript[1:] and played[1][-1][1:] == (1.0, True)
    for env in (alone, first, second):
        env.close()


def test_engines_in_threads_of_one_process_take_turns(games):
    """textworld's game parser is module-global and not thread-safe: without the engine lock, two threads loading
    games at once fail with IndexError inside tatsu (as `MultiTurnRollout` with several env workers did)."""
    from concurrent.futures import ThreadPoolExecutor

    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks

    rows = [dict(row) for row in alfworld_tasks(str(games))]
    alone = [AlfWorldEnv(game_cache=0).reset(row) for row in rows]
    envs = [AlfWorldEnv(game_cache=0) for _ in range(4)]
    with ThreadPoolExecutor(4) as threads:
        openings = list(threads.map(lambda i: envs[i].reset(rows[i % 2]), range(4)))
        steps = list(threads.map(lambda env: env.step("look")[1:3], envs))
    assert openings == [alone[0], alone[1], alone[0], alone[1]]
    assert steps == [(0.0, False)] * 4
    for env in envs:
        env.close()


def _libdownward_copies() -> int:
    """Distinct copies of fast-downward's library mapped in this process (each engine made loads one)."""
    with open("/proc/self/maps") as f:
        return len({line.split(maxsplit=5)[5] for line in f if "libdownward" in line})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_closed_engines_are_reused_without_leaking_their_game(games):
    from trl_exreplay.alfworld import AlfWorldEnv, alfworld_tasks, random_agent, score_agent

    rows = [dict(row) for row in alfworld_tasks(str(games))]
    walkthrough = json.loads(open(rows[0]["game_file"]).read())["walkthrough"]
    fresh = AlfWorldEnv()
    opening = fresh.reset(rows[0])
    admissible = fresh.admissible_actions()
    fresh.step(walkthrough[0])  # released mid-episode, in a state no reset shows
    fresh.close()
    with pytest.raises(RuntimeError, match="before reset"):
        fresh.step("look")
    copies = _libdownward_copies()
    assert copies >= 1
    for i in range(4):  # each takes the engine the previous one gave back, which holds the other game
        env = AlfWorldEnv()
        first = env.reset(rows[i % 2])
        if i % 2 == 0:  # the game from its start, not where the engine's last user left it
            assert (first, env.admissible_actions()) == (opening, admissible)
        else:
            assert first != opening
        env.step("look")
        env.close()
    assert score_agent(str(games), None, workers=1).won == 2  # in this process: an engine per game, given back
    assert score_agent(str(games), random_agent, max_steps=5, workers=1).games == 2  # an AlfWorldEnv per game
    assert _libdownward_copies() == copies


SHADOWING_SCRIPT = """
{first}
import alfworld
import alfworld.gen.constants as C

from trl_exreplay.alfworld.engine import map_in_pool
from trl_exreplay.alfworld.warmstart import alfworld_entities

if __name__ == "__main__":
    print("main:", alfworld.__file__, len(C.OBJECTS))
    print("workers:", [len(names) for names in map_in_pool(alfworld_entities, [1, 2], workers=2)])
"""


@pytest.mark.parametrize("ours_first", [True, False])
def test_a_script_named_alfworld_does_not_shadow_the_package_in_itself_or_its_workers(tmp_path, ours_first):
    """Python puts a script's folder first on sys.path, so `recipes/alfworld.py` would be imported as the `alfworld`
    package, in the script and in its worker processes (which inherit the path). Once `trl_exreplay.alfworld` is
    imported, `import alfworld` finds the installed package everywhere; before it, the shadow wins (the control)."""
    import subprocess

    import alfworld
    import alfworld.gen.constants as C

    from trl_exreplay.alfworld.warmstart import alfworld_entities

    script = tmp_path / "alfworld.py"
    script.write_text(SHADOWING_SCRIPT.format(first="import trl_exreplay.alfworld" if ours_first else ""))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    if ours_first:
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"main: {alfworld.__file__} {len(C.OBJECTS)}\n" in result.stdout
        assert f"workers: [{len(alfworld_entities(1))}, {len(alfworld_entities(2))}]\n" in result.stdout
    else:
        assert result.returncode != 0 and "'alfworld' is not a package" in result.stderr
