"""Tests for `trl_exreplay.config`: validation of every replay field, `ReplaySettings`, and the settings of the optional
parts (`MultiTurnSettings`, `GuidanceSettings`)."""

from __future__ import annotations

from dataclasses import fields
from typing import get_type_hints

import pytest
from trl import GRPOConfig

from trl_exreplay.config import (
    OWN_FIELDS,
    PROFILE_FIELDS,
    REPLAY_PROFILES,
    ExReplayGRPOConfig,
    ReplaySettings,
    replay_settings,
)
from trl_exreplay.envs.multiturn import MultiTurnSettings
from trl_exreplay.guidance import GuidanceSettings


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


# Every field ExReplayGRPOConfig adds to GRPOConfig, with its value once made (the library's defaults).
DEFAULTS = {
    "enable_experience_replay": True,
    "replay_profile": None,
    "replay_ratio": 0.5,
    "replay_start": "steps",
    "replay_start_ratio": 0.35,
    "replay_start_solved_fraction": None,  # read under replay_start="solved" only
    "replay_retire_solved": False,
    "replay_revisit_ratio": 0.0,
    "replay_rescue": 1,
    "replay_count_replayed_successes": False,
    "replay_unclipped_fresh": False,
    "replay_spread_plan": True,
    "replay_spread_candidates": 4,
    "replay_spread_half_life": 50.0,
    "replay_spread_explore": 0.1,
    "replay_spread_max_groups": 1,
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
    "replay_shaping_beta": None,  # read under replay_shaping="exgrpo" only
    "replay_bucket_weighting": "uniform",
    "replay_max_policy_age": None,
    "task_id_column": "task_id",
    "replay_store_mode": "all",
    "tool_special_tokens": "keep",
    "replay_resume_without_pool": False,
    "replay_scratch_dir": None,
}
MULTI_TURN_DEFAULTS = {
    "max_turns": 10,
    "max_tokens_per_turn": None,
    "env_step_timeout": 60.0,
    "env_workers": 16,
    "env_special_tokens": "remove",
    "system_prompt_column": "system_prompt",
}
GUIDANCE_DEFAULTS = {
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
}


def test_defaults(tmp_path):
    c = make(tmp_path)
    added = {f.name for f in fields(ExReplayGRPOConfig)} - {f.name for f in fields(GRPOConfig)}
    assert added == set(DEFAULTS) == set(OWN_FIELDS), "a field was added or removed: give its default here"
    assert {name: getattr(c, name) for name in DEFAULTS} == DEFAULTS
    assert isinstance(c, GRPOConfig)
    assert {f.name: f.default for f in fields(MultiTurnSettings)} == MULTI_TURN_DEFAULTS
    assert {f.name: f.default for f in fields(GuidanceSettings)} == GUIDANCE_DEFAULTS


def test_our_fields_are_at_most_35():
    """The config's own fields (issue 57: 51 before, the optional parts' settings then moved to the parts: 30; issue
    69's spread plan, a core option, added its five)."""
    assert len(OWN_FIELDS) <= 35


def test_the_exgrpo_profile_gives_exgrpos_recipe_to_the_fields_left_unset(tmp_path):
    c = make(tmp_path, replay_profile="exgrpo")
    assert {name: getattr(c, name) for name in REPLAY_PROFILES["exgrpo"]} == {
        "replay_start": "solved",
        "replay_retire_solved": True,
        "replay_revisit_ratio": 0.0,
        "replay_rescue": 0,
        "replay_spread_plan": False,
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
    # no profile: the library's defaults (revisits at 0.5 only once retirement is turned on), also for a GRPOConfig
    defaults = {**PROFILE_FIELDS, "replay_revisit_ratio": 0.0}
    assert {name: getattr(make(tmp_path), name) for name in PROFILE_FIELDS} == defaults
    settings = replay_settings(make(tmp_path, config_cls=GRPOConfig))
    assert {name: getattr(settings, name) for name in PROFILE_FIELDS} == defaults


def test_the_defaults_plan_spread_and_rescue(tmp_path):
    c = make(tmp_path)
    assert (c.replay_spread_plan, c.replay_rescue, c.replay_retire_solved, c.replay_revisit_ratio) == (
        True,
        1,
        False,
        0,
    )
    assert make(tmp_path, replay_rescue=0).replay_rescue == 0
    # the defaults before the plan (issue 55's `teach`): turning retirement on brings its revisits at 0.5
    teach = make(tmp_path, replay_spread_plan=False, replay_retire_solved=True)
    assert (teach.replay_spread_plan, teach.replay_retire_solved, teach.replay_revisit_ratio) == (False, True, 0.5)
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
            replay_shaping_beta=1e-6,
            replay_max_policy_age=0,
            replay_select_mode="random",
            replay_shaping="exgrpo",
            replay_bucket_weighting="linear",
            replay_store_mode="best",
        ),
        dict(replay_ratio=0.0, replay_start_ratio=1.0, replay_store_lbound=1, replay_store_rbound=3),  # s = 2 stores
        dict(replay_clip_high=0.0, replay_dual_clip_c=1.0, replay_start="solved", replay_start_solved_fraction=0.0),
        dict(replay_select_mode="argmax", replay_bucket_weighting="normal", task_id_column="id"),
    ]
    for values in boundaries:
        c = make(tmp_path, **values)
        assert {name: getattr(c, name) for name in values} == values  # accepted and kept as given


INVALID = [
    ("replay_profile", dict(replay_profile="ExGRPO"), "None, 'exgrpo'"),
    ("replay_spread_plan", dict(replay_spread_plan="yes"), "True or False"),
    ("replay_spread_candidates", dict(replay_spread_candidates=0), "integers >= 1"),
    ("replay_spread_half_life", dict(replay_spread_half_life=float("inf")), "numbers > 0"),
    ("replay_spread_explore", dict(replay_spread_explore=-0.1), "numbers in [0, 1]"),
    ("replay_spread_max_groups", dict(replay_spread_max_groups=1.5), "integers >= 1"),
    ("replay_start", dict(replay_start="capability"), "'steps', 'solved'"),
    (
        "replay_start_solved_fraction",
        dict(replay_start="solved", replay_start_solved_fraction=1.0),
        "numbers in [0, 1)",
    ),
    (
        "replay_start_solved_fraction",
        dict(replay_start="solved", replay_start_solved_fraction="0.35"),
        "numbers in [0, 1)",
    ),
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
    ("replay_shaping_beta", dict(replay_shaping="exgrpo", replay_shaping_beta=0.0), "numbers > 0"),
    ("replay_shaping_beta", dict(replay_shaping="exgrpo", replay_shaping_beta=-1.0), "numbers > 0"),
    ("replay_max_policy_age", dict(replay_max_policy_age=-1), "None or integers >= 0"),
    ("task_id_column", dict(task_id_column=""), "a non-empty column name"),
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
    ("replay_revisit_ratio", dict(replay_revisit_ratio=1.5), "numbers in [0, 1]"),
    (
        "replay_revisit_ratio",
        dict(replay_revisit_ratio=0.5, replay_retire_solved=False),
        "set replay_retire_solved=True",
    ),
    ("replay_rescue", dict(replay_rescue=4), "integers 0 .. num_generations - 1 = 3"),
    ("replay_rescue", dict(replay_rescue=-1), "integers 0 .. num_generations - 1 = 3"),
]

INVALID_PARTS = [
    ("max_turns", dict(max_turns=0), "integers >= 1"),
    ("max_tokens_per_turn", dict(max_tokens_per_turn=0), "None or integers >= 1"),
    ("env_step_timeout", dict(env_step_timeout=0.0), "None or numbers > 0"),
    ("env_workers", dict(env_workers=0), "integers >= 1"),
    ("env_special_tokens", dict(env_special_tokens="strip"), "'remove', 'refuse', 'keep'"),
    ("env_special_tokens", dict(env_special_tokens=None), "'remove', 'refuse', 'keep'"),
    ("max_turns", dict(max_turns=True), "integers >= 1"),
    ("max_tokens_per_turn", dict(max_tokens_per_turn=True), "None or integers >= 1"),
    ("env_workers", dict(env_workers=True), "integers >= 1"),
    ("guidance_train", dict(guidance_train="some"), "'off', 'mixed', 'all'"),
    ("guidance_eval", dict(guidance_eval=None), "'off', 'mixed', 'all'"),
    ("guidance_trained_prompt", dict(guidance_trained_prompt="keep"), "'guided', 'plain', 'hybrid'"),
    ("guidance_ratio", dict(guidance_ratio=1.5), "numbers in [0, 1]"),
    ("guidance_keep_ratio", dict(guidance_keep_ratio=-0.1), "numbers in [0, 1]"),
    ("guidance_template", dict(guidance_template="no slot"), "contain `{}` exactly once"),
    ("guidance_template", dict(guidance_template="{} and {}"), "contain `{}` exactly once"),
    ("guidance_top_k", dict(guidance_top_k=0), "integers >= 1"),
    ("guidance_max_tokens", dict(guidance_max_tokens=0), "integers >= 1"),
    ("guidance_update_freq", dict(guidance_update_freq=-1), "integers >= 0 (0: no updates)"),
    ("guidance_init_from_pool", dict(guidance_init_from_pool="yes"), "True or False"),
    ("system_prompt_column", dict(system_prompt_column=""), "a non-empty column name"),
]


@pytest.mark.parametrize(
    "field, kwargs, allowed", INVALID_PARTS, ids=[f"{f}={list(kw.values())[-1]!r}" for f, kw, _ in INVALID_PARTS]
)
def test_invalid_part_settings_raise_naming_field_and_allowed_values(field, kwargs, allowed):
    cls = GuidanceSettings if field.startswith("guidance_") else MultiTurnSettings
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert f"`{field}`" in message and allowed in message and repr(kwargs[field]) in message


def test_a_mixed_mode_must_guide_a_rollout_of_the_trainers_groups():
    # G = 4: round(4 * 0.1) = 0 guided rollouts
    with pytest.raises(ValueError, match=r"`guidance_ratio`: .*guidance_ratio > 0.125"):
        GuidanceSettings(guidance_train="mixed", guidance_ratio=0.1).check_groups(4)
    GuidanceSettings(guidance_train="mixed", guidance_ratio=0.5).check_groups(4)


IGNORED = [
    ("replay_clip_high", dict(replay_shaping="exgrpo", replay_clip_high=2.0), "replay_shaping='exgrpo'"),
    ("replay_dual_clip_c", dict(replay_profile="exgrpo", replay_dual_clip_c=3.0), "replay_shaping='exgrpo'"),
    ("replay_shaping_beta", dict(replay_shaping_beta=0.2), "replay_shaping='clip'"),
    ("replay_start_ratio", dict(replay_start="solved", replay_start_ratio=0.5), "replay_start='solved'"),
    ("replay_start_solved_fraction", dict(replay_start_solved_fraction=0.5), "replay_start='steps'"),
    (
        "replay_select_by_current_entropy",
        dict(replay_select_mode="random", replay_select_by_current_entropy=True),
        "replay_select_mode='random'",
    ),
]


@pytest.mark.parametrize("field, kwargs, mode", IGNORED, ids=[f for f, _, _ in IGNORED])
def test_a_field_the_chosen_mode_ignores_is_an_error_naming_both(tmp_path, field, kwargs, mode):
    with pytest.raises(ValueError) as info:
        make(tmp_path, **kwargs)
    assert f"`{field}`" in str(info.value) and mode in str(info.value)


@pytest.mark.parametrize(
    "kwargs, mode",
    [(dict(guidance_ratio=0.5), "guidance_train='off'"), (dict(guidance_keep_ratio=0.5), "'plain'")],
)
def test_a_guidance_field_its_mode_ignores_is_an_error_naming_both(kwargs, mode):
    with pytest.raises(ValueError) as info:
        GuidanceSettings(**kwargs)
    assert f"`{next(iter(kwargs))}`" in str(info.value) and mode in str(info.value)


def test_trls_clip_set_under_unclipped_fresh_is_one_warning_naming_both(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="trl_exreplay.config"):
        make(tmp_path, replay_unclipped_fresh=True, epsilon=0.3)
    assert sum("replay_unclipped_fresh" in r.message and "epsilon" in r.message for r in caplog.records) == 1


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


def test_replay_settings_of_replay_config_are_its_fields_frozen(tmp_path):
    c = make(tmp_path, replay_ratio=0.25, replay_select_mode="argmax", replay_max_policy_age=3,
             per_device_train_batch_size=16)  # fmt: skip
    settings = replay_settings(c)
    assert isinstance(settings, ReplaySettings)
    assert {f.name for f in fields(settings)} == set(OWN_FIELDS)
    assert (settings.replay_ratio, settings.replay_select_mode, settings.replay_max_policy_age) == (0.25, "argmax", 3)
    with pytest.raises(AttributeError):
        settings.replay_ratio = 0.5  # frozen
    assert replay_settings(c) is settings  # made once, with the config
    c.replay_ratio = 0.75  # a field changed since: made (and checked) again
    assert replay_settings(c).replay_ratio == 0.75
    c.replay_ratio = 2.0
    with pytest.raises(ValueError, match="`replay_ratio`"):
        replay_settings(c)


def test_a_shaping_registered_at_runtime_can_be_selected(tmp_path, monkeypatch):
    """The config reads the valid `replay_shaping` values from the loss's registry (not a list of its own): a user's
    shaping registered before the config is made is accepted, reaches the loss through the settings, and an unknown
    one is refused naming every registered one."""
    import torch

    from trl_exreplay import loss
    from trl_exreplay.loss import OffPolicyOptions, off_policy_loss

    monkeypatch.setattr(loss, "OFF_POLICY_SHAPINGS", dict(loss.OFF_POLICY_SHAPINGS))  # undone after the test
    with pytest.raises(ValueError, match="`replay_shaping`"):
        make(tmp_path, replay_shaping="reinforce")  # not yet registered

    @loss.register_off_policy_loss("reinforce", registry=loss.OFF_POLICY_SHAPINGS)
    def reinforce(ratio, advantages, logps, raw_log_ratio, replayed_f, options):
        return -advantages * logps, torch.zeros_like(logps, dtype=torch.bool), ratio

    c = make(tmp_path, replay_shaping="reinforce")
    settings = replay_settings(c)
    assert settings.replay_shaping == "reinforce"
    assert (settings.replay_clip_high, settings.replay_shaping_beta) == (None, None)  # the built-ins' own fields
    options = OffPolicyOptions(loss_type="grpo", replay_shaping=settings.replay_shaping)
    logp = torch.tensor([[-1.0, -2.0]])
    per_token, _ = off_policy_loss(logp, logp - 5.0, torch.tensor([2.0]), torch.ones(1, 2), options)
    assert torch.equal(per_token, -2.0 * logp)  # the registered formula, whatever the ratio (e^5 here)

    with pytest.raises(ValueError) as info:
        make(tmp_path, replay_shaping="ppo")
    assert "'ppo'" in str(info.value) and "'clip', 'exgrpo', 'reinforce'" in str(info.value)


def test_replay_settings_declares_exactly_the_configs_own_fields():
    """`ReplaySettings` is written out field by field (for type checkers), so nothing but this test keeps it the
    config's: the same names in the same order, the same annotations and the same defaults."""
    # The annotations resolved: TRL's argument parser replaces a config field's string annotation by its type.
    config_types, settings_types = get_type_hints(ExReplayGRPOConfig), get_type_hints(ReplaySettings)
    own = [f for f in fields(ExReplayGRPOConfig) if f.name in OWN_FIELDS]
    assert [(f.name, settings_types[f.name], f.default) for f in fields(ReplaySettings)] == [
        (f.name, config_types[f.name], f.default) for f in own
    ]
    assert [f.name for f in own] == list(OWN_FIELDS) and len(OWN_FIELDS) == len(DEFAULTS)
    assert ReplaySettings.__dataclass_params__.frozen


def test_replay_settings_of_plain_grpo_config_are_the_defaults(tmp_path):
    settings = replay_settings(make(tmp_path, config_cls=GRPOConfig))
    assert settings == replay_settings(make(tmp_path))


def test_validation_runs_once_per_config(tmp_path, monkeypatch):
    import trl_exreplay.config as config

    calls = []
    original = config._validate
    monkeypatch.setattr(config, "_validate", lambda *a: (calls.append(1), original(*a)))
    c = make(tmp_path)
    replay_settings(c)
    replay_settings(c)
    assert len(calls) == 1


def test_validation_reports_num_generations_bound(tmp_path):
    with pytest.raises(ValueError, match=r"integers 1 \.\. num_generations - 1 = 7"):
        make(tmp_path, num_generations=8, replay_trajectories_per_group=8)
    make(tmp_path, num_generations=8, replay_trajectories_per_group=7, replay_max_trajectories_per_task=7)


def test_the_naming_rule_one_prefix_per_part():
    """The rule docs/config.md states: replay fields are `replay_<what>` (but the switch), guided rollouts' fields
    `guidance_<what>`, the games' fields name the episode, and the data columns end in `_column`."""
    added = set(OWN_FIELDS)
    assert {name for name in added if name.endswith("_column")} == {"task_id_column"}
    assert added - {name for name in added if name.startswith("replay_")} == {
        "enable_experience_replay", "task_id_column", "tool_special_tokens"}  # fmt: skip
    assert all(f.name.startswith("guidance_") for f in fields(GuidanceSettings))
    assert not any(f.name.startswith(("replay_", "guidance_")) for f in fields(MultiTurnSettings))


def test_exgrpos_code_names_are_not_fields(tmp_path):
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
