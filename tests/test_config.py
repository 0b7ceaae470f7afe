"""Tests for `trl_exreplay.config`: validation of every replay field, and `replay_options`."""

from __future__ import annotations

from dataclasses import fields

import pytest
from trl import GRPOConfig

from trl_exreplay.config import ExReplayGRPOConfig, replay_options, validate_replay_options

REPLAY_FIELDS = {
    "enable_experience_replay",
    "exp_ratio",
    "replay_start_ratio",
    "offpolicy_trajectories_per_task",
    "max_trajectories_per_task",
    "experience_lbound",
    "experience_rbound",
    "success_threshold",
    "exp_select_mode",
    "use_current_policy_entropy",
    "exp_is_correct",
    "off_cliprange_high",
    "off_clip_ratio_c",
    "off_policy_shaping",
    "off_policy_shaping_beta",
    "replay_bucket_weighting",
    "max_policy_age",
    "replay_window",
    "task_id_column",
    "pool_store_mode",
    "max_turns",
    "max_tokens_per_turn",
    "env_step_timeout",
    "env_workers",
    "resume_without_pool",
    "system_prompt_column",
}


def make(tmp_path, config_cls=ExReplayGRPOConfig, **kwargs):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        num_generations=4,
        per_device_train_batch_size=8,  # 2 groups: the default exp_ratio 0.5 replays one
        report_to="none",
    )
    return config_cls(**{**base, **kwargs})


# Every field ExReplayGRPOConfig adds to GRPOConfig, with its default (the design documents' values where they give one).
DEFAULTS = {
    "enable_experience_replay": True,
    "exp_ratio": 0.5,
    "replay_start_ratio": 0.35,
    "offpolicy_trajectories_per_task": 1,
    "max_trajectories_per_task": 5,
    "experience_lbound": 0,
    "experience_rbound": None,
    "success_threshold": 1.0,
    "exp_select_mode": "argmin",
    "use_current_policy_entropy": True,
    "exp_is_correct": True,
    "off_cliprange_high": 1.0,
    "off_clip_ratio_c": 3.0,
    "off_policy_shaping": "clip",
    "off_policy_shaping_beta": 0.1,
    "replay_bucket_weighting": "uniform",
    "max_policy_age": None,
    "replay_window": None,
    "task_id_column": "task_id",
    "pool_store_mode": "all",
    "max_turns": 10,
    "max_tokens_per_turn": None,
    "env_step_timeout": 60.0,
    "env_workers": 16,
    "resume_without_pool": False,
    "system_prompt_column": "system_prompt",
}


def test_defaults(tmp_path):
    c = make(tmp_path)
    added = {f.name for f in fields(ExReplayGRPOConfig)} - {f.name for f in fields(GRPOConfig)}
    assert added == set(DEFAULTS), "a field was added or removed: give its default here"
    assert {name: getattr(c, name) for name in DEFAULTS} == DEFAULTS
    assert isinstance(c, GRPOConfig)


def test_boundary_values_are_valid(tmp_path):
    boundaries = [
        dict(
            exp_ratio=1.0,
            replay_start_ratio=0.0,
            offpolicy_trajectories_per_task=3,  # G - 1
            max_trajectories_per_task=3,  # == k
            experience_lbound=2,  # rbound None = G = 4: s = 3 stores
            off_cliprange_high=0.0,
            off_clip_ratio_c=1.0,
            off_policy_shaping_beta=1e-6,
            max_policy_age=0,
            replay_window=1,
            exp_select_mode="random",
            off_policy_shaping="exgrpo",
            replay_bucket_weighting="linear",
            pool_store_mode="best",
        ),
        dict(exp_ratio=0.0, replay_start_ratio=1.0, experience_lbound=1, experience_rbound=3),  # s = 2 stores
        dict(exp_select_mode="argmax", replay_bucket_weighting="normal", task_id_column="id"),
    ]
    for values in boundaries:
        c = make(tmp_path, **values)
        assert {name: getattr(c, name) for name in values} == values  # accepted and kept as given


INVALID = [
    ("exp_ratio", dict(exp_ratio=-0.1), "numbers in [0, 1]"),
    ("exp_ratio", dict(exp_ratio=1.01), "numbers in [0, 1]"),
    ("replay_start_ratio", dict(replay_start_ratio=-0.5), "numbers in [0, 1]"),
    ("replay_start_ratio", dict(replay_start_ratio=2.0), "numbers in [0, 1]"),
    ("offpolicy_trajectories_per_task", dict(offpolicy_trajectories_per_task=0), "integers 1 .. num_generations - 1"),
    ("offpolicy_trajectories_per_task", dict(offpolicy_trajectories_per_task=4), "integers 1 .. num_generations - 1"),
    ("offpolicy_trajectories_per_task", dict(offpolicy_trajectories_per_task=5), "integers 1 .. num_generations - 1"),
    ("max_trajectories_per_task", dict(max_trajectories_per_task=0), "integers >= offpolicy_trajectories_per_task"),
    (
        "max_trajectories_per_task",
        dict(offpolicy_trajectories_per_task=2, max_trajectories_per_task=1),
        "integers >= offpolicy_trajectories_per_task (2)",
    ),
    ("experience_lbound", dict(experience_lbound=-1), "integers >= 0"),
    ("experience_lbound", dict(experience_lbound=4), "integers below experience_rbound (4"),  # rbound None = G
    ("experience_lbound", dict(experience_lbound=2, experience_rbound=2), "integers below experience_rbound (2"),
    ("experience_lbound", dict(experience_lbound=3, experience_rbound=1), "integers below experience_rbound (1"),
    ("exp_select_mode", dict(exp_select_mode="median"), "'argmin', 'argmax', 'random'"),
    ("off_policy_shaping", dict(off_policy_shaping="ppo"), "'clip', 'exgrpo'"),
    ("replay_bucket_weighting", dict(replay_bucket_weighting="exponential"), "'uniform', 'normal', 'linear'"),
    ("pool_store_mode", dict(pool_store_mode="worst"), "'all', 'best'"),
    ("off_cliprange_high", dict(off_cliprange_high=-0.1), "numbers >= 0"),
    ("off_clip_ratio_c", dict(off_clip_ratio_c=0.5), "numbers >= 1"),
    ("off_policy_shaping_beta", dict(off_policy_shaping_beta=0.0), "numbers > 0"),
    ("off_policy_shaping_beta", dict(off_policy_shaping_beta=-1.0), "numbers > 0"),
    ("max_policy_age", dict(max_policy_age=-1), "None or integers >= 0"),
    ("replay_window", dict(replay_window=0), "None or integers >= 1"),
    ("replay_window", dict(replay_window=2.5), "None or integers >= 1"),
    ("replay_window", dict(replay_window=True), "None or integers >= 1"),
    ("task_id_column", dict(task_id_column=""), "a non-empty column name"),
    ("max_turns", dict(max_turns=0), "integers >= 1"),
    ("max_tokens_per_turn", dict(max_tokens_per_turn=0), "None or integers >= 1"),
    ("env_step_timeout", dict(env_step_timeout=0.0), "None or numbers > 0"),
    ("env_workers", dict(env_workers=0), "integers >= 1"),
    # values that parse but cannot work (issue 24, point 4)
    ("success_threshold", dict(success_threshold=float("nan")), "finite numbers"),
    ("success_threshold", dict(success_threshold=float("inf")), "finite numbers"),
    ("success_threshold", dict(success_threshold="1.0"), "finite numbers"),
    ("success_threshold", dict(success_threshold=True), "finite numbers"),
    ("experience_rbound", dict(experience_lbound=2, experience_rbound=3), "no task can enter the pool"),
    ("experience_rbound", dict(experience_lbound=0, experience_rbound=1), "no task can enter the pool"),
    ("experience_lbound", dict(experience_lbound=3), "no task can enter the pool"),  # rbound None = G = 4
    ("experience_rbound", dict(experience_rbound=-1), "None or an integer > experience_lbound"),
    ("exp_ratio", dict(exp_ratio=True), "numbers in [0, 1]"),
    ("enable_experience_replay", dict(enable_experience_replay="false"), "True or False"),
    ("use_current_policy_entropy", dict(use_current_policy_entropy=1), "True or False"),
    ("exp_is_correct", dict(exp_is_correct="yes"), "True or False"),
    ("offpolicy_trajectories_per_task", dict(offpolicy_trajectories_per_task=True), "integers 1 .."),
    ("max_trajectories_per_task", dict(max_trajectories_per_task=True), "integers >= offpolicy"),
    ("experience_lbound", dict(experience_lbound=False), "integers >= 0"),
    ("max_policy_age", dict(max_policy_age=True), "None or integers >= 0"),
    ("max_turns", dict(max_turns=True), "integers >= 1"),
    ("max_tokens_per_turn", dict(max_tokens_per_turn=True), "None or integers >= 1"),
    ("env_workers", dict(env_workers=True), "integers >= 1"),
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
    c = make(tmp_path, exp_ratio=0.25, exp_select_mode="argmax", max_policy_age=3, replay_window=1000,
             per_device_train_batch_size=16)  # fmt: skip
    options = replay_options(c)
    assert set(options) == REPLAY_FIELDS
    assert options["exp_ratio"] == 0.25
    assert options["exp_select_mode"] == "argmax"
    assert options["max_policy_age"] == 3
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
    validate_replay_options({**options, "offpolicy_trajectories_per_task": 9, "max_trajectories_per_task": 9}, None)
    validate_replay_options({**options, "experience_lbound": 50}, None)
    with pytest.raises(ValueError, match="`offpolicy_trajectories_per_task`"):
        validate_replay_options({**options, "offpolicy_trajectories_per_task": 0}, None)
    with pytest.raises(ValueError, match="`experience_lbound`"):
        validate_replay_options({**options, "experience_lbound": 5, "experience_rbound": 5}, None)


def test_validate_reports_num_generations_bound(tmp_path):
    options = replay_options(make(tmp_path))
    with pytest.raises(ValueError, match=r"integers 1 \.\. num_generations - 1 = 7"):
        validate_replay_options({**options, "offpolicy_trajectories_per_task": 8}, 8)
    validate_replay_options({**options, "offpolicy_trajectories_per_task": 7, "max_trajectories_per_task": 7}, 8)
