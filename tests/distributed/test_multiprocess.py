"""Two real processes (gloo) under `accelerate launch`: DDP (as two machines) and DeepSpeed ZeRO-2/3 on CPU, replay active."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import REPOSITORY
from launching import accelerate_launch, accelerate_launch_machines

SCRIPT = REPOSITORY / "tests" / "scripts" / "replay_multiprocess.py"


def check_rank_identical(ranks: list[dict]) -> None:
    """The same plans, losses and pool index on both ranks; rank 0 alone holds the pool's rows."""
    rank0, rank1 = ranks
    assert rank0["world_size"] == rank1["world_size"] == 2
    assert rank0["pool_hash"] == rank1["pool_hash"]  # the index: what is stored, evicted and replayable
    assert rank0["pool_content_hash"] is not None and rank1["pool_content_hash"] is None
    assert rank1["pool_scratch"] is None and rank1["pool_storage"] == {}
    assert rank0["pool_trajectories"] > 0
    assert rank0["plans"] == rank1["plans"]
    assert rank0["losses"] == rank1["losses"]
    assert any(rank0["replay_tasks"])


def check_guided_allocations(ranks: list[dict]) -> None:
    """Experience-guided rollouts over 2 ranks: the same allocation drawn on both for every generation batch (3 groups
    of G=4 over 12 rows, group 1 spanning both ranks), with AgentEvolver's counts; the same store on both."""
    rank0, rank1 = ranks
    assert rank0["allocations"] == rank1["allocations"]
    training = [a for a in rank0["allocations"] if len(a["guided"]) == 12]
    evaluation = [a for a in rank0["allocations"] if len(a["guided"]) == 4]  # 2 rows a rank: one group of 4
    assert len(training) == 6 and evaluation and all(all(a["guided"]) for a in evaluation)
    for step, allocation in enumerate(training):
        assert sum(allocation["keep"]) == int(3 * 0.5)  # keep_count = int(tasks * guidance_keep_ratio)
        per_group = [sum(allocation["guided"][g * 4 : g * 4 + 4]) for g in range(3)]
        # round(4 * 0.5) = 2 per task; once replay starts (step 2) a replayed row is never guided
        assert per_group == [2, 2, 2] if step < 2 else all(count in (1, 2) for count in per_group), per_group
    assert rank0["experience"] == rank1["experience"] and rank0["experience"]  # added at the same step on both
    assert rank0["guided_fraction"] == rank1["guided_fraction"] and max(rank0["guided_fraction"]) > 0
    assert max(rank0["discarded_fraction"]) > 0  # discarded rows' behaviour forward ran in lockstep


# Each configuration once where its risk lies, in 8 launches (DeepSpeed ZeRO-2 also starts in test_launching.py):
# - ZeRO-3 (parameters really partitioned, so any forward or generation out of lockstep hangs): the exgrpo profile,
#   rescue with retired questions (`teach`) and the defaults (rescue and the spread plan), resumed; guided rollouts
#   with TRL options whose replayed term is collective; multi-turn lockstep. One launch trains the runs one after the
#   other, a second resumes the first three.
# - ZeRO-2: `teach`, resumed, with and without the checkpoint's RNG states (the two resumes in one launch).
# - DDP: the defaults as they are on one machine, resumed; two machines on loopback, with shards written while
#   training and an alternating share of replay, resumed.
# A launch's startup (imports, DeepSpeed's initialisation: ~20 s here) costs more than these runs' training (~6 s).
# tests/integration covers the one-process paths.
ZERO3 = "recipes/accelerate/zero3_cpu.yaml"
ZERO2 = "recipes/accelerate/zero2_cpu.yaml"
DDP = "recipes/accelerate/ddp_cpu.yaml"


def launch_runs(config: str, runs: dict[str, list[str]]) -> dict[str, list[dict]]:
    """One launch training `runs` (out dir -> script options) one after the other; each run's two rank records."""
    arguments = []
    for out_dir, options in runs.items():
        if arguments:
            arguments.append("then")
        arguments += [out_dir, *options]
    accelerate_launch(config, SCRIPT, *arguments)
    return {out_dir: [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(2)] for out_dir in runs}


@pytest.fixture(scope="module")
def zero3_root(tmp_path_factory) -> Path:
    """The ZeRO-3 runs' folder: one folder a run, each with its rank records and `run/` (checkpoints)."""
    return tmp_path_factory.mktemp("zero3")


@pytest.fixture(scope="module")
def zero3(zero3_root) -> dict[str, list[dict]]:
    """The five ZeRO-3 runs, trained in one launch."""
    root = zero3_root
    runs = {
        "exgrpo": ["exgrpo"],
        "teach": ["teach"],
        "spread": ["defaults", "spread"],
        "guided": ["trl-options", "guided"],
        "multi-turn": ["multi-turn"],
    }
    ranks = launch_runs(ZERO3, {str(root / name): options for name, options in runs.items()})
    return {name: ranks[str(root / name)] for name in runs}


@pytest.fixture(scope="module")
def zero3_resumed(zero3, zero3_root) -> dict[str, list[dict]]:
    """The exgrpo, default and spread-plan runs resumed from their step-6 checkpoints, in a launch of their own."""
    root = zero3_root
    runs = {name: [*options, f"resume={root / name / 'run' / 'checkpoint-6'}"]
            for name, options in (("exgrpo", ["exgrpo"]), ("teach", ["teach"]), ("spread", ["defaults", "spread"]))}  # fmt: skip
    ranks = launch_runs(ZERO3, {str(root / f"{name}-resumed"): options for name, options in runs.items()})
    return {name: ranks[str(root / f"{name}-resumed")] for name in runs}


def check_resumed(whole: list[dict], resumed: list[dict], from_step: int, names: tuple[str, ...]) -> None:
    """A run resumed from its step-`from_step` checkpoint makes the plans, losses and pool of the uninterrupted run,
    and the last steps' logged `names`."""
    for rank in range(2):
        after = [plan for plan, step in zip(whole[rank]["plans"], whole[rank]["plan_steps"]) if step >= from_step]
        assert resumed[rank]["plans"] == after
        assert resumed[rank]["losses"] == whole[rank]["losses"]
        assert resumed[rank]["pool_hash"] == whole[rank]["pool_hash"]
        assert resumed[rank]["pool_content_hash"] == whole[rank]["pool_content_hash"]  # rank 0's rows
        for name in names:
            assert resumed[rank][name][-from_step:] == whole[rank][name][-from_step:], name


@pytest.mark.slow
def test_the_exgrpo_profile_is_rank_identical_and_resumes_exactly(zero3, zero3_resumed, zero3_root):
    """replay_profile="exgrpo" on 2 ranks under ZeRO-3: the start by capability, the retired questions (an epoch of 2
    steps) and the replayed tasks' buckets are decided alike on both ranks, and a run resumed from its step-6
    checkpoint (whose exreplay_schedule.json holds the step replay started at, and whose pool holds the retired tasks)
    makes the plans, losses and pool of the run that was not stopped (12 steps: replay starts after a batch of steps
    2-6 and solved questions retire; an epoch is 2 steps, so the resume crosses epochs)."""
    whole = zero3["exgrpo"]
    check_rank_identical(whole)
    rank0, rank1 = whole
    assert rank0["schedule"] == rank1["schedule"] and rank0["schedule"][0] is not None  # replay started
    assert rank0["redirected_groups"] == rank1["redirected_groups"] and sum(rank0["redirected_groups"]) > 0
    assert any(rank0["retired_tasks"]) and any(rank0["replay_tasks"])
    assert (zero3_root / "exgrpo" / "run" / "checkpoint-6" / "exreplay_schedule.json").exists()
    resumed = zero3_resumed["exgrpo"]
    check_resumed(whole, resumed, 6, ("redirected_groups",))
    for rank in range(2):
        assert resumed[rank]["schedule"] == whole[rank]["schedule"]
        assert resumed[rank]["skip_set"] == whole[rank]["skip_set"]


def check_every_group_teaching(whole: list[dict], final_model: Path) -> None:
    """Rescue with retired questions (`teach`, the defaults before the spread plan) on 2 ranks: rescued groups (their stored success read on rank 0 and sent to
    the rank that holds the row; the loss's token count gathered again), retired questions and their revisits are
    decided alike on both ranks."""
    check_rank_identical(whole)
    rank0, rank1 = whole
    for name in ("rescued_groups", "revisited_groups", "redirected_groups", "skip_set"):
        assert rank0[name] == rank1[name], name
    assert sum(rank0["rescued_groups"]) > 0 and sum(rank0["revisited_groups"]) > 0, rank0
    # save_model() after train() and before exit_distributed(), the script's last line: the model is written
    assert final_model.is_file()


TEACHING = ("rescued_groups", "revisited_groups", "redirected_groups")
PLANNING = ("spread_replanned_groups", "spread_observed_fresh", "rescued_groups")  # what the defaults log per step


@pytest.mark.slow
def test_every_group_teaching_is_rank_identical_and_resumes_exactly_under_zero3(zero3, zero3_resumed, zero3_root):
    """`teach` under ZeRO-3, decided alike on both ranks; a run resumed from its step-6 checkpoint makes the plans,
    losses, pool and metrics of the run that was not stopped."""
    check_every_group_teaching(zero3["teach"], zero3_root / "teach" / "final" / "model.safetensors")
    check_resumed(zero3["teach"], zero3_resumed["teach"], 6, TEACHING)


@pytest.mark.slow
def test_the_spread_plan_is_rank_identical_and_resumes_exactly_under_zero3(zero3, zero3_resumed, zero3_root):
    """The defaults (rescue and the spread plan) with no exploration floor, so that every group is planned, under
    ZeRO-3: both ranks plan the same groups (from gathered keys and outcomes), hold the same estimates, and a run resumed from its step-6 checkpoint (which holds them) plans, trains
    and estimates as the run that was not stopped."""
    whole = zero3["spread"]
    check_rank_identical(whole)
    rank0, rank1 = whole
    for name in ("spread_replanned_groups", "spread_observed_fresh", "spread_estimates"):
        assert rank0[name] == rank1[name], name
    assert sum(rank0["spread_replanned_groups"]) > 0 and len(rank0["spread_estimates"]["task"]) == 3
    assert (zero3_root / "spread" / "run" / "checkpoint-6" / "exreplay_estimates.arrow").is_file()
    resumed = zero3_resumed["spread"]
    check_resumed(whole, resumed, 6, PLANNING)
    assert [r["spread_estimates"] for r in resumed] == [r["spread_estimates"] for r in whole]


@pytest.mark.slow
def test_every_group_teaching_resumes_exactly_under_zero2_and_only_with_the_rng_states(tmp_path):
    """The same under ZeRO-2; a run resumed without the checkpoint's RNG states does not make the same losses (so the
    comparison sees the sampling of steps 7-12, not only what the checkpoint holds)."""
    whole = launch_runs(ZERO2, {str(tmp_path / "whole"): ["teach"]})[str(tmp_path / "whole")]
    check_every_group_teaching(whole, tmp_path / "whole" / "final" / "model.safetensors")
    checkpoint = tmp_path / "whole" / "run" / "checkpoint-6"
    no_rng = tmp_path / "no_rng" / "checkpoint-6"
    shutil.copytree(checkpoint, no_rng, ignore=shutil.ignore_patterns("rng_state*"))
    runs = {str(tmp_path / "resumed"): ["teach", f"resume={checkpoint}"],
            str(tmp_path / "unseeded"): ["teach", f"resume={no_rng}"]}  # fmt: skip
    resumed, unseeded = launch_runs(ZERO2, runs).values()
    check_resumed(whole, resumed, 6, TEACHING)
    assert [rank["losses"][6:] for rank in unseeded] != [rank["losses"][6:] for rank in whole]


def test_deepspeed_zero3_two_processes_rank_identical_pools(zero3, zero3_root):
    """With TRL options whose replayed term gathers over ranks (entropy selection) and a non-default loss type; and
    experience-guided rollouts, whose discarded rows take a behaviour forward that ZeRO-3 makes collective."""
    ranks = zero3["guided"]
    check_rank_identical(ranks)  # (what it learns, hence how many tasks replay, is cispo's)
    check_guided_allocations(ranks)
    run = zero3_root / "guided" / "run"
    assert (run / "checkpoint-3" / "exreplay_pool" / "state.json").exists()
    assert (run / "checkpoint-3" / "exreplay_experience" / "manifest.json").exists()


@pytest.mark.slow
def test_multi_turn_lockstep_with_a_rank_that_plays_no_episode(zero3):
    """One group of 4 rows over 2 ranks, k=2: on replay steps rank 1 has no fresh row and plays no episode while rank 0
    plays two multi-turn episodes. Under ZeRO-3 (parameters really partitioned) a collective mismatch would hang: the
    launch is bounded and fails instead."""
    rank0, rank1 = zero3["multi-turn"]
    assert rank0["pool_hash"] == rank1["pool_hash"] and rank1["pool_content_hash"] is None
    assert rank0["plans"] == rank1["plans"] and rank0["losses"] == rank1["losses"]
    replay_steps = [i for i, tasks in enumerate(rank0["replay_tasks"]) if tasks > 0]
    assert len(replay_steps) >= 2
    for step in replay_steps:
        assert rank1["episode_lengths"][step] == []  # both of rank 1's rows replayed
        assert len(rank0["episode_lengths"][step]) == 2
    played = [i for i in range(len(rank0["episode_lengths"])) if i not in replay_steps]
    assert any(rank0["episode_lengths"][i] != rank1["episode_lengths"][i] for i in played)  # unequal episodes
    assert rank0["env_errors"][-1] == 0.0


@pytest.mark.slow
def test_the_defaults_are_rank_identical_and_resume_exactly_under_ddp(tmp_path):
    """The library's defaults as they are (rescue and the spread plan, its explore floor included) on 2 DDP ranks: both
    draw the same plan and hold the same estimates, and a run resumed from its step-6 checkpoint plans, trains and
    estimates as the run that was not stopped."""
    whole = launch_runs(DDP, {str(tmp_path / "whole"): ["defaults"]})[str(tmp_path / "whole")]
    check_rank_identical(whole)
    rank0, rank1 = whole
    for name in ("spread_replanned_groups", "spread_observed_fresh", "spread_estimates"):
        assert rank0[name] == rank1[name], name
    assert sum(rank0["spread_replanned_groups"]) > 0
    checkpoint = tmp_path / "whole" / "run" / "checkpoint-6"
    resumed = launch_runs(DDP, {str(tmp_path / "resumed"): ["defaults", f"resume={checkpoint}"]})[
        str(tmp_path / "resumed")
    ]
    check_resumed(whole, resumed, 6, PLANNING)
    assert [r["spread_estimates"] for r in resumed] == [r["spread_estimates"] for r in whole]


@pytest.mark.slow
def test_two_machines_on_loopback_alternate_replay_shares_and_resume_exactly(tmp_path):
    """Two machines simulated here (`--num_machines 2`, one rank each, meeting on a loopback port) that share the
    output folder (a network filesystem), with a local scratch folder each (`replay_scratch_dir`) and shards of 2 rows,
    so that files are written while training. replay_ratio 0.5 of 3 groups is 1.5 a batch, so batches alternate
    between replaying 1 and 2 groups by their global index (steps 2-5: 1, 2, 1, 2), on both ranks alike; a run resumed
    from its step-3 checkpoint replays what the uninterrupted run replays."""
    config = "recipes/accelerate/multinode_ddp_cpu.yaml"
    scratch = [tmp_path / "machine0-local", tmp_path / "machine1-local"]

    def run(name: str, *options: str) -> list[dict]:
        out = tmp_path / name
        machines = [[out, f"scratch={scratch[r]}", "small-shards", "ratio=0.5", *options] for r in range(2)]
        accelerate_launch_machines(config, SCRIPT, machines)
        return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]

    whole = run("whole")
    check_rank_identical(whole)
    for rank in whole:
        assert rank["plan_steps"] == [2, 3, 4, 5] and rank["plan_due"] == [1, 2, 1, 2]
        assert [len(plan) for plan in rank["plans"]] == [1, 2, 1, 2]  # the pool held enough tasks
        assert rank["replay_tasks"] == [0.0, 0.0, 1.0, 2.0, 1.0, 2.0]
    # 12 rows a step over both ranks, one row a replayed group (k = 1): only the fresh ones reach generate
    generated = [a + b for a, b in zip(whole[0]["generated_rows"], whole[1]["generated_rows"])]
    assert generated == [12, 12, 11, 10, 11, 10]
    # Rank 0 (machine 0) wrote the pool's files, to its own disk, and removed them at the end (the folder too, which
    # the pool had made); machine 1 holds the index alone and made no folder.
    assert whole[0]["pool_storage"]["trajectory_shards"] > 0 and Path(whole[0]["pool_scratch"]).parent == scratch[0]
    assert whole[1]["pool_scratch"] is None
    assert not scratch[0].exists() and not scratch[1].exists()
    checkpoint = tmp_path / "whole" / "run" / "checkpoint-3"
    assert (checkpoint / "exreplay_pool" / "state.json").exists()
    resumed = run("resumed", f"resume={checkpoint}")
    for rank in range(2):
        assert resumed[rank]["plan_steps"] == [3, 4, 5] and resumed[rank]["plan_due"] == [2, 1, 2]
    check_resumed(whole, resumed, 3, ())  # the plans of steps 3-5, the losses, the pool
