"""Tests for `trl_exreplay.config`: validation of every replay field, and `replay_options`."""

from __future__ import annotations

from dataclasses import fields

import pytest
from trl import GRPOConfig

from trl_exreplay.config import (
    PROFILE_FIELDS,
    REPLAY_PROFILES,
    ExReplayGRPOConfig,
    replay_options,
    validate_replay_options,
)

REPLAY_FIELDS = {
    "enable_experience_replay",
    "replay_profile",
    "replay_ratio",
    "replay_start",
    "replay_start_ratio",
    "replay_start_solved_fraction",
    "replay_retire_solved",
    "replay_revisit_ratio",
    "replay_rescue",
    "replay_count_replayed_successes",
    "replay_unclipped_fresh",
    "replay_trajectories_per_group",
    "replay_max_trajectories_per_task",
    "replay_store_lbound",
    "replay_store_rbound",
    "replay_success_threshold",
    "replay_select_mode",
    "replay_select_by_current_entropy",
    "replay_importance_sampling",
    "replay_clip_high",
    "replay_dual_clip_c",
    "replay_shaping",
    "replay_shaping_beta",
    "replay_bucket_weighting",
    "replay_max_policy_age",
    "replay_window",
    "task_id_column",
    "replay_store_mode",
    "max_turns",
    "max_tokens_per_turn",
    "env_step_timeout",
    "env_workers",
    "env_special_tokens",
    "tool_special_tokens",
    "replay_resume_without_pool",
    "replay_scratch_dir",
    "system_prompt_column",
    "guidance_train",
    "guidance_eval",
    "guidance_ratio",
    "guidance_trained_prompt",
    "guidance_keep_ratio",
    "guidance_template",
    "guidance_top_k",
    "guidance_max_tokens",
    "guidance_update_freq",
    "guidance_init_from_pool",
    "guidance_provider",
    "guidance_base_url",
    "guidance_timeout",
    "guidance_workspace_id",
}


def make(tmp_path, config_cls=ExReplayGRPOConfig, **kwargs):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        num_generations=4,
        per_device_train_batch_size=8,  # 2 groups: the default replay_ratio 0.5 replays one
        report_to="none",
    )
    return config_cls(**{**base, **kwargs})


# Every field ExReplayGRPOConfig adds to GRPOConfig, with its default (the library's defaults).
DEFAULTS = {
    "enable_experience_replay": True,
    "replay_profile": None,
    "replay_ratio": 0.5,
    "replay_start": "steps",
    "replay_start_ratio": 0.35,
    "replay_start_solved_fraction": 0.35,
    "replay_retire_solved": True,
    "replay_revisit_ratio": 0.5,
    "replay_rescue": 1,
    "replay_count_replayed_successes": False,
    "replay_unclipped_fresh": False,
    "replay_trajectories_per_group": 1,
    "replay_max_trajectories_per_task": 5,
    "replay_store_lbound": 0,
    "replay_store_rbound": None,
    "replay_success_threshold": 1.0,
    "replay_select_mode": "argmin",
    "replay_select_by_current_entropy": True,
    "replay_importance_sampling": True,
    "replay_clip_high": 1.0,
    "replay_dual_clip_c": 3.0,
    "replay_shaping": "clip",
    "replay_shaping_beta": 0.1,
    "replay_bucket_weighting": "uniform",
    "replay_max_policy_age": None,
    "replay_window": None,
    "task_id_column": "task_id",
    "replay_store_mode": "all",
    "max_turns": 10,
    "max_tokens_per_turn": None,
    "env_step_timeout": 60.0,
    "env_workers": 16,
    "env_special_tokens": "remove",
    "tool_special_tokens": "keep",
    "replay_resume_without_pool": False,
    "replay_scratch_dir": None,
    "system_prompt_column": "system_prompt",
    "guidance_train": "off",
    "guidance_eval": "off",
    "guidance_ratio": 0.0,
    "guidance_trained_prompt": "plain",
    "guidance_keep_ratio": 1.0,
    "guidance_template": "\n\nSome Related Experience to help you to complete the task:<EXP>{}</EXP>\n\n",
    "guidance_top_k": 3,
    "guidance_max_tokens": 512,
    "guidance_update_freq": 0,
    "guidance_init_from_pool": False,
    "guidance_provider": "offline",
    "guidance_base_url": None,
    "guidance_timeout": 10.0,
    "guidance_workspace_id": "default",
}


def test_defaults(tmp_path):
    c = make(tmp_path)
    added = {f.name for f in fields(ExReplayGRPOConfig)} - {f.name for f in fields(GRPOConfig)}
    assert added == set(DEFAULTS), "a field was added or removed: give its default here"
    assert {name: getattr(c, name) for name in DEFAULTS} == DEFAULTS
    assert isinstance(c, GRPOConfig)


def test_the_exgrpo_profile_gives_exgrpos_recipe_to_the_fields_left_unset(tmp_path):
    c = make(tmp_path, replay_profile="exgrpo")
    assert {name: getattr(c, name) for name in REPLAY_PROFILES["exgrpo"]} == {
        "replay_start": "solved",
        "replay_retire_solved": True,
        "replay_revisit_ratio": 0.0,
        "replay_rescue": 0,
        "replay_count_replayed_successes": True,
        "replay_unclipped_fresh": True,
        "replay_bucket_weighting": "normal",
        "replay_shaping": "exgrpo",
    }
    assert (c.replay_ratio, c.replay_trajectories_per_group, c.replay_select_mode) == (0.5, 1, "argmin")
    assert (c.replay_start_solved_fraction, c.replay_shaping_beta) == (0.35, 0.1)
    # a field set wins, whatever its value, the library's defaults included
    mine = make(tmp_path, replay_profile="exgrpo", replay_retire_solved=False, replay_bucket_weighting="uniform")
    assert (mine.replay_retire_solved, mine.replay_bucket_weighting) == (False, "uniform")
    assert mine.replay_start == "solved" and mine.replay_shaping == "exgrpo"
    # no profile: the library's defaults, also for a plain GRPOConfig
    assert {name: getattr(make(tmp_path), name) for name in PROFILE_FIELDS} == PROFILE_FIELDS
    assert {name: replay_options(make(tmp_path, config_cls=GRPOConfig))[name] for name in PROFILE_FIELDS} == (
        PROFILE_FIELDS
    )


def test_the_defaults_rescue_and_retire_with_revisits(tmp_path):
    c = make(tmp_path)
    assert (c.replay_rescue, c.replay_retire_solved, c.replay_revisit_ratio) == (1, True, 0.5)
    assert make(tmp_path, replay_rescue=0).replay_rescue == 0
    # turning retirement off turns its revisits off with it (they revisit retired questions), unless they are set
    mine = make(tmp_path, replay_retire_solved=False)
    assert (mine.replay_retire_solved, mine.replay_revisit_ratio, mine.replay_rescue) == (False, 0.0, 1)
    # the defaults before every group taught (the `exreplay` arm of the earlier tests)
    before = make(tmp_path, replay_retire_solved=False, replay_rescue=0)
    assert (before.replay_retire_solved, before.replay_revisit_ratio, before.replay_rescue) == (False, 0.0, 0)


def test_the_profile_is_read_from_yaml_and_flags_as_it_is_from_code(tmp_path):
    from trl import TrlParser

    path = tmp_path / "config.yaml"
    path.write_text("output_dir: out\nuse_cpu: true\nreplay_profile: exgrpo\nreplay_retire_solved: false\n")
    (config,) = TrlParser([ExReplayGRPOConfig]).parse_args_and_config(
        ["--config", str(path), "--replay_unclipped_fresh", "false", "--replay_shaping", "clip"]
    )
    assert (config.replay_retire_solved, config.replay_unclipped_fresh, config.replay_shaping) == (
        False,
        False,
        "clip",
    )
    assert (config.replay_start, config.replay_count_replayed_successes) == ("solved", True)


def test_boundary_values_are_valid(tmp_path):
    boundaries = [
        dict(
            replay_ratio=1.0,
            replay_start_ratio=0.0,
            replay_trajectories_per_group=3,  # G - 1
            replay_max_trajectories_per_task=3,  # == k
            replay_store_lbound=2,  # rbound None = G = 4: s = 3 stores
            replay_clip_high=0.0,
            replay_dual_clip_c=1.0,
            replay_shaping_beta=1e-6,
            replay_max_policy_age=0,
            replay_window=1,
            replay_select_mode="random",
            replay_shaping="exgrpo",
            replay_bucket_weighting="linear",
            replay_store_mode="best",
        ),
        dict(replay_ratio=0.0, replay_start_ratio=1.0, replay_store_lbound=1, replay_store_rbound=3),  # s = 2 stores
        dict(replay_select_mode="argmax", replay_bucket_weighting="normal", task_id_column="id"),
    ]
    for values in boundaries:
        c = make(tmp_path, **values)
        assert {name: getattr(c, name) for name in values} == values  # accepted and kept as given


INVALID = [
    ("replay_profile", dict(replay_profile="ExGRPO"), "None, 'exgrpo'"),
    ("replay_start", dict(replay_start="capability"), "'steps', 'solved'"),
    ("replay_start_solved_fraction", dict(replay_start_solved_fraction=1.0), "numbers in [0, 1)"),
    ("replay_start_solved_fraction", dict(replay_start_solved_fraction="0.35"), "numbers in [0, 1)"),
    ("replay_retire_solved", dict(replay_retire_solved="true"), "True or False"),
    ("replay_count_replayed_successes", dict(replay_count_replayed_successes=1), "True or False"),
    ("replay_unclipped_fresh", dict(replay_unclipped_fresh="yes"), "True or False"),
    ("replay_scratch_dir", dict(replay_scratch_dir=" "), "None or a folder's path"),
    ("replay_scratch_dir", dict(replay_scratch_dir=3), "None or a folder's path"),
    ("replay_ratio", dict(replay_ratio=-0.1), "numbers in [0, 1]"),
    ("replay_ratio", dict(replay_ratio=1.01), "numbers in [0, 1]"),
    ("replay_start_ratio", dict(replay_start_ratio=-0.5), "numbers in [0, 1]"),
    ("replay_start_ratio", dict(replay_start_ratio=2.0), "numbers in [0, 1]"),
    ("replay_trajectories_per_group", dict(replay_trajectories_per_group=0), "integers 1 .. num_generations - 1"),
    ("replay_trajectories_per_group", dict(replay_trajectories_per_group=4), "integers 1 .. num_generations - 1"),
    ("replay_trajectories_per_group", dict(replay_trajectories_per_group=5), "integers 1 .. num_generations - 1"),
    (
        "replay_max_trajectories_per_task",
        dict(replay_max_trajectories_per_task=0),
        "integers >= replay_trajectories_per_group",
    ),
    (
        "replay_max_trajectories_per_task",
        dict(replay_trajectories_per_group=2, replay_max_trajectories_per_task=1),
        "integers >= replay_trajectories_per_group (2)",
    ),
    ("replay_store_lbound", dict(replay_store_lbound=-1), "integers >= 0"),
    ("replay_store_lbound", dict(replay_store_lbound=4), "integers below replay_store_rbound (4"),  # rbound None = G
    (
        "replay_store_lbound",
        dict(replay_store_lbound=2, replay_store_rbound=2),
        "integers below replay_store_rbound (2",
    ),
    (
        "replay_store_lbound",
        dict(replay_store_lbound=3, replay_store_rbound=1),
        "integers below replay_store_rbound (1",
    ),
    ("replay_select_mode", dict(replay_select_mode="median"), "'argmin', 'argmax', 'random'"),
    ("replay_shaping", dict(replay_shaping="ppo"), "'clip', 'exgrpo'"),
    ("replay_bucket_weighting", dict(replay_bucket_weighting="exponential"), "'uniform', 'normal', 'linear'"),
    ("replay_store_mode", dict(replay_store_mode="worst"), "'all', 'best'"),
    ("replay_clip_high", dict(replay_clip_high=-0.1), "numbers >= 0"),
    ("replay_dual_clip_c", dict(replay_dual_clip_c=0.5), "numbers >= 1"),
    ("replay_shaping_beta", dict(replay_shaping_beta=0.0), "numbers > 0"),
    ("replay_shaping_beta", dict(replay_shaping_beta=-1.0), "numbers > 0"),
    ("replay_max_policy_age", dict(replay_max_policy_age=-1), "None or integers >= 0"),
    ("replay_window", dict(replay_window=0), "None or integers >= 1"),
    ("replay_window", dict(replay_window=2.5), "None or integers >= 1"),
    ("replay_window", dict(replay_window=True), "None or integers >= 1"),
    ("task_id_column", dict(task_id_column=""), "a non-empty column name"),
    ("max_turns", dict(max_turns=0), "integers >= 1"),
    ("max_tokens_per_turn", dict(max_tokens_per_turn=0), "None or integers >= 1"),
    ("env_step_timeout", dict(env_step_timeout=0.0), "None or numbers > 0"),
    ("env_workers", dict(env_workers=0), "integers >= 1"),
    ("env_special_tokens", dict(env_special_tokens="strip"), "'remove', 'refuse', 'keep'"),
    ("env_special_tokens", dict(env_special_tokens=None), "'remove', 'refuse', 'keep'"),
    ("tool_special_tokens", dict(tool_special_tokens="refuse"), "'keep', 'remove'"),
    # values that parse but cannot work (issue 24, point 4)
    ("replay_success_threshold", dict(replay_success_threshold=float("nan")), "finite numbers"),
    ("replay_success_threshold", dict(replay_success_threshold=float("inf")), "finite numbers"),
    ("replay_success_threshold", dict(replay_success_threshold="1.0"), "finite numbers"),
    ("replay_success_threshold", dict(replay_success_threshold=True), "finite numbers"),
    ("replay_store_rbound", dict(replay_store_lbound=2, replay_store_rbound=3), "no task can enter the pool"),
    ("replay_store_rbound", dict(replay_store_lbound=0, replay_store_rbound=1), "no task can enter the pool"),
    ("replay_store_lbound", dict(replay_store_lbound=3), "no task can enter the pool"),  # rbound None = G = 4
    ("replay_store_rbound", dict(replay_store_rbound=-1), "None or an integer > replay_store_lbound"),
    ("replay_ratio", dict(replay_ratio=True), "numbers in [0, 1]"),
    ("enable_experience_replay", dict(enable_experience_replay="false"), "True or False"),
    ("replay_select_by_current_entropy", dict(replay_select_by_current_entropy=1), "True or False"),
    ("replay_importance_sampling", dict(replay_importance_sampling="yes"), "True or False"),
    ("replay_trajectories_per_group", dict(replay_trajectories_per_group=True), "integers 1 .."),
    (
        "replay_max_trajectories_per_task",
        dict(replay_max_trajectories_per_task=True),
        "integers >= replay_trajectories_per_group",
    ),
    ("replay_store_lbound", dict(replay_store_lbound=False), "integers >= 0"),
    ("replay_max_policy_age", dict(replay_max_policy_age=True), "None or integers >= 0"),
    ("max_turns", dict(max_turns=True), "integers >= 1"),
    ("max_tokens_per_turn", dict(max_tokens_per_turn=True), "None or integers >= 1"),
    ("env_workers", dict(env_workers=True), "integers >= 1"),
    ("replay_revisit_ratio", dict(replay_revisit_ratio=1.5), "numbers in [0, 1]"),
    (
        "replay_revisit_ratio",
        dict(replay_revisit_ratio=0.5, replay_retire_solved=False),
        "set replay_retire_solved=True",
    ),
    ("replay_rescue", dict(replay_rescue=4), "integers 0 .. num_generations - 1 = 3"),
    ("replay_rescue", dict(replay_rescue=-1), "integers 0 .. num_generations - 1 = 3"),
    ("guidance_train", dict(guidance_train="some"), "'off', 'mixed', 'all'"),
    ("guidance_eval", dict(guidance_eval=None), "'off', 'mixed', 'all'"),
    ("guidance_trained_prompt", dict(guidance_trained_prompt="keep"), "'guided', 'plain', 'hybrid'"),
    ("guidance_ratio", dict(guidance_ratio=1.5), "numbers in [0, 1]"),
    ("guidance_keep_ratio", dict(guidance_keep_ratio=-0.1), "numbers in [0, 1]"),
    # G = 4 in these tests: round(4 * 0.1) = 0 guided rollouts
    ("guidance_ratio", dict(guidance_train="mixed", guidance_ratio=0.1), "guidance_ratio > 0.125"),
    ("guidance_template", dict(guidance_template="no slot"), "contain `{}` exactly once"),
    ("guidance_template", dict(guidance_template="{} and {}"), "contain `{}` exactly once"),
    ("guidance_top_k", dict(guidance_top_k=0), "integers >= 1"),
    ("guidance_max_tokens", dict(guidance_max_tokens=0), "integers >= 1"),
    ("guidance_update_freq", dict(guidance_update_freq=-1), "integers >= 0 (0: no updates)"),
    ("guidance_init_from_pool", dict(guidance_init_from_pool="yes"), "True or False"),
    ("guidance_provider", dict(guidance_provider="remote"), "'offline', 'reme'"),
    ("guidance_base_url", dict(guidance_base_url="ftp://x"), "None or an http:// or https:// URL"),
    (
        "guidance_base_url",
        dict(guidance_train="all", guidance_provider="reme", guidance_base_url=None),
        "URL",
    ),
    ("guidance_timeout", dict(guidance_timeout=0), "numbers of seconds in (0, 86400]"),
    ("guidance_timeout", dict(guidance_timeout=1e10), "numbers of seconds in (0, 86400]"),
    ("guidance_timeout", dict(guidance_timeout=float("inf")), "numbers of seconds in (0, 86400]"),
    ("guidance_workspace_id", dict(guidance_workspace_id=""), "non-empty strings"),
]


@pytest.mark.parametrize(
    "field, kwargs, allowed", INVALID, ids=[f"{f}={list(kw.values())[-1]!r}" for f, kw, _ in INVALID]
)
def test_invalid_value_raises_naming_field_and_allowed_values(tmp_path, field, kwargs, allowed):
    with pytest.raises(ValueError) as info:
        make(tmp_path, **kwargs)
    message = str(info.value)
    assert f"`{field}`" in message
    assert allowed in message
    assert repr(kwargs[field]) in message  # the offending value is shown


def test_replay_options_of_replay_config(tmp_path):
    c = make(tmp_path, replay_ratio=0.25, replay_select_mode="argmax", replay_max_policy_age=3, replay_window=1000,
             per_device_train_batch_size=16)  # fmt: skip
    options = replay_options(c)
    assert set(options) == REPLAY_FIELDS
    assert options["replay_ratio"] == 0.25
    assert options["replay_select_mode"] == "argmax"
    assert options["replay_max_policy_age"] == 3
    assert options["replay_window"] == 1000
    assert options["task_id_column"] == "task_id"


def test_replay_options_of_plain_grpo_config_are_the_defaults(tmp_path):
    c = make(tmp_path, config_cls=GRPOConfig)
    options = replay_options(c)
    assert set(options) == REPLAY_FIELDS
    defaults = replay_options(make(tmp_path))
    assert options == defaults
    validate_replay_options(options, c.num_generations)  # the defaults are valid


def test_validate_without_num_generations(tmp_path):
    options = replay_options(make(tmp_path))
    # without G, k and lbound have no upper bound to check against (rbound None)
    validate_replay_options(
        {**options, "replay_trajectories_per_group": 9, "replay_max_trajectories_per_task": 9}, None
    )
    validate_replay_options({**options, "replay_store_lbound": 50}, None)
    with pytest.raises(ValueError, match="`replay_trajectories_per_group`"):
        validate_replay_options({**options, "replay_trajectories_per_group": 0}, None)
    with pytest.raises(ValueError, match="`replay_store_lbound`"):
        validate_replay_options({**options, "replay_store_lbound": 5, "replay_store_rbound": 5}, None)


def test_validate_reports_num_generations_bound(tmp_path):
    options = replay_options(make(tmp_path))
    with pytest.raises(ValueError, match=r"integers 1 \.\. num_generations - 1 = 7"):
        validate_replay_options({**options, "replay_trajectories_per_group": 8}, 8)
    validate_replay_options({**options, "replay_trajectories_per_group": 7, "replay_max_trajectories_per_task": 7}, 8)


def test_the_naming_rule_one_prefix_per_part():
    """The rule docs/config.md states: replay fields are `replay_<what>` (but the switch), guided rollouts' fields
    `guidance_<what>`, the games' fields name the episode, and the data columns end in `_column`."""
    added = {f.name for f in fields(ExReplayGRPOConfig)} - {f.name for f in fields(GRPOConfig)}
    episode = {"max_turns", "max_tokens_per_turn", "env_step_timeout", "env_workers", "env_special_tokens",
               "tool_special_tokens"}  # fmt: skip
    columns = {name for name in added if name.endswith("_column")}
    assert columns == {"task_id_column", "system_prompt_column"}
    prefixed = {name for name in added if name.startswith(("replay_", "guidance_"))}
    assert added - prefixed - episode - columns == {"enable_experience_replay"}
    assert len({name for name in prefixed if name.startswith("guidance_")}) == 14


def test_the_design_documents_names_are_not_fields(tmp_path):
    """One vocabulary: the names ExGRPO's code uses (`exp_is_correct`, `exp_ratio`, ...) are not fields (docs/config.md
    gives each field's counterpart there), so no value set under one can silently lose to, or beat, the field's own
    value: a YAML file or a command line that uses one fails, naming it."""
    from trl import TrlParser

    config = tmp_path / "config.yaml"
    config.write_text("output_dir: out\nuse_cpu: true\nreport_to: none\nexp_is_correct: false\n")
    with pytest.raises(ValueError, match="exp_is_correct"):
        TrlParser((ExReplayGRPOConfig,)).parse_args_and_config(["--config", str(config)])
    with pytest.raises(ValueError, match="exp_ratio"):
        TrlParser((ExReplayGRPOConfig,)).parse_args_and_config(
            ["--output_dir", "out", "--use_cpu", "true", "--exp_ratio", "0.25"]
        )
    with pytest.raises(TypeError, match="exp_ratio"):
        make(tmp_path, exp_ratio=0.25)


def test_the_config_reference_is_what_the_config_says():
    """docs/config.md is written from the dataclass (`tools/config_reference.py`): a field, default or help text
    changed without rewriting it fails here."""
    from helpers import load_script

    reference = load_script("tools/config_reference.py", "config_reference")
    assert reference.main(["--check"]) == 0, "run python tools/config_reference.py"
    text = (reference.OUTPUT).read_text()
    assert "| `replay_ratio` | `0.5` | ExGRPO `trainer.experience_ratio` |" in text  # the published code's key, mapped
