"""The experience pool at scale: sharded Arrow storage, background writes, tombstones and compaction, incremental and
atomic saves (a writer process killed at random instants), windows, sampling, tokenizer fingerprints.

Sizes here are tiny; `benchmarks/pool_scale.py` measures 10k to 1M trajectories.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from helpers import kill_a_save_at_random, traj

from trl_exreplay.demo.tiny import build_tiny_tokenizer
from trl_exreplay.pool import ExperiencePool, TaskOutcome, tokenizer_fingerprint
from trl_exreplay.pool.check import PoolFormatError
from trl_exreplay.pool.folder import STATE_FILE, Scratch, read_state, state_files
from trl_exreplay.pool.shards import (
    TASK_ROW_FEATURES,
    TASK_ROW_SCHEMA,
    TRAJECTORY_FEATURES,
    TRAJECTORY_SCHEMA,
    ShardLog,
)
from trl_exreplay.pool.writer import Writer

SAVER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "pool_saver.py")


def f32(x: float) -> float:
    return float(np.float32(x))


def row(task_id, variant=0):
    return json.dumps({"task_id": task_id, "prompt": f"solve {task_id}", "variant": variant})


def record(pool, task_id, successes, entropies=(), version=0, num_fresh=4, task_row="default"):
    task_row = row(task_id) if task_row == "default" else task_row
    trajectories = [traj(task_id, e, version, first=10 + i) for i, e in enumerate(entropies)]
    pool.record_outcome(TaskOutcome(task_id, successes, num_fresh, trajectories, task_row))


def entropies(pool, task_id):
    return [t.entropy for t in pool.candidates(task_id)]


def files_of(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def inode(path) -> int:
    return os.stat(path).st_ino


# --------------------------------------------------------------------------------------------------------------------
# Shards: real `datasets` Arrow files, written off the calling thread
# --------------------------------------------------------------------------------------------------------------------


def test_schemas_are_what_datasets_gives_the_features():
    for features, schema in ((TRAJECTORY_FEATURES, TRAJECTORY_SCHEMA), (TASK_ROW_FEATURES, TASK_ROW_SCHEMA)):
        expected = datasets.Features.from_dict(features).arrow_schema
        assert schema.remove_metadata() == expected.remove_metadata()
        assert json.loads(schema.metadata[b"huggingface"]) == json.loads(expected.metadata[b"huggingface"])


def test_shards_are_datasets_files_holding_exactly_the_flushed_rows(tmp_path):
    pool = ExperiencePool(max_trajectories_per_task=5, experience_rbound=8, shard_rows=2, work_dir=str(tmp_path))
    record(pool, "a", 3, [0.3, 0.2, 0.1], version=4)
    record(pool, "b", 2, [0.9, 0.8], version=5)
    pool.flush(wait=True)
    stats = pool.storage_stats()
    assert (stats["trajectory_shards"], stats["trajectory_rows"], stats["trajectory_pending_rows"]) == (3, 5, 0)
    assert stats["task_row_pending_rows"] == 0
    (scratch,) = [p for p in tmp_path.iterdir() if p.name.startswith("exreplay-pool-")]
    rows = []
    for shard in sorted((scratch / "trajectories").iterdir()):
        table = datasets.Dataset.from_file(str(shard))  # memory-mapped by `datasets` itself
        assert table.features == datasets.Features.from_dict(TRAJECTORY_FEATURES)
        rows += table.to_list()
    want = [dict(t.__dict__, store_seq=i) for i, t in enumerate(pool.candidates("a") + pool.candidates("b"))]
    assert sorted(rows, key=lambda r: r["traj_id"]) == want
    assert want[0] == {
        "task_id": "a",
        "prompt_ids": [1, 2],
        "completion_ids": [10, 11, 12],
        "completion_mask": [1, 1, 0],
        "logps": [-0.25, -0.5, -0.75],
        "rewards": [1.0, 0.5],
        "reward": 1.0,
        "entropy": f32(0.3),
        "policy_version": 4,
        "traj_id": 0,
        "store_seq": 0,
    }
    pool.close()
    assert not scratch.exists()  # the live pool's scratch shards go with it


def test_appends_are_written_by_the_writer_thread_without_blocking_the_caller(tmp_path):
    pool = ExperiencePool(max_trajectories_per_task=10, experience_rbound=20, shard_rows=4)
    build, release, threads = pool._trajectories._build, threading.Event(), []

    def slow_build(items):
        threads.append(threading.current_thread().name)
        assert release.wait(10)
        return build(items)

    pool._trajectories._build = slow_build
    record(pool, "a", 9, [0.1 * i for i in range(9)])  # two shards queued; the writer is held on the first
    time.sleep(0.05)
    assert threads == ["exreplay-pool-writer"]
    assert pool.storage_stats()["trajectory_pending_rows"] == 9  # buffered, and readable meanwhile
    assert entropies(pool, "a") == [f32(0.1 * i) for i in range(9)]
    release.set()
    pool.flush(wait=True)
    assert threads == ["exreplay-pool-writer"] * 3
    assert pool.storage_stats()["trajectory_pending_rows"] == 0
    assert entropies(pool, "a") == [f32(0.1 * i) for i in range(9)]  # now read from the shards


# --------------------------------------------------------------------------------------------------------------------
# Tombstones and compaction
# --------------------------------------------------------------------------------------------------------------------


def test_evictions_leave_tombstones_that_compaction_removes(tmp_path):
    def build(flush):
        pool = ExperiencePool(max_trajectories_per_task=1, experience_rbound=8, shard_rows=4, work_dir=str(tmp_path))
        for task in "abcdefgh":  # two shards of four
            record(pool, task, 1, [0.5])
        if flush:
            pool.flush(wait=True)
        return pool

    pool, unflushed = build(True), build(False)
    saved = tmp_path / "before-compaction"
    pool.save(str(saved))
    assert pool.storage_stats()["trajectory_dead_rows"] == 0
    for p in (pool, unflushed):
        record(p, "a", 1, [0.4], version=1)  # evicts a written row of the first shard: a tombstone
    pool.flush(wait=True)
    assert (pool.storage_stats()["trajectory_shards"], pool.storage_stats()["trajectory_dead_rows"]) == (3, 1)
    for p in (pool, unflushed):
        for task in "bc":
            record(p, task, 1, [0.3], version=2)
    pool.flush(wait=True)  # the first shard is 3/4 dead now: rewritten in the background, the rest kept
    stats = pool.storage_stats()
    assert (stats["trajectory_dead_rows"], stats["trajectory_rows"]) == (0, 8)
    assert pool.content_hash() == unflushed.content_hash()  # storage layout is not content
    assert [entropies(pool, t) for t in "abcd"] == [[f32(0.4)], [f32(0.3)], [f32(0.3)], [f32(0.5)]]
    # the pool saved before the compaction is intact: it has its own links to the old shards
    assert ExperiencePool.load(str(saved)).content_hash() == build(False).content_hash()


def test_a_row_evicted_while_compactions_rewrite_it_twice_is_counted_once(tmp_path):
    """Random evictions while compactions rewrite shards that earlier compactions made: every tombstone is counted
    once, wherever its row moved, or a save writes a state that its own check refuses (num_trajectories below the
    shards' live rows)."""
    pool = ExperiencePool(max_trajectories_per_task=5, experience_rbound=8, work_dir=str(tmp_path / "work"))
    rng = np.random.default_rng(1)
    for task in range(400):
        record(pool, f"t{task}", 5, rng.random(5).tolist(), num_fresh=8)
    pool.save(str(tmp_path / "pool"))
    for version in range(1, 9):  # random evictions: tombstones everywhere, compactions of the compactions' shards
        for task in rng.integers(0, 400, 512).tolist():
            pool.add(traj(f"t{task}", float(rng.random()), version))
        pool.flush(wait=True)
        pool.save(str(tmp_path / "pool"))  # its own check of the state it committed raised here
    assert ExperiencePool.load(str(tmp_path / "pool")).content_hash() == pool.content_hash()


def test_a_row_deleted_while_a_compaction_rewrites_it_is_a_tombstone_of_its_new_shard(tmp_path):
    schema = pa.schema([("text", pa.string())])
    build = lambda items: pa.record_batch([pa.array(items)], schema=schema)  # noqa: E731
    writer, scratch = Writer(), Scratch(str(tmp_path))
    log = ShardLog("notes", "note", schema, build, writer, scratch, shard_rows=4, stage_rows=4)
    keys = [log.append(text) for text in "abcd"]
    log.flush(seal=True, wait=True)
    log.delete(keys[0])
    log.delete(keys[1])  # half the shard dead: the next flush rewrites "c" and "d" into a new shard
    write = log._write_shard

    def write_then_delete(sid, rows, table):
        shard = write(sid, rows, table)
        log.delete(keys[2])  # the new shard is written, its keys not moved yet
        return shard

    log._write_shard = write_then_delete
    log.flush(wait=True)
    log._write_shard = write
    assert log.read([keys[3]], ("text",)) == [{"text": "d"}]
    assert log.stats() == {"shards": 1, "rows": 2, "dead_rows": 1, "open_rows": 0, "pending_rows": 0}
    writer.close()
    scratch.remove()


def test_explicit_compaction_and_skip_set_clears(tmp_path):
    pool = ExperiencePool(max_trajectories_per_task=3, experience_rbound=8, shard_rows=8)
    for task in "abc":
        record(pool, task, 3, [0.1, 0.2, 0.3])
    pool.flush(wait=True)
    record(pool, "a", 4, num_fresh=4)  # fully solved: its three trajectories become tombstones
    pool.flush(wait=True)
    assert pool.storage_stats()["trajectory_dead_rows"] == 3 and pool.num_trajectories == 6
    before = pool.content_hash()
    pool.compact()
    assert pool.storage_stats()["trajectory_dead_rows"] == 0 and pool.storage_stats()["trajectory_rows"] == 6
    assert pool.content_hash() == before


# --------------------------------------------------------------------------------------------------------------------
# Incremental, pruned, atomic saves
# --------------------------------------------------------------------------------------------------------------------


def test_saves_write_only_new_shards_and_share_the_others(tmp_path):
    pool = ExperiencePool(max_trajectories_per_task=5, experience_rbound=8, shard_rows=4, work_dir=str(tmp_path))
    for task in "abcdef":
        record(pool, task, 1, [0.5])
    first, second = tmp_path / "checkpoint-1" / "pool", tmp_path / "checkpoint-2" / "pool"
    pool.save(str(first))
    record(pool, "g", 1, [0.5])
    pool.save(str(second))
    shards = lambda path: {n for n in files_of(path) if n.startswith(("trajectories/", "task_rows/"))}  # noqa: E731
    old, new = shards(first), shards(second)
    assert old < new and len(new - old) == 2  # one new trajectory shard, one new task row shard
    for name in old:  # the very same files: hard links, nothing rewritten
        assert inode(first / name) == inode(second / name) and os.stat(second / name).st_nlink >= 3
    hashes = {"second": pool.content_hash()}
    shutil.rmtree(tmp_path / "checkpoint-1")  # rotation deletes the older checkpoint
    assert ExperiencePool.load(str(second)).content_hash() == hashes["second"]

    # saving again into the same folder: the shards it has are left untouched, only new files appear
    mtimes = {name: os.stat(second / name).st_mtime_ns for name in new}
    record(pool, "h", 1, [0.5])
    pool.save(str(second))
    for name in new:
        assert os.stat(second / name).st_mtime_ns == mtimes[name] and inode(second / name) == inode(second / name)
    assert files_of(second) == sorted(state_files(read_state(str(second))))  # the old tasks table was pruned
    assert ExperiencePool.load(str(second)).content_hash() == pool.content_hash()


def test_with_the_scratch_folder_on_another_file_system_a_checkpoint_copies_only_new_shards(tmp_path, monkeypatch):
    """Scratch folder on a local disk, checkpoints on another file system: the first save copies the shards, and
    each later checkpoint hard-links the ones the previous checkpoint holds, copying only the new ones."""
    work, link = tmp_path / "work", os.link

    def across_file_systems(source, dest, *args, **kwargs):
        if str(source).startswith(str(work)) != str(dest).startswith(str(work)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return link(source, dest, *args, **kwargs)

    monkeypatch.setattr(os, "link", across_file_systems)
    pool = ExperiencePool(max_trajectories_per_task=5, experience_rbound=8, shard_rows=4, work_dir=str(work))
    for task in "abcdef":
        record(pool, task, 2, [0.5, 0.4])
    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    pool.save(str(first))
    record(pool, "g", 2, [0.5, 0.4])
    pool.save(str(second))
    shards = lambda path: {n for n in files_of(path) if n.startswith(("trajectories/", "task_rows/"))}  # noqa: E731
    old, new = shards(first), shards(second)
    assert old < new
    assert all(inode(first / n) == inode(second / n) for n in old)  # linked from the previous checkpoint
    assert all(os.stat(second / n).st_nlink == 1 for n in new - old)  # copied from the scratch folder
    assert ExperiencePool.load(str(second)).content_hash() == pool.content_hash()


def test_a_loaded_pool_outside_the_scratch_file_system_links_each_save_from_the_last(tmp_path, monkeypatch):
    """Where no hard link into the scratch folder can be made (another file system), a loaded shard is read through
    its mapping, and each save links it from the previous save's copy: once TRL rotates the loaded checkpoint away,
    no save writes its rows again."""
    pool = ExperiencePool(max_trajectories_per_task=5, experience_rbound=8, shard_rows=4)
    for task in "abcdef":
        record(pool, task, 2, [0.5, 0.4])
    pool.save(str(tmp_path / "a"))
    want = pool.content_hash()
    pool.close()
    work, link = tmp_path / "work", os.link

    def no_link_into_scratch(source, dest, *args, **kwargs):
        if str(dest).startswith(str(work)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return link(source, dest, *args, **kwargs)

    monkeypatch.setattr(os, "link", no_link_into_scratch)
    loaded = ExperiencePool.load(str(tmp_path / "a"), work_dir=str(work))
    assert not any(shard.owned for shard in loaded._trajectories.shards.values())  # kept outside the scratch folder
    assert loaded.content_hash() == want
    loaded.save(str(tmp_path / "b"))
    shutil.rmtree(tmp_path / "a")  # rotated away
    loaded.save(str(tmp_path / "c"))
    shards = [n for n in files_of(tmp_path / "c") if n.startswith(("trajectories/", "task_rows/"))]
    assert shards and all(inode(tmp_path / "c" / n) == inode(tmp_path / "b" / n) for n in shards)
    assert loaded.content_hash() == want
    assert ExperiencePool.load(str(tmp_path / "c")).content_hash() == want
    for name in ("b", "c"):  # every copy gone: the rows are written again from the mappings, as the same bytes
        shutil.rmtree(tmp_path / name)
    loaded.save(str(tmp_path / "d"))
    assert loaded.content_hash() == want
    assert ExperiencePool.load(str(tmp_path / "d")).content_hash() == want


def test_killed_saves_always_leave_the_last_complete_pool(tmp_path):
    """A writer process saving a changing pool again and again into one folder is killed (SIGKILL) at a random
    instant of a random save; the folder must always load, intact, as the last save that completed (or as the one
    in flight, when the kill came after its commit). Each trial saves over what the previous killed writer left."""
    folder, work = tmp_path / "pool", tmp_path / "work"
    chooser = random.Random(1234)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trials, killed_mid_save = 12, 0
    for trial in range(trials):
        command = [sys.executable, SAVER, str(folder), str(work), str(trial)]
        committed, in_flight = kill_a_save_at_random(command, chooser, chooser.randint(2, 4), env)
        pool = ExperiencePool.load(str(folder))
        assert pool.rejected_rows == 0
        digest = pool.content_hash()
        assert digest in {committed, in_flight}, f"trial {trial}: the folder is not a complete saved pool"
        killed_mid_save += in_flight is not None
        pool.close()
    assert killed_mid_save >= trials // 2  # the kills really landed inside saves


@pytest.mark.slow  # kills a saving process at many points
def test_a_save_killed_before_any_of_its_filesystem_operations_leaves_a_complete_pool(tmp_path):
    """The deterministic complement of the random kills: a forked writer is killed before its 1st, 2nd, ...
    filesystem operation of four saves in turn (every boundary between two steps of the protocol); each time the
    folder must load intact as the last committed pool, or the new one once the commit is done."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, SAVER, str(tmp_path / "pool"), str(tmp_path / "work"), "3", "--sweep"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bad"] == []
    assert report["kills"] >= 4 * 15  # every operation of four saves
    assert report["loaded_old"] > 0 and report["loaded_new"] > 0


# --------------------------------------------------------------------------------------------------------------------
# Windows and sampling
# --------------------------------------------------------------------------------------------------------------------


def windowed_pool(**kwargs):
    pool = ExperiencePool(max_trajectories_per_task=3, experience_rbound=8, **kwargs)
    record(pool, "a", 2, [0.5, 0.4], version=1)  # store ranks 0, 1
    record(pool, "b", 1, [0.3], version=2)  # 2
    record(pool, "c", 3, [0.9, 0.2, 0.7], version=3)  # 3, 4, 5
    record(pool, "a", 1, [0.1], version=4)  # 6
    return pool


def test_replay_window_counts_the_most_recently_stored(tmp_path):
    pool = windowed_pool()
    ids = lambda ts: [t.traj_id for t in ts]  # noqa: E731
    assert ids(pool.candidates("a")) == [0, 1, 6]
    assert ids(pool.candidates("a", window=1)) == [6]
    assert ids(pool.candidates("c", window=3)) == [4, 5] and ids(pool.candidates("b", window=4)) == []
    assert pool.replayable_tasks(window=2) == [("c", 3), ("a", 1)]
    assert pool.replayable_tasks(window=5) == [("b", 1), ("c", 3), ("a", 1)]
    assert pool.replayable_tasks(2, window=5) == [("c", 3)]
    # with the age limit too: ages at step 4 are 3, 2, 1, 0 for versions 1..4
    assert pool.replayable_tasks(1, current_step=4, max_policy_age=1, window=5) == [("c", 3), ("a", 1)]
    assert pool.replayable_tasks(2, current_step=4, max_policy_age=1, window=3) == [("c", 3)]
    assert ids(pool.candidates("c", current_step=5, max_policy_age=1, window=2)) == []
    record(pool, "a", 4, num_fresh=4)  # evicted ones still count in the window
    assert pool.replayable_tasks(window=1) == []
    pool.save(str(tmp_path / "pool"))  # store ranks are saved with the trajectories
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    for window in (1, 2, 3, 5, None):
        assert loaded.replayable_tasks(window=window) == pool.replayable_tasks(window=window)
        assert ids(loaded.candidates("c", window=window)) == ids(pool.candidates("c", window=window))


@pytest.mark.parametrize(
    "mode, expected", [("argmin", {"a": 6, "b": 2, "c": 4}), ("argmax", {"a": 0, "b": 2, "c": 3})]
)
def test_choose_takes_each_tasks_best_trajectory_within_the_window_and_the_age_limit(mode, expected):
    pool = windowed_pool(exp_select_mode=mode)
    chosen = pool.choose(["a", "b", "c"], 1)
    assert {task: [t.traj_id for t in ts] for task, ts in chosen.items()} == {k: [v] for k, v in expected.items()}
    # window 2: the two most recently stored (5 of c, 6 of a); at step 4 with age 0, a's version 4 only
    windowed = pool.choose(["a", "c"], 1, window=2)
    assert [t.traj_id for ts in windowed.values() for t in ts] == [6, 5]
    assert [t.traj_id for t in pool.choose(["a"], 1, current_step=4, max_policy_age=0)["a"]] == [6]
    with pytest.raises(ValueError, match="Cannot select 1 trajectories out of 0 candidates"):
        pool.choose(["b"], 1, current_step=4, max_policy_age=0)  # b's only one is 2 versions old


# --------------------------------------------------------------------------------------------------------------------
# Loading: missing shards, tokenizer fingerprints, the first format
# --------------------------------------------------------------------------------------------------------------------


def test_a_missing_shard_is_a_clear_error_naming_it(tmp_path):
    pool = ExperiencePool(max_trajectories_per_task=5, experience_rbound=8, shard_rows=2)
    record(pool, "a", 2, [0.1, 0.2])  # first shard
    record(pool, "b", 2, [0.3, 0.4])  # second shard
    path = tmp_path / "pool"
    pool.save(str(path))
    first = sorted(n for n in files_of(path) if n.startswith("trajectories/"))[0]
    os.remove(path / first)
    with pytest.raises(PoolFormatError, match=f"{first}: cannot be read"):
        ExperiencePool.load(str(path))


def test_tokenizer_fingerprint_identifies_the_token_ids(tmp_path):
    words = ["go", "to", "desk", "shelf"]
    tokenizer = build_tiny_tokenizer(words)
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(build_tiny_tokenizer(words))
    tokenizer.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    reloaded.pad_token = reloaded.eos_token  # roles and padding do not change what an id means
    tokenizer(["go to desk", "go"], padding=True, truncation=True, max_length=2)
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(build_tiny_tokenizer(["go", "to", "shelf", "desk"])) != tokenizer_fingerprint(
        tokenizer
    )  # same words, other ids

    pool = ExperiencePool(experience_rbound=8)
    pool.bind_tokenizer(tokenizer_fingerprint(tokenizer))
    record(pool, "a", 1, [0.5])
    pool.save(str(tmp_path / "pool"))
    assert ExperiencePool.load(str(tmp_path / "pool"), tokenizer=reloaded).content_hash() == pool.content_hash()
    with pytest.raises(ValueError, match="recorded with another tokenizer"):
        ExperiencePool.load(str(tmp_path / "pool"), tokenizer=build_tiny_tokenizer(words[::-1]))
    with pytest.raises(ValueError, match="recorded with another tokenizer"):
        pool.bind_tokenizer(tokenizer_fingerprint(build_tiny_tokenizer(["other"])))


def test_a_first_format_pool_is_refused_clearly_on_load_and_save(tmp_path):
    """Format 1 (one `datasets` table and a JSON state) predates the first release: no loader reads it any more."""
    old = tmp_path / "old"
    old.mkdir()
    (old / STATE_FILE).write_text(json.dumps({"format_version": 1, "settings": {}, "num_trajectories": 0}))
    with pytest.raises(PoolFormatError, match=r"format_version 1 is not the one .* development format"):
        ExperiencePool.load(str(old))
    with pytest.raises(ValueError, match="Not saving into"):
        ExperiencePool().save(str(old))


def test_task_rows_are_stored_once_and_replaced_when_they_change(tmp_path):
    pool = ExperiencePool(experience_rbound=8, shard_rows=3)
    for _ in range(5):  # the trainer sends the same row with every outcome: one row in the log
        record(pool, "a", 1, task_row=row("a"))
    record(pool, "c", 1)
    record(pool, "d", 1)  # three rows: a shard
    pool.flush(wait=True)
    assert pool.storage_stats()["task_row_rows"] == 3
    record(pool, "a", 1, task_row=row("a", variant=2))  # a's row changes: a tombstone in the first shard
    record(pool, "b", 1)
    pool.flush(wait=True)
    assert pool.task_row("a") == json.loads(row("a", variant=2))
    stats = pool.storage_stats()
    assert (stats["task_row_rows"], stats["task_row_dead_rows"]) == (5, 1)
    pool.save(str(tmp_path / "pool"))
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    assert {t: loaded.task_row(t)["variant"] for t in "abcd"} == {"a": 2, "b": 0, "c": 0, "d": 0}
    for shard in (tmp_path / "pool" / "task_rows").iterdir():
        assert datasets.Dataset.from_file(str(shard)).features == datasets.Features.from_dict(TASK_ROW_FEATURES)


def test_a_pool_reads_the_files_it_mapped_even_if_a_saved_copy_is_replaced(tmp_path):
    pool = ExperiencePool(experience_rbound=8)
    record(pool, "a", 2, [0.1, 0.2])
    pool.save(str(tmp_path / "first"))
    loaded = ExperiencePool.load(str(tmp_path / "first"))
    want = loaded.candidates("a")
    loaded.save(str(tmp_path / "second"))  # now also a location of its shards, tried first
    (name,) = [n for n in files_of(tmp_path / "second") if n.startswith("trajectories/")]
    other = ExperiencePool(experience_rbound=8)
    record(other, "a", 2, [0.7, 0.8])
    other.save(str(tmp_path / "third"))
    (foreign,) = [n for n in files_of(tmp_path / "third") if n.startswith("trajectories/")]
    os.replace(tmp_path / "third" / foreign, tmp_path / "second" / name)  # another file under the same name
    assert loaded.candidates("a") == want and [t.entropy for t in want] == [f32(0.1), f32(0.2)]
    os.remove(tmp_path / "first" / name)  # no path to the mapped file left: read through the mapping
    assert loaded.candidates("a") == want


# --------------------------------------------------------------------------------------------------------------------
# The index without the rows (the trainer's ranks other than 0): the same decisions, no file
# --------------------------------------------------------------------------------------------------------------------


def fill_alike(pools, tasks="abcdefghij", version=0):
    """The same outcomes, in the same order, into every pool (as every rank records them)."""
    for task in tasks:
        for pool in pools:
            record(pool, task, 1, [0.5 - 0.01 * ord(task) - 0.001 * version], version=version)


def test_an_index_only_pool_decides_as_the_pool_it_copies_and_holds_no_row(tmp_path):
    holder = ExperiencePool(max_trajectories_per_task=2, experience_rbound=8, shard_rows=4, work_dir=str(tmp_path))
    fill_alike([holder], "abc")
    holder.add(traj("z", 0.3))
    holder._drop(holder.index.clear(holder.index.task("z")))  # a freed key: the copy must reuse it as the holder does
    snapshot = pickle.loads(pickle.dumps(holder.index_snapshot()))  # as `broadcast_object_list` sends it
    index_only = ExperiencePool.from_index_snapshot(snapshot)
    assert not index_only.holds_rows and holder.holds_rows
    assert index_only.index_hash() == holder.index_hash()
    for version in range(1, 4):  # evictions (tombstones, compactions on the holder) and new tasks
        fill_alike([holder, index_only], "abcdefghij"[: 3 + 2 * version], version)
        assert index_only.skip_set == holder.skip_set and index_only.buckets() == holder.buckets()
    assert index_only.index_hash() == holder.index_hash() and holder.num_trajectories == 16
    tasks = holder.stored_tasks()
    assert [index_only.index.keys(index_only.index.task(t)) for t in tasks] == [
        holder.index.keys(holder.index.task(t)) for t in tasks
    ]
    buckets = [pool.replay_buckets(2, 4, None, None) for pool in (index_only, holder)]
    assert [{d: m.tolist() for d, m in b.members.items()} for b in buckets] == [{1: [0, 1, 2, 4, 5, 6, 7, 8, 9]}] * 2
    assert [b.listing()[0].tolist() for b in buckets] == [[0, 1, 2, 4, 5, 6, 7]] * 2  # with 2 trajectories and a row
    assert index_only.stats() == holder.stats()
    assert [p.name for p in tmp_path.iterdir()] == [Path(holder.scratch_folder()).name]  # no folder of its own
    for read in (lambda: index_only.choose(["a"], 1), lambda: index_only.task_row("a"), index_only.content_hash):
        with pytest.raises(RuntimeError, match="holds its index only"):
            read()
    assert index_only.choose([], 1) == {}  # nothing to read
    holder.close()


@pytest.mark.parametrize("lag", [0.0, 0.01])
def test_evictions_racing_a_lagging_writer_thread_leave_the_same_pool(tmp_path, lag):
    """Evictions (tombstones) of rows the writer thread is still staging, sealing or compacting: whatever its timing,
    the pool holds what one without a writer lag holds, every tombstone counted once (a save checks the live rows of
    its shards against the index), and a load gives it back."""
    pools = [ExperiencePool(max_trajectories_per_task=1, experience_rbound=8, shard_rows=4, work_dir=str(tmp_path))
             for _ in range(2)]  # fmt: skip
    lagging = pools[1]
    for log in (lagging._trajectories, lagging._task_rows):
        build = log._build
        log._build = lambda items, build=build: (time.sleep(lag), build(items))[1]
    for version in range(6):  # each version evicts the previous one's trajectory of every task
        for task in "abcdefgh":
            for pool in pools:
                record(pool, task, 1, [0.9 - 0.1 * version - 0.001 * (ord(task) % 7)], version=version)
    for pool in pools:
        pool.flush(wait=True)
    stats = lagging.storage_stats()
    assert stats["trajectory_rows"] - stats["trajectory_dead_rows"] == lagging.num_trajectories == 8
    assert lagging.content_hash() == pools[0].content_hash()
    lagging.save(str(tmp_path / "saved"))
    assert ExperiencePool.load(str(tmp_path / "saved")).content_hash() == pools[0].content_hash()
    for pool in pools:
        pool.close()


def shard_files(pool) -> list[str]:
    return [p.name for p in Path(pool.scratch_folder()).rglob("*.arrow")]


def test_a_loaded_pool_numbers_its_new_files_after_the_loaded_ones(tmp_path):
    """A file's name is its place in the order of files and its checksum: a loaded pool goes on after the loaded files'
    places, so a new file never takes a loaded one's name (which the scratch folder holds as a link)."""
    pool = ExperiencePool(max_trajectories_per_task=2, experience_rbound=8, shard_rows=4, work_dir=str(tmp_path))
    fill_alike([pool], "abcdefgh")
    pool.save(str(tmp_path / "saved"))
    pool.close()
    loaded = ExperiencePool.load(str(tmp_path / "saved"), work_dir=str(tmp_path))
    numbers = {int(name.split("-")[1]) for name in shard_files(loaded) if name.startswith("traj-")}
    fill_alike([loaded], "ijklmnop", version=1)
    loaded.flush(wait=True)
    new = {int(name.split("-")[1]) for name in shard_files(loaded) if name.startswith("traj-")} - numbers
    assert numbers and new and min(new) > max(numbers)
    loaded.close()
