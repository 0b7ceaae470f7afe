"""Untrusted and bad input: a damaged or crafted pool folder, non-finite rewards and rows, impossible configs, and
what a killed run leaves behind (issue 24). Each test fails on the code before these checks existed."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import load_script, make_trainer, reseal_pool

from trl_exreplay.demo.examples import VOCABULARY, said_target
from trl_exreplay.demo.tiny import build_tiny_tokenizer
from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory, tokenizer_fingerprint
from trl_exreplay.pool.check import PoolFormatError
from trl_exreplay.trainer import POOL_WORK_DIR


def trajectory(task="t", logps=(-0.5, -0.25), ids=(3, 4), mask=(1, 1), reward=1.0, entropy=0.5):
    return Trajectory(task, [1, 2], list(ids), list(mask), list(logps), [reward], reward, entropy, policy_version=0)


def saved_pool(path, tokenizer=None, shard_rows=2) -> ExperiencePool:
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=4, shard_rows=shard_rows)
    if tokenizer is not None:
        pool.bind_tokenizer(tokenizer_fingerprint(tokenizer))
    for task, entropies in (("a", (0.1, 0.2)), ("b", (0.3,)), ("c", (0.4, 0.5))):
        successes = [trajectory(task, entropy=e) for e in entropies]
        pool.record_outcome(TaskOutcome(task, len(successes), 4, successes, task_row=json.dumps({"p": task})))
    pool.save(str(path))
    return pool


def edit_state(path, edit, reseal=True):
    with open(path / "state.json") as f:
        state = json.load(f)
    edit(state)
    with open(path / "state.json", "w") as f:
        json.dump(state, f)
    if reseal:
        reseal_pool(str(path))


# --------------------------------------------------------------------------------------- 1, 6: damaged pools
def test_fuzzed_pools_never_crash_and_are_never_read_as_other_data():
    fuzz = load_script("benchmarks/pool_fuzz.py", "pool_fuzz")
    result = fuzz.main(["--mutations", "100", "--seed", "7"])
    assert logging.getLogger("trl_exreplay").level == logging.NOTSET  # quiet while it ran; the session's tests warn
    assert result["mutations"] == 100
    assert result["signals"] == 0 and result["silent_differences"] == 0, result["bad_cases"]
    assert result["unclear_errors"] == 0 and result["hangs"] == 0, result["bad_cases"]
    assert result["clear_errors"] > 50 and result["counted_rejections"] > 0


def test_the_guidance_probe_finds_no_crash_hang_or_silent_result(capsys):
    """benchmarks/guidance_probe.py --quick: a slow, broken or hostile experience service, forged retrieved text, bad
    environment answers and out-of-range settings (the full probe: 55 cases)."""
    probe = load_script("benchmarks/guidance_probe.py", "guidance_probe")
    counts = probe.main(["--quick"])
    # quiet while it ran, not after: it silenced the package's warnings for every later test of the session
    assert logging.getLogger("trl_exreplay").level == logging.NOTSET
    assert counts["ok"] == 24 and set(counts) == {"ok"}, capsys.readouterr().out
    assert capsys.readouterr().out.endswith("cases 24, crashes 0, hangs 0, silent 0\n")


def test_damage_is_one_error_naming_the_file(tmp_path):
    saved_pool(tmp_path / "pool")
    shard = sorted((tmp_path / "pool").glob("trajectories-*"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(PoolFormatError, match=f"{shard.name}: checksum mismatch"):
        ExperiencePool.load(str(tmp_path / "pool"))
    (tmp_path / "pool" / "state.json").write_text('{"format_version": 7, "settings": ')
    with pytest.raises(PoolFormatError, match="state.json: not valid JSON"):
        ExperiencePool.load(str(tmp_path / "pool"))
    (tmp_path / "pool" / "state.json").write_text("[" * 100_000 + "]" * 100_000)  # nested past Python's recursion
    with pytest.raises(PoolFormatError, match="state.json: not valid JSON"):
        ExperiencePool.load(str(tmp_path / "pool"))


def test_a_shard_with_columns_of_another_type_is_refused(tmp_path):
    import pyarrow as pa

    from trl_exreplay.pool.store import read_arrow

    saved_pool(tmp_path / "pool")
    shard = sorted((tmp_path / "pool").glob("trajectories-*"))[0]
    table = read_arrow(str(shard))
    strings = pa.array(
        [[str(i) for i in ids] for ids in table.column("prompt_ids").to_pylist()], pa.list_(pa.string())
    )
    table = table.set_column(table.schema.get_field_index("prompt_ids"), "prompt_ids", strings)
    shard.unlink()
    with pa.OSFile(str(shard), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    reseal_pool(str(tmp_path / "pool"))
    with pytest.raises(PoolFormatError, match=f"{shard.name}: columns .*'prompt_ids', 'list<item: string>'"):
        ExperiencePool.load(str(tmp_path / "pool"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s["settings"].update(replay_max_trajectories_per_task=1), "a task holds more than 1 trajectories"),
        (lambda s: s["settings"].update(replay_select_mode="median"), "replay_select_mode"),
        (lambda s: s["settings"].update(replay_store_rbound=-1), "replay_store_rbound"),
        (lambda s: s["shards"][0].update(live=99), "live"),
        (lambda s: s["counters"].update(next_traj_id=1), r"`traj_ids` outside \[0, next_traj_id\)"),
    ],
)
def test_resealed_state_edits_no_pool_can_have_are_refused(tmp_path, edit, message):
    saved_pool(tmp_path / "pool")
    edit_state(tmp_path / "pool", edit)
    with pytest.raises(PoolFormatError, match=message):
        ExperiencePool.load(str(tmp_path / "pool"))


# ------------------------------------------------------------------------------------ 2: paths stay inside
def assert_refused_by_push_pool(folder, monkeypatch):
    """`push_pool` refuses the folder before any upload."""
    from trl_exreplay.pool import push_pool

    uploads = []
    monkeypatch.setattr("huggingface_hub.HfApi.create_commit", lambda self, *a, **k: uploads.append(a))
    with pytest.raises(PoolFormatError):
        push_pool(str(folder), "me/pool")
    assert uploads == []


def _rename_first_shard(state, new_name, folder=None):
    entry = state["shards"][0]
    if folder is not None:  # a real copy where the name leads, for a loader that would follow it
        target = os.path.normpath(os.path.join(folder, new_name))
        if not os.path.exists(target) and os.path.isdir(os.path.dirname(target)):
            with open(os.path.join(folder, entry["name"]), "rb") as f, open(target, "wb") as out:
                out.write(f.read())
    entry["name"] = new_name


@pytest.mark.parametrize(
    "name",
    ["../../outside.arrow", "../trajectories-x.arrow", "sub/trajectories-x.arrow", ".trajectories-x.arrow",
     "/abs.arrow", "tasks-x.arrow"],
)  # fmt: skip
def test_shard_names_that_leave_the_folder_are_refused(tmp_path, name):
    saved_pool(tmp_path / "pool")
    edit_state(tmp_path / "pool", lambda s: _rename_first_shard(s, name, str(tmp_path / "pool")))
    with pytest.raises(PoolFormatError, match=r"`shards\[0\].name` .* is not a file name of the pool folder"):
        ExperiencePool.load(str(tmp_path / "pool"))


@pytest.mark.parametrize("which", ["state.json", "a shard"])
def test_a_fifo_in_place_of_a_pool_file_is_refused_without_being_opened(tmp_path, monkeypatch, which):
    """Opening a FIFO blocks until a writer comes: a load, and a push, must refuse it by its type first."""
    saved_pool(tmp_path / "pool")
    path = tmp_path / "pool" / "state.json"
    if which == "a shard":
        path = sorted((tmp_path / "pool").glob("trajectories-*"))[0]
    path.unlink()
    os.mkfifo(path)
    signal.alarm(20)  # a hang fails the test instead of the suite
    try:
        with pytest.raises(PoolFormatError, match="not a regular file"):
            ExperiencePool.load(str(tmp_path / "pool"))
        if which == "a shard":
            assert_refused_by_push_pool(tmp_path / "pool", monkeypatch)
    finally:
        signal.alarm(0)


def test_an_absolute_tasks_file_is_refused_and_never_pushed(tmp_path, monkeypatch):
    saved_pool(tmp_path / "pool")
    outside = tmp_path / "outside.arrow"

    def edit(state):
        os.replace(tmp_path / "pool" / state["tasks"]["name"], outside)
        state["tasks"]["name"] = str(outside)

    edit_state(tmp_path / "pool", edit)  # resealed: the checksums hold, the name must still be refused
    with pytest.raises(PoolFormatError, match="`tasks.name`"):
        ExperiencePool.load(str(tmp_path / "pool"))
    assert_refused_by_push_pool(tmp_path / "pool", monkeypatch)


def test_links_leading_out_are_refused_and_the_hub_cache_layout_loads(tmp_path, monkeypatch):
    pool = saved_pool(tmp_path / "pool")
    shard = sorted((tmp_path / "pool").glob("trajectories-*"))[0]
    # a symlink to a copy outside (same bytes): refused by where it leads
    outside = tmp_path / "outside.arrow"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(PoolFormatError, match="outside the pool folder"):
        ExperiencePool.load(str(tmp_path / "pool"))
    # a hard link to a file with other content (what an attacker would want read or uploaded): refused by content
    shard.unlink()
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a shard" * 100)
    os.link(secret, shard)
    with pytest.raises(PoolFormatError, match="has 1100 bytes; the pool recorded"):
        ExperiencePool.load(str(tmp_path / "pool"))
    assert_refused_by_push_pool(tmp_path / "pool", monkeypatch)

    # the Hugging Face cache: <repo>/snapshots/<rev>/ holds symlinks into <repo>/blobs/, accepted exactly there
    pool.save(str(tmp_path / "clean"))
    repo = tmp_path / "cache" / "datasets--me--pool"
    snapshot = repo / "snapshots" / "abc"
    for i, file in enumerate(sorted(p for p in (tmp_path / "clean").rglob("*") if p.is_file())):
        blob = repo / "blobs" / f"blob{i}"
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(file.read_bytes())
        link = snapshot / file.relative_to(tmp_path / "clean")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    assert ExperiencePool.load(str(snapshot)).content_hash() == pool.content_hash()
    elsewhere = tmp_path / "cache" / "other-blob"
    first = sorted(snapshot.glob("trajectories-*"))[0]
    elsewhere.write_bytes(first.read_bytes())
    first.unlink()
    first.symlink_to(elsewhere)  # inside the cache, but not in this repository's blobs/
    with pytest.raises(PoolFormatError, match="outside the pool folder"):
        ExperiencePool.load(str(snapshot))


# ------------------------------------------------------------------------------ 3: non-finite values, bad rows
@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(logps=(-0.5, float("nan"))), "non-finite logps"),
        (dict(reward=float("inf")), "non-finite reward"),
        (dict(entropy=float("nan")), "non-finite entropy"),
        (dict(mask=(1, 2)), "completion_mask not 0/1"),
        (dict(ids=(3, -1)), "token id outside the vocabulary"),
    ],
)
def test_rows_a_model_cannot_train_on_are_refused_and_counted(bad, reason):
    pool = ExperiencePool(replay_store_rbound=4)
    assert not pool.add(trajectory(**bad))
    assert pool.num_trajectories == 0 and pool.rejected_reasons == {reason: 1}
    pool.record_outcome(TaskOutcome("t", 1, 4, [trajectory(**bad)]))
    assert pool.num_trajectories == 0 and pool.rejected_rows == 2 and pool.stats()["pool_rejected_rows"] == 2.0


def test_token_ids_past_the_vocabulary_are_refused_at_load_and_when_the_vocabulary_is_set(tmp_path):
    pool = saved_pool(tmp_path / "pool")
    pool.add(trajectory("d", ids=(3, 40)))
    assert pool.set_vocab_size(32) == 1 and pool.trajectories("d") == []
    assert not pool.add(trajectory("d", ids=(3, 40))) and pool.rejected_rows == 2
    loaded = ExperiencePool.load(str(tmp_path / "pool"), vocab_size=4)  # ids 3 and 4: the id 4 rows are out
    assert loaded.num_trajectories == 0 and loaded.rejected_reasons == {"token id outside the vocabulary": 5}


def test_an_infinite_reward_is_a_counted_missing_reward_never_stored(tmp_path):
    def inf_for_one(completions, target, **kwargs):
        rewards = said_target(completions, target)
        return [float("inf") if i == 0 else r for i, r in enumerate(rewards)]

    trainer = make_trainer(tmp_path, reward_funcs=inf_for_one, max_steps=2, replay_start_ratio=1.0)
    trainer.train()
    assert trainer._faults.totals["nonfinite_rewards"] >= 1
    stored = [t for task in trainer.pool.stored_tasks() for t in trainer.pool.trajectories(task)]
    assert stored  # the other rows were stored as usual
    assert all(np.isfinite(t.reward) and np.isfinite(t.rewards).all() for t in stored)
    assert all(np.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


# -------------------------------------------------------------------------- 5: scratch, resume, fingerprints
_HOLD_A_POOL = textwrap.dedent(
    """
    import sys, time
    from trl_exreplay.pool import ExperiencePool, Trajectory
    pool = ExperiencePool(work_dir=sys.argv[1], shard_rows=1)
    pool.add(Trajectory("t", [1], [2], [1], [-0.1], [1.0], 1.0, 0.5, 0))
    pool.flush()
    print(pool._scratch.path, flush=True)
    time.sleep(600)
    """
)


def test_a_trainer_removes_the_live_pool_a_killed_run_left_in_its_output_dir(tmp_path):
    """A run killed mid-training leaves its live pool's shards; the next run of the same output_dir removes them when
    it starts (whichever machine the killed one ran on), and nothing else of the folder."""
    work = tmp_path / "out" / POOL_WORK_DIR  # make_trainer's output_dir is tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", _HOLD_A_POOL, str(work)], stdout=subprocess.PIPE, text=True)
    try:
        folder = child.stdout.readline().strip()
        assert [n for n in os.listdir(folder) if n.startswith("trajectories-")]
    finally:
        child.kill()
        child.wait()
    (work / "notes.txt").write_text("not a pool's")
    trainer = make_trainer(tmp_path, max_steps=1)
    assert not os.path.exists(folder) and (work / "notes.txt").exists()
    trainer.pool.add(trajectory())
    trainer.pool.flush()
    assert os.path.dirname(trainer.pool.scratch_folder()) == str(work)


def test_a_resume_without_the_pool_warns_and_says_how_to_start_empty(tmp_path):
    first = make_trainer(tmp_path / "a", max_steps=1, save_strategy="steps", save_steps=1)
    first.train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-1"
    import shutil

    shutil.rmtree(checkpoint / "exreplay_pool")
    resumed = make_trainer(tmp_path / "b", max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.warns(UserWarning, match="EMPTY pool.*replay_resume_without_pool=True"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    quiet = make_trainer(tmp_path / "c", max_steps=2, save_strategy="no", replay_resume_without_pool=True)
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*EMPTY pool.*")
        quiet.train(resume_from_checkpoint=str(checkpoint))


def test_a_pool_without_fingerprint_is_refused_with_a_tokenizer_unless_allowed(tmp_path):
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    pool = saved_pool(tmp_path / "pool")  # no tokenizer bound
    with pytest.raises(ValueError, match="records no tokenizer fingerprint.*allow_missing_fingerprint=True"):
        ExperiencePool.load(str(tmp_path / "pool"), tokenizer=tokenizer)
    loaded = ExperiencePool.load(str(tmp_path / "pool"), tokenizer=tokenizer, allow_missing_fingerprint=True)
    assert loaded.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    pool.bind_tokenizer(tokenizer_fingerprint(tokenizer))
    assert loaded.content_hash() == pool.content_hash()
    with pytest.raises(ValueError, match="records no tokenizer fingerprint"):
        make_trainer(tmp_path, trainer_kwargs={"experience_pool": ExperiencePool.load(str(tmp_path / "pool"))})


def test_saving_over_another_format_or_a_damaged_state_says_so(tmp_path):
    pool = saved_pool(tmp_path / "old")
    edit_state(tmp_path / "old", lambda s: s.update(format_version=2), reseal=True)
    with pytest.raises(ValueError, match="Not saving into .*old: .*format_version 2 is not 7, .* development"):
        pool.save(str(tmp_path / "old"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "state.json").write_text("garbage")
    with pytest.raises(ValueError, match="Not saving into .*bad: its state.json is not that of a usable"):
        pool.save(str(tmp_path / "bad"))
    edit_state(tmp_path / "old", lambda s: s.update(format_version=9), reseal=False)
    with pytest.raises(PoolFormatError, match="format_version 9 is not 7, .* a newer trl_exreplay"):
        ExperiencePool.load(str(tmp_path / "old"))
