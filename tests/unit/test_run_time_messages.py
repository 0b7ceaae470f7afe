"""What a new user is told once at run time: where task ids come from, and the fallbacks to a prompt hash; what replay
changes in the run, with its settings; a launch that runs fewer processes than it was asked for."""

import logging

from trl_exreplay import ExReplayGRPOConfig
from trl_exreplay.config import replay_settings
from trl_exreplay.distributed import launch_shortfall
from trl_exreplay.metrics import FaultCounts
from trl_exreplay.replay import ReplayController, say_task_id_source


def test_the_task_id_source_and_its_fallbacks_are_said(caplog):
    with caplog.at_level(logging.WARNING, logger="trl_exreplay"):
        say_task_id_source([{"prompt": "a", "task_id": 1}], "task_id")
        say_task_id_source([{"prompt": "a", "taskid": 1}], "task_id")  # misspelled: the columns are listed
        say_task_id_source([{"prompt": "a", "task_id": 1}, {"prompt": "b", "task_id": None}], "task_id")
    first, second, third = (record.getMessage() for record in caplog.records)
    assert "task ids from the dataset's 'task_id' column" in first
    assert "no 'task_id' column" in second and "['prompt', 'taskid']" in second and "hash of its prompt" in second
    assert "1 of the first batch's 2 rows have no 'task_id' value" in third


def _controller(tmp_path, **fields) -> ReplayController:
    """The replay side of a run with these config fields, made as the trainer makes it, without a trainer: what it
    says needs only the settings, the dataset and TRL's beta."""
    args = ExReplayGRPOConfig(output_dir=str(tmp_path), use_cpu=True, num_generations=8, report_to="none", **fields)
    return ReplayController(
        replay_settings(args), None, args=args, accelerator=None, num_generations=8, train_dataset=[{"prompt": "a"}],
        policy_forward=None, faults=FaultCounts(),
    )  # fmt: skip


def test_what_replay_changes_is_said_for_the_settings_in_force(tmp_path):
    defaults = _controller(tmp_path).what_replay_changes(max_steps=24)
    assert "From step 1: an all-fail group gets 1 stored success of its task" in defaults
    assert "the batch's groups go to the tasks most likely to have a reward spread" in defaults
    assert "retire" not in defaults.split("GRPOTrainer exactly")[0]
    assert "From step 10 of 24 (replay_start_ratio=0.35): 50% of the groups train on 1 stored success" in defaults
    assert defaults.endswith("GRPOTrainer until replay starts: replay_rescue=0, replay_spread_plan=False.")
    teach = _controller(tmp_path, replay_spread_plan=False, replay_retire_solved=True).what_replay_changes(24)
    assert "50% of its draws coming back as revisits" in teach
    assert teach.endswith("GRPOTrainer until replay starts: replay_rescue=0, replay_retire_solved=False.")
    # 0.35 of 20 steps is step 7 exactly (7 / 20 >= 0.35, although 0.35 * 20 rounds above 7): the eighth, counted from 1
    assert "From step 8 of 20" in _controller(tmp_path).what_replay_changes(max_steps=20)
    replay_only = _controller(tmp_path, replay_rescue=0, replay_spread_plan=False, replay_start_ratio=1.0)
    said = replay_only.what_replay_changes(max_steps=10)
    assert "From step 1" not in said and "Nothing is replayed within max_steps=10 (replay_start_ratio=1)" in said
    assert said.endswith("GRPOTrainer exactly: enable_experience_replay=False.")
    exgrpo = _controller(tmp_path, replay_profile="exgrpo").what_replay_changes(max_steps=10)
    assert "an all-fail group" not in exgrpo and "leaves the fresh stream, for good" in exgrpo
    assert "succeed more than 35% of the time (replay_start='solved')" in exgrpo
    assert "fresh tokens without TRL's clip (replay_unclipped_fresh)" in exgrpo
    # TRL's KL term turns rescue off (with a warning of its own): the line does not claim it
    assert "an all-fail group" not in _controller(tmp_path, beta=0.04).what_replay_changes(max_steps=10)
    assert "2 stored successes of its task in place of its last failed rollouts (replay_rescue=2)" in _controller(
        tmp_path, replay_rescue=2
    ).what_replay_changes(max_steps=10)
    both = _controller(tmp_path, replay_retire_solved=True).what_replay_changes(max_steps=10)
    assert "the batch's groups go to the tasks most likely to have a reward spread" in both
    assert "(replay_spread_plan=True, 10% of the groups kept as drawn)" in both
    assert both.endswith("replay_rescue=0, replay_retire_solved=False, replay_spread_plan=False.")
    assert "reward spread" not in teach


# What `accelerate launch` (1.15) puts in a process's environment, seen from the process it starts on a CPU machine.
LAUNCHER = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False"}
SIMPLE_LAUNCH_OF_2 = {**LAUNCHER, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # --num_processes 2, MULTI_CPU
TORCH_LAUNCH_OF_2 = {**SIMPLE_LAUNCH_OF_2, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}  # --multi_gpu


def test_a_launch_that_runs_fewer_processes_than_asked_is_told_apart():
    parent = {"PATH": "/bin"}  # the launcher's own environment: no MASTER_ADDR
    assert "asked for more than one process" in launch_shortfall(SIMPLE_LAUNCH_OF_2, 1, parent)
    assert launch_shortfall(TORCH_LAUNCH_OF_2, 2, parent) is None  # two processes, as asked
    assert "one of WORLD_SIZE=2 processes but runs as 1" in launch_shortfall(TORCH_LAUNCH_OF_2, 1, parent)
    assert launch_shortfall(LAUNCHER, 1, parent) is None  # a launch of one process
    assert launch_shortfall({}, 1, None) is None  # python script.py
    # a MASTER_ADDR the user exported is the launcher's too: not a sign of a launch of several
    assert launch_shortfall(SIMPLE_LAUNCH_OF_2, 1, {"MASTER_ADDR": "127.0.0.1"}) is None
    assert launch_shortfall(SIMPLE_LAUNCH_OF_2, 1, None) is None  # the parent's environment unreadable: not said
