"""Warm start for ALFWorld: the searching expert on the real engine, the word-level vocabulary, and SFT rows laid
out exactly like the trainer's multi-turn rollouts."""

from __future__ import annotations

import pytest

pytest.importorskip("alfworld", reason="needs the [alfworld] extra")

from trl_exreplay.alfworld import ALL_TASK_TYPES  # noqa: E402


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    from trl_exreplay.alfworld import alfworld_tasks, generate_games

    root = tmp_path_factory.mktemp("alfworld")
    for task_type in ALL_TASK_TYPES:
        generate_games(str(root), split="valid_seen", num_games=1, seed=11, task_types=[task_type], workers=1)
    rows = alfworld_tasks(str(root / "json_2.1.1" / "valid_seen"))
    assert sorted(rows["task_type"]) == sorted(ALL_TASK_TYPES)
    return rows


@pytest.fixture(scope="module")
def episodes(tasks):
    from trl_exreplay.alfworld.warmstart import expert_episodes

    return expert_episodes(tasks, workers=2, max_steps=50, show_admissible=False)


def test_search_expert_wins_every_task_type_from_what_it_sees(tasks, episodes):
    import json

    for row, episode in zip(tasks, episodes):
        assert episode.won, (row["task_type"], episode.actions)
        walkthrough = json.loads(open(row["game_file"]).read())["walkthrough"]
        # it searches: it never goes anywhere it was not told of before (the opening or an earlier observation) ...
        for i, action in enumerate(episode.actions):
            if action.startswith("go to "):
                assert action[len("go to ") :] in episode.opening + " ".join(episode.observations[:i]), action
        # ... and ends with the walkthrough's decisive command (put / use), though its path may be longer
        assert episode.actions[-1].split(" ")[0] == walkthrough[-1].split(" ")[0]
        assert len(episode.actions) >= len(walkthrough) - 1


def test_vocabulary_covers_the_games(tasks, episodes):
    import json
    import os
    import subprocess
    import sys

    from trl_exreplay.alfworld import AlfWorldEnv
    from trl_exreplay.alfworld.textenv import INSTRUCTIONS
    from trl_exreplay.alfworld.warmstart import alfworld_tokenizer, alfworld_vocabulary

    vocabulary = alfworld_vocabulary()
    assert vocabulary == sorted(set(vocabulary))
    # another interpreter, with other string hashes (so other set orders), builds the same list, as tokenizers need
    code = "import json, trl_exreplay.alfworld.warmstart as w; print(json.dumps(w.alfworld_vocabulary()))"
    fresh = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": "12345"}, capture_output=True, check=True
    )
    assert json.loads(fresh.stdout) == vocabulary
    texts = [INSTRUCTIONS] + [e.opening for e in episodes] + [t for e in episodes for t in e.observations]
    env = AlfWorldEnv()  # what a policy that is not the expert reads too: the engine's help and its refusal
    env.reset(dict(tasks[0]))
    texts += [env.step("help")[0], env.step("fly to the moon")[0]]
    env.close()
    assert "Available commands" in texts[-2] and "Nothing happens." in texts[-1]
    actions = [a for e in episodes for a in e.actions]
    for tokenizer in (alfworld_tokenizer(), alfworld_tokenizer(entity_tokens=True)):
        for text in texts + actions:
            assert tokenizer.unk_token_id not in tokenizer(text, add_special_tokens=False)["input_ids"], text
        for action in actions:  # what the policy says comes back as the same command
            assert tokenizer.decode(tokenizer(action, add_special_tokens=False)["input_ids"]) == action


def test_entity_tokens_make_each_object_name_one_token(episodes):
    from trl_exreplay.alfworld.warmstart import ENTITY_MAX_NUMBER, alfworld_entities, alfworld_tokenizer

    words, entities = alfworld_tokenizer(), alfworld_tokenizer(entity_tokens=True)
    assert len(entities) == len(words) + len(alfworld_entities())
    assert (
        alfworld_entities()[:2] == ["alarmclock 1", "alarmclock 2"]
        and len(alfworld_entities()) % ENTITY_MAX_NUMBER == 0
    )
    takes = [a for e in episodes for a in e.actions if a.startswith("take ")]  # take <object> from <receptacle>
    assert len(takes) >= len(episodes)  # every task type takes something
    for action in takes:
        _, rest = action.split(" ", 1)
        thing, place = rest.split(" from ")
        assert entities.tokenize(action) == ["take", thing, "from", place]
        assert words.tokenize(action) == ["take", *thing.split(), "from", *place.split()]
    # a number past ENTITY_MAX_NUMBER stays two known tokens
    beyond = str(ENTITY_MAX_NUMBER + 1)
    assert entities.tokenize(f"go to cabinet {beyond}") == ["go", "to", "cabinet", beyond]


def test_play_expert_on_an_alfworld_env_in_a_process_pool(tasks, episodes):
    import functools

    from trl_exreplay.alfworld import AlfWorldEnv
    from trl_exreplay.alfworld.engine import ENGINE_MODULES
    from trl_exreplay.alfworld.expert import play_expert
    from trl_exreplay.envs import EnvProcessPool

    factory = functools.partial(AlfWorldEnv, max_steps=50, show_admissible=False)  # as `episodes` were played
    with EnvProcessPool(factory, workers=1, preload=ENGINE_MODULES) as pool:
        remote = pool()
        assert getattr(remote, "max_steps", None) is None  # an attribute of the env, left in the worker
        episode = play_expert(remote, dict(tasks[0]))  # the step limit falls back to 50
        remote.close()
    assert episode.won and episode.actions == episodes[0].actions


def test_sft_rows_are_the_rollout_layout(tasks, episodes):
    from trl_exreplay.alfworld import AlfWorldEnv
    from trl_exreplay.alfworld.warmstart import alfworld_tokenizer, sft_dataset
    from trl_exreplay.envs.rollout import MultiTurnRollout

    tokenizer = alfworld_tokenizer()
    limits = dict(max_completion_length=4096, max_turns=50, max_tokens_per_turn=16)
    dataset = sft_dataset(episodes, tokenizer, **limits)
    assert dataset["task_id"] == list(tasks["task_id"])  # all won, all fit
    eos = tokenizer.eos_token_id
    for row, episode, task in zip(dataset, episodes, tasks):
        ids, mask = row["input_ids"], row["assistant_masks"]
        trained = [i for i, m in zip(ids, mask) if m]
        expected = []
        for action in episode.actions:
            expected += tokenizer(action, add_special_tokens=False)["input_ids"] + [eos]
        assert trained == expected  # exactly the expert's commands, each closed by the model's eos
        # the same episode played live: the real engine and a policy that says the expert's commands
        actions = iter(episode.actions)
        live = MultiTurnRollout(lambda: AlfWorldEnv(show_admissible=False), tokenizer, step_timeout=None, **limits)

        def say(contexts, max_new_tokens, actions=actions):
            return [tokenizer(next(actions), add_special_tokens=False)["input_ids"] + [eos]]

        (played,) = live.run([dict(task)], say)
        assert played.reward == 1.0
        assert ids == played.prompt_ids + played.completion_ids
        assert mask == [0] * len(played.prompt_ids) + played.env_mask


def test_sft_rows_leave_out_lost_and_oversized_episodes(episodes):
    import dataclasses

    from trl_exreplay.alfworld.warmstart import alfworld_tokenizer, sft_dataset

    tokenizer = alfworld_tokenizer()
    lost = dataclasses.replace(episodes[0], won=False)
    longest = max(episodes, key=lambda e: len(e.actions))
    dataset = sft_dataset([lost, longest], tokenizer, max_completion_length=4096, max_turns=len(longest.actions) - 1)
    assert len(dataset) == 0
    tight = sft_dataset([longest], tokenizer, max_completion_length=64, max_turns=50)  # cut by the token budget
    assert len(tight) == 0
    assert len(sft_dataset([longest], tokenizer, max_completion_length=4096, max_turns=50)) == 1


def test_score_agent_plays_the_expert(tasks, episodes):
    from trl_exreplay.alfworld import score_agent
    from trl_exreplay.alfworld.__main__ import main
    from trl_exreplay.alfworld.agents import EXPERT

    result = score_agent(list(tasks["game_file"]), EXPERT, max_steps=50, workers=1)
    assert (result.agent, result.won, result.games) == ("expert", 6, 6)
    assert result.mean_steps == sum(len(e.actions) for e in episodes) / len(episodes)
    assert result.per_task_type == {task_type: [1, 1] for task_type in ALL_TASK_TYPES}
    with pytest.raises(ValueError, match="agent must be"):
        score_agent(list(tasks["game_file"]), "oracle")
    short = score_agent(list(tasks["game_file"])[:1], EXPERT, max_steps=1)  # one step cannot win any task
    assert (short.won, short.mean_steps) == (0, 1.0)
    assert main(["evaluate", str(tasks["game_file"][0]), "--agent", "expert", "--workers", "1"]) == 0
