"""The experience pool's storage: `datasets` Arrow shards written on the calling thread, dead rows and compaction,
incremental and atomic saves (a writer process killed at random instants), sampling, tokenizer fingerprints.

Sizes here are tiny; `benchmarks/pool_scale.py` measures 10k to 1M trajectories.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
from helpers import kill_a_save_at_random, traj

from trl_exreplay.demo.tiny import build_tiny_tokenizer
from trl_exreplay.pool import ExperiencePool, TaskOutcome, store, tokenizer_fingerprint
from trl_exreplay.pool.check import PoolFormatError
from trl_exreplay.pool.persistence import STATE_FILE, read_state, state_files
from trl_exreplay.pool.store import (
    TRAJECTORY_FEATURES,
    TRAJECTORY_SCHEMA,
    Log,
    Scratch,
    read_arrow,
)

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
    return [t.entropy for t in pool.trajectories(task_id)]


def files_of(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def shards_of(path) -> set[str]:
    return {n for n in files_of(path) if n.startswith("trajectories-")}


def inode(path) -> int:
    return os.stat(path).st_ino


def rows_on_disk(folder) -> int:
    """Rows in the Arrow files of `folder`, read from the files themselves."""
    return sum(read_arrow(str(p)).num_rows for p in Path(folder).glob("*.arrow") if not p.name.startswith("tasks-"))


# --------------------------------------------------------------------------------------------------------------------
# Shards: real `datasets` Arrow files, written on the calling thread
# --------------------------------------------------------------------------------------------------------------------

# The columns of the trajectory shards: format 3's (state.json's format_version), less `store_seq` since format 6.
SHARD_COLUMNS = {
    "trajectories": {
        "task_id": "string",
        "prompt_ids": ["int32"],
        "completion_ids": ["int32"],
        "completion_mask": ["int8"],
        "logps": ["float32"],
        "rewards": ["float32"],
        "reward": "float32",
        "entropy": "float32",
        "policy_version": "int64",
        "traj_id": "int64",
    },
}


def test_the_trajectory_shards_schema_is_format_3s_less_the_store_rank_with_the_features_datasets_reads():
    """The schema (columns, types and the ``huggingface`` metadata `datasets` reads features from) is the one format
    3 wrote, less the store rank (format 6: it served only the removed replay window): `datasets.load_dataset` and the
    Hub viewer read a pool's trajectories as before (format 4 moved only the task rows, into the tasks table)."""
    for kind, features, schema in (("trajectories", TRAJECTORY_FEATURES, TRAJECTORY_SCHEMA),):
        columns = SHARD_COLUMNS[kind]
        arrow = {
            name: pa.list_(pa.type_for_alias(dtype[0])) if isinstance(dtype, list) else pa.type_for_alias(dtype)
            for name, dtype in columns.items()
        }
        assert [(field.name, field.type) for field in schema] == list(arrow.items())
        declared = {
            name: {"feature": {"dtype": dtype[0], "_type": "Value"}, "_type": "List"}
            if isinstance(dtype, list)
            else {"dtype": dtype, "_type": "Value"}
            for name, dtype in columns.items()
        }
        assert json.loads(schema.metadata[b"huggingface"]) == {"info": {"features": declared}}
        assert datasets.Features.from_arrow_schema(schema) == features == datasets.Features.from_dict(declared)


def test_shards_are_datasets_files_holding_exactly_the_flushed_rows(tmp_path):
    pool = ExperiencePool(
        replay_max_trajectories_per_task=5, replay_store_rbound=8, shard_rows=2, work_dir=str(tmp_path)
    )
    record(pool, "a", 3, [0.3, 0.2, 0.1], version=4)
    record(pool, "b", 2, [0.9, 0.8], version=5)
    pool.flush()
    stats = pool.storage_stats()
    assert (stats["trajectory_shards"], stats["trajectory_rows"], stats["trajectory_pending_rows"]) == (3, 5, 0)
    (scratch,) = [p for p in tmp_path.iterdir() if p.name.startswith("exreplay-pool-")]
    rows = []
    for shard in sorted(scratch.iterdir()):
        assert re.fullmatch(r"trajectories-[0-9a-f]{16}\.arrow", shard.name)
        table = datasets.Dataset.from_file(str(shard))  # memory-mapped by `datasets` itself
        assert table.features == TRAJECTORY_FEATURES
        rows += table.to_list()
    want = [t.__dict__ for t in pool.trajectories("a") + pool.trajectories("b")]
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
    }
    pool.close()
    assert not scratch.exists()  # the live pool's scratch shards go with it


def test_rows_are_pending_until_they_fill_a_shard_written_on_the_calling_thread(tmp_path, monkeypatch):
    """No writer thread: the add that brings the pending rows to `shard_rows` writes them as one file before it
    returns; the rows are readable all along, pending or written; `flush` writes the rest."""
    pool = ExperiencePool(
        replay_max_trajectories_per_task=10, replay_store_rbound=20, shard_rows=4, work_dir=str(tmp_path)
    )
    writes, write_arrow = [], store.write_arrow

    def recording(path, table):
        if os.path.basename(path).startswith("trajectories-"):  # not the task rows' shards
            writes.append((threading.current_thread(), table.num_rows))
        write_arrow(path, table)

    monkeypatch.setattr(store, "write_arrow", recording)
    record(pool, "a", 9, [0.1 * i for i in range(9)])
    assert writes == [(threading.current_thread(), 4)] * 2  # written while record_outcome ran
    stats = pool.storage_stats()
    assert (stats["trajectory_shards"], stats["trajectory_rows"], stats["trajectory_pending_rows"]) == (2, 8, 1)
    assert rows_on_disk(Path(pool.scratch_folder())) == 8
    assert entropies(pool, "a") == [f32(0.1 * i) for i in range(9)]  # 8 read from the files, 1 pending
    pool.flush()
    assert writes[2:] == [(threading.current_thread(), 1)]
    stats = pool.storage_stats()
    assert (stats["trajectory_shards"], stats["trajectory_rows"], stats["trajectory_pending_rows"]) == (3, 9, 0)
    assert entropies(pool, "a") == [f32(0.1 * i) for i in range(9)]  # now all read from the shards
    pool.flush()
    assert len(writes) == 3  # nothing pending: no empty shard


# --------------------------------------------------------------------------------------------------------------------
# Dead rows and compaction
# --------------------------------------------------------------------------------------------------------------------


def test_evicted_rows_stay_in_their_shard_until_compaction_removes_them(tmp_path):
    def build(flush):
        pool = ExperiencePool(
            replay_max_trajectories_per_task=1, replay_store_rbound=8, shard_rows=4, work_dir=str(tmp_path)
        )
        for task in "abcdefgh":  # two shards of four
            record(pool, task, 1, [0.5])
        if flush:
            pool.flush()
        return pool

    pool, unflushed = build(True), build(False)
    saved = tmp_path / "before-compaction"
    pool.save(str(saved))
    assert pool.storage_stats()["trajectory_dead_rows"] == 0
    for p in (pool, unflushed):
        record(p, "a", 1, [0.4], version=1)  # evicts a written row of the first shard: a dead row
    pool.flush()
    assert (pool.storage_stats()["trajectory_shards"], pool.storage_stats()["trajectory_dead_rows"]) == (3, 1)
    for p in (pool, unflushed):
        for task in "bc":
            record(p, task, 1, [0.3], version=2)
    pool.flush()  # the first shard is 3/4 dead now: its live row rewritten by this write's compaction, the rest kept
    stats = pool.storage_stats()
    assert (stats["trajectory_dead_rows"], stats["trajectory_rows"]) == (0, 8)
    assert rows_on_disk(Path(pool.scratch_folder())) == 8  # the rewritten shard's file is gone
    assert pool.content_hash() == unflushed.content_hash()  # storage layout is not content
    assert [entropies(pool, t) for t in "abcd"] == [[f32(0.4)], [f32(0.3)], [f32(0.3)], [f32(0.5)]]
    # the pool saved before the compaction is intact: it has its own links to the old shards
    assert ExperiencePool.load(str(saved)).content_hash() == build(False).content_hash()


def test_a_row_evicted_while_compactions_rewrite_it_twice_is_counted_once(tmp_path):
    """Random evictions while compactions rewrite shards that earlier compactions made: every dead row is counted
    once, wherever its row moved, or a save writes a state that its own check refuses (num_trajectories below the
    shards' live rows)."""
    pool = ExperiencePool(
        replay_max_trajectories_per_task=5,
        replay_store_rbound=8,
        replay_max_policy_age=1,
        shard_rows=64,
        work_dir=str(tmp_path),
    )  # each version's adds evict the stale trajectories: the whole pool turns over every ~1000 adds
    log, history = pool._trajectories, []
    compact = log.compact

    def recording(everything=True):  # the shard numbers each compaction removed and made
        before = set(log.shards)
        compact(everything)
        history.append((before - set(log.shards), set(log.shards) - before))

    log.compact = recording
    rng = np.random.default_rng(1)
    for task in range(200):
        record(pool, f"t{task}", 5, rng.random(5).tolist(), num_fresh=8)
    pool.save(str(tmp_path / "pool"))
    for version in range(1, 9):  # random evictions: dead rows everywhere, compactions of the compactions' shards
        for task in rng.integers(0, 200, 512).tolist():
            pool.add(traj(f"t{task}", float(rng.random()), version))
        pool.flush()
        pool.save(str(tmp_path / "pool"))  # its own check of the state it committed raised here
    made, recompacted = set(), 0
    for removed_now, made_now in history:
        recompacted += len(removed_now & made)
        made |= made_now
    assert recompacted > 0  # shards that a compaction made were compacted in turn
    assert ExperiencePool.load(str(tmp_path / "pool")).content_hash() == pool.content_hash()


NOTES = pa.schema([("text", pa.string())])


def note(text: str) -> pa.Table:
    return pa.table({"text": [text]}, schema=NOTES)


def notes_log(tmp_path, shard_rows=4):
    scratch = Scratch(str(tmp_path))
    return Log("notes", NOTES, scratch, shard_rows), scratch


def test_a_log_compacts_the_shards_more_dead_than_live_and_counts_a_moved_rows_death_in_its_new_shard(tmp_path):
    log, scratch = notes_log(tmp_path)
    for key, text in enumerate("abcdef"):
        log.put(key, note(text))
        log.write(if_full=True)  # "abcd": a shard; "ef" pending
    assert log.read([5, 0], ("text",)) == [{"text": "f"}, {"text": "a"}]  # pending or written alike
    first = log.shards[0].path
    log.delete(0)
    log.delete(1)  # half dead: not more dead than live, so kept
    log.write()  # "ef": a second shard
    assert log.stats() == {"shards": 2, "rows": 6, "dead_rows": 2, "pending_rows": 0} and os.path.exists(first)
    log.delete(2)  # one live row of four
    log.put(6, note("g"))
    log.write()  # "g": a third shard, then the compaction: "d" rewritten into a shard of its own, the old file gone
    assert not os.path.exists(first)
    assert log.stats() == {"shards": 3, "rows": 4, "dead_rows": 0, "pending_rows": 0}
    assert rows_on_disk(scratch.folder()) == 4
    assert log.read([6, 3, 5, 4, 3], ("text",)) == [{"text": t} for t in "gdfed"]
    log.delete(3)  # the moved row: a dead row of its new shard, not of the removed one
    assert log.stats() == {"shards": 3, "rows": 4, "dead_rows": 1, "pending_rows": 0}
    log.delete(5)  # "ef" half dead: kept by the compaction after a write ...
    log.compact()  # ... but not by an explicit one, which also drops the shard left with no live row
    assert log.stats() == {"shards": 2, "rows": 2, "dead_rows": 0, "pending_rows": 0}
    assert rows_on_disk(scratch.folder()) == 2
    assert log.read([4, 6], ("text",)) == [{"text": "e"}, {"text": "g"}]
    log.put(3, note("d again"))  # a freed key holds a new row
    assert log.read([3], ("text",)) == [{"text": "d again"}] and log.stats()["pending_rows"] == 1
    scratch.remove()


def test_explicit_compaction_and_skip_set_clears(tmp_path):
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=8, shard_rows=8)
    for task in "abc":
        record(pool, task, 3, [0.1, 0.2, 0.3])
    pool.flush()
    record(pool, "a", 4, num_fresh=4)  # fully solved: its three trajectories become dead rows
    pool.flush()
    assert pool.storage_stats()["trajectory_dead_rows"] == 3 and pool.num_trajectories == 6
    before = pool.content_hash()
    pool.compact()
    assert pool.storage_stats()["trajectory_dead_rows"] == 0 and pool.storage_stats()["trajectory_rows"] == 6
    assert pool.content_hash() == before


def test_under_eviction_churn_the_files_stay_within_twice_the_live_rows(tmp_path):
    """Thousands of adds into a pool of 20 trajectories (each evicting the oldest of its task), each outcome with a
    new task row replacing its task's last one: after every add, each log's written rows (and the rows of the files
    in the scratch folder) stay within twice its live rows plus one shard."""
    shard_rows = 8
    pool = ExperiencePool(
        replay_max_trajectories_per_task=2,
        replay_store_rbound=8,
        replay_select_mode="random",  # at capacity: the oldest goes, every time
        shard_rows=shard_rows,
        work_dir=str(tmp_path),
    )
    folder = Path(pool.scratch_folder())
    rng = np.random.default_rng(0)
    for step in range(1200):
        task = f"t{int(rng.integers(10))}"
        pool.record_outcome(TaskOutcome(task, 1, 4, [traj(task, float(rng.random()), step)], row(task, step)))
        stats = pool.storage_stats()
        assert stats["trajectory_rows"] <= 2 * pool.num_trajectories + shard_rows, (step, stats)
        if step % 100 == 99:  # the files themselves: compaction removes what it rewrote
            assert rows_on_disk(folder) == stats["trajectory_rows"]
    assert pool.num_trajectories == 20 and pool.index.next_traj_id == 1200  # the churn: 1180 evicted
    pool.save(str(tmp_path / "pool"))
    assert ExperiencePool.load(str(tmp_path / "pool")).content_hash() == pool.content_hash()
    assert rows_on_disk(tmp_path / "pool") <= 2 * 20 + shard_rows


def test_a_failed_write_in_a_compaction_loses_no_row(tmp_path, monkeypatch):
    def build(save):
        pool = ExperiencePool(
            replay_max_trajectories_per_task=1, replay_store_rbound=8, shard_rows=4, work_dir=str(tmp_path)
        )
        for task in "abcd":
            record(pool, task, 1, [0.5], task_row=None)  # one shard of four
        if save:
            pool.save(str(tmp_path / "pool"))
        for task in "abc":
            record(pool, task, 1, [0.4], version=1, task_row=None)  # three of its rows evicted, three pending
        return pool

    pool, twin = build(True), build(False)
    writes, write_arrow = [], store.write_arrow

    def full_disk_at_the_compaction(path, table):
        writes.append(path)
        if len(writes) == 2:  # the first writes the four pending rows, the second the compaction's row ("d")
            raise OSError(errno.ENOSPC, "No space left on device")
        write_arrow(path, table)

    monkeypatch.setattr(store, "write_arrow", full_disk_at_the_compaction)
    record(pool, "e", 1, [0.5], task_row=None)  # logged, not raised: the outcome is recorded whole
    assert len(writes) == 2  # the pending rows' shard was written, then the compaction's write failed
    monkeypatch.setattr(store, "write_arrow", write_arrow)
    record(twin, "e", 1, [0.5], task_row=None)
    assert entropies(pool, "d") == [f32(0.5)]
    assert pool.content_hash() == twin.content_hash()
    pool.save(str(tmp_path / "pool"))
    assert ExperiencePool.load(str(tmp_path / "pool")).content_hash() == twin.content_hash()


def test_a_save_compacts_the_shards_more_dead_than_live_even_with_no_row_pending(tmp_path):
    pool = ExperiencePool(
        replay_max_trajectories_per_task=2, replay_store_rbound=8, shard_rows=4, work_dir=str(tmp_path)
    )
    for task in "abcd":
        record(pool, task, 2, [0.5, 0.4], task_row=None)  # two shards of four
    for task in "abc":
        record(pool, task, 4, num_fresh=4, task_row=None)  # solved: six of the eight rows removed, none added
    pool.save(str(tmp_path / "pool"))  # "after each write, and before a save" (store.py)
    stats = pool.storage_stats()
    assert stats["trajectory_rows"] <= 2 * pool.num_trajectories == 4, stats
    assert rows_on_disk(tmp_path / "pool") <= 4


# --------------------------------------------------------------------------------------------------------------------
# Incremental, pruned, atomic saves
# --------------------------------------------------------------------------------------------------------------------


def test_saves_write_only_new_shards_and_share_the_others(tmp_path):
    pool = ExperiencePool(
        replay_max_trajectories_per_task=5, replay_store_rbound=8, shard_rows=4, work_dir=str(tmp_path)
    )
    for task in "abcdef":
        record(pool, task, 1, [0.5])
    first, second = tmp_path / "checkpoint-1" / "pool", tmp_path / "checkpoint-2" / "pool"
    pool.save(str(first))
    record(pool, "g", 1, [0.5])
    pool.save(str(second))
    old, new = shards_of(first), shards_of(second)
    assert old < new and len(new - old) == 1  # one new trajectory shard
    for name in old:  # the very same files: hard links, nothing rewritten
        assert inode(first / name) == inode(second / name) and os.stat(second / name).st_nlink >= 3
    hashes = {"second": pool.content_hash()}
    shutil.rmtree(tmp_path / "checkpoint-1")  # rotation deletes the older checkpoint
    assert ExperiencePool.load(str(second)).content_hash() == hashes["second"]

    # saving again into the same folder: the shards it has are left untouched, only new files appear
    mtimes = {name: (os.stat(second / name).st_mtime_ns, inode(second / name)) for name in new}
    record(pool, "h", 1, [0.5])
    pool.save(str(second))
    for name in new:
        assert (os.stat(second / name).st_mtime_ns, inode(second / name)) == mtimes[name]
    assert files_of(second) == sorted(state_files(read_state(str(second))))  # the old tasks table was pruned
    assert ExperiencePool.load(str(second)).content_hash() == pool.content_hash()


def no_links_between(monkeypatch, work):
    """Hard links between `work` and the rest of the disk fail as across two file systems."""
    link = os.link

    def across_file_systems(source, dest, *args, **kwargs):
        if str(source).startswith(str(work)) != str(dest).startswith(str(work)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return link(source, dest, *args, **kwargs)

    monkeypatch.setattr(os, "link", across_file_systems)


def test_with_the_scratch_folder_on_another_file_system_a_checkpoint_copies_only_new_shards(tmp_path, monkeypatch):
    """Scratch folder on a local disk, checkpoints on another file system: the first save copies the shards (written
    from their mappings: the scratch files' bytes), and each later checkpoint hard-links the ones the previous
    checkpoint holds, copying only the new ones; a save into a folder that has a shard leaves it untouched."""
    work = tmp_path / "work"
    no_links_between(monkeypatch, work)
    pool = ExperiencePool(replay_max_trajectories_per_task=5, replay_store_rbound=8, shard_rows=4, work_dir=str(work))
    for task in "abcdef":
        record(pool, task, 2, [0.5, 0.4])
    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    pool.save(str(first))
    scratch = Path(pool.scratch_folder())
    old = shards_of(first)
    assert all(
        (first / n).read_bytes() == (scratch / n).read_bytes() and os.stat(first / n).st_nlink == 1 for n in old
    )
    stamps = {n: (inode(first / n), os.stat(first / n).st_mtime_ns) for n in old}
    pool.save(str(first))  # again: nothing new to write
    assert {n: (inode(first / n), os.stat(first / n).st_mtime_ns) for n in old} == stamps
    record(pool, "g", 2, [0.5, 0.4])
    pool.save(str(second))
    new = shards_of(second)
    assert old < new
    assert all(inode(first / n) == inode(second / n) for n in old)  # linked from the previous checkpoint
    assert all(os.stat(second / n).st_nlink == 1 for n in new - old)  # copied from the scratch folder
    shutil.rmtree(first)  # rotated away
    pool.save(str(tmp_path / "checkpoint-3"))
    assert all(inode(second / n) == inode(tmp_path / "checkpoint-3" / n) for n in new)
    assert ExperiencePool.load(str(tmp_path / "checkpoint-3")).content_hash() == pool.content_hash()


def test_a_loaded_pool_outside_the_scratch_file_system_links_each_save_from_the_last(tmp_path, monkeypatch):
    """Where no hard link into the scratch folder can be made (another file system), a loaded shard stays mapped
    from the loaded folder, and each save links it from the previous save's copy: once TRL rotates the loaded
    checkpoint away, no save writes its rows again (until every copy is gone: then from the mapping, as the same
    bytes)."""
    pool = ExperiencePool(replay_max_trajectories_per_task=5, replay_store_rbound=8, shard_rows=4)
    for task in "abcdef":
        record(pool, task, 2, [0.5, 0.4])
    pool.save(str(tmp_path / "a"))
    want, saved = pool.content_hash(), {n: (tmp_path / "a" / n).read_bytes() for n in shards_of(tmp_path / "a")}
    pool.close()
    work = tmp_path / "work"
    no_links_between(monkeypatch, work)
    loaded = ExperiencePool.load(str(tmp_path / "a"), work_dir=str(work))
    assert all(s.path.startswith(str(tmp_path / "a")) for s in loaded._trajectories.shards.values())
    assert loaded.content_hash() == want
    loaded.save(str(tmp_path / "b"))
    shutil.rmtree(tmp_path / "a")  # rotated away
    loaded.save(str(tmp_path / "c"))
    assert set(saved) == shards_of(tmp_path / "c")
    assert all(inode(tmp_path / "c" / n) == inode(tmp_path / "b" / n) for n in saved)
    assert loaded.content_hash() == want
    assert ExperiencePool.load(str(tmp_path / "c")).content_hash() == want
    for name in ("b", "c"):  # every copy gone: the rows are written again from the mappings, as the same bytes
        shutil.rmtree(tmp_path / name)
    loaded.save(str(tmp_path / "d"))
    assert {n: (tmp_path / "d" / n).read_bytes() for n in shards_of(tmp_path / "d")} == saved
    assert all(os.stat(tmp_path / "d" / n).st_nlink == 1 for n in saved)
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
# Sampling
# --------------------------------------------------------------------------------------------------------------------


def sampled_pool(**kwargs):
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=8, **kwargs)
    record(pool, "a", 2, [0.5, 0.4], version=1)  # ids 0, 1
    record(pool, "b", 1, [0.3], version=2)  # 2
    record(pool, "c", 3, [0.9, 0.2, 0.7], version=3)  # 3, 4, 5
    record(pool, "a", 1, [0.1], version=4)  # 6
    return pool


@pytest.mark.parametrize(
    "mode, expected", [("argmin", {"a": 6, "b": 2, "c": 4}), ("argmax", {"a": 0, "b": 2, "c": 3})]
)
def test_choose_takes_each_tasks_best_trajectory_within_the_age_limit(mode, expected):
    pool = sampled_pool(replay_select_mode=mode)
    chosen = pool.select(["a", "b", "c"], 1)
    assert {task: [t.traj_id for t in ts] for task, ts in chosen.items()} == {k: [v] for k, v in expected.items()}
    # at step 4 with age 0, a's version 4 only
    assert [t.traj_id for t in pool.select(["a"], 1, current_step=4, max_policy_age=0)["a"]] == [6]
    with pytest.raises(ValueError, match="Cannot select 1 trajectories out of 0 candidates"):
        pool.select(["b"], 1, current_step=4, max_policy_age=0)  # b's only one is 2 versions old


# --------------------------------------------------------------------------------------------------------------------
# Loading: missing shards, tokenizer fingerprints, the first format
# --------------------------------------------------------------------------------------------------------------------


def test_a_missing_shard_is_a_clear_error_naming_it(tmp_path):
    pool = ExperiencePool(replay_max_trajectories_per_task=5, replay_store_rbound=8, shard_rows=2)
    record(pool, "a", 2, [0.1, 0.2])  # first shard
    record(pool, "b", 2, [0.3, 0.4])  # second shard
    path = tmp_path / "pool"
    pool.save(str(path))
    first = sorted(n for n in files_of(path) if n.startswith("trajectories-"))[0]
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

    pool = ExperiencePool(replay_store_rbound=8)
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
    with pytest.raises(PoolFormatError, match=r"format_version 1 is not 7, the one .* development formats"):
        ExperiencePool.load(str(old))
    with pytest.raises(ValueError, match="Not saving into"):
        ExperiencePool().save(str(old))


def test_a_tasks_row_is_its_latest_and_is_saved_in_the_tasks_table(tmp_path):
    pool = ExperiencePool(replay_store_rbound=8, shard_rows=3)
    for variant in (0, 0, 1):
        record(pool, "a", 1, [0.5], task_row=row("a", variant=variant))
    record(pool, "b", 1, [0.5])
    record(pool, "c", 1, [0.5], task_row=None)  # a row that is not JSON-serializable is sent as None: no row
    assert pool.task_row("a") == json.loads(row("a", variant=1)) and pool.task_row("c") is None
    assert [task for task, _ in pool.replayable_tasks()] == ["a", "b"]  # a task without a row cannot roll out again
    pool.save(str(tmp_path / "pool"))
    state = read_state(str(tmp_path / "pool"))
    assert sorted(os.listdir(tmp_path / "pool")) == sorted(state_files(state))
    tasks = tmp_path / "pool" / state["tasks"]["name"]
    assert read_arrow(str(tasks)).column("task_row").to_pylist() == [row("a", variant=1), row("b"), None]
    loaded = ExperiencePool.load(str(tmp_path / "pool"))
    assert {t: loaded.task_row(t) for t in "abc"} == {t: pool.task_row(t) for t in "abc"}
    assert loaded.content_hash() == pool.content_hash()


@pytest.mark.parametrize("into_scratch", [True, False])
def test_a_pool_reads_the_files_it_mapped_even_if_a_saved_copy_is_replaced(tmp_path, monkeypatch, into_scratch):
    """A loaded pool reads its rows through its mappings, whatever becomes of the files' names: another file put
    under a name (or the name removed) changes no row it reads or saves. Without links into the scratch folder
    (`into_scratch` False: another file system) the mapped file's name is in the loaded folder itself."""
    pool = ExperiencePool(replay_store_rbound=8)
    record(pool, "a", 2, [0.1, 0.2])
    pool.save(str(tmp_path / "first"))
    if not into_scratch:
        no_links_between(monkeypatch, tmp_path / "work")
    loaded = ExperiencePool.load(str(tmp_path / "first"), work_dir=str(tmp_path / "work"))
    want, digest = loaded.trajectories("a"), loaded.content_hash()
    assert [t.entropy for t in want] == [f32(0.1), f32(0.2)]
    (shard,) = loaded._trajectories.shards.values()
    assert shard.path.startswith(str(tmp_path / ("work" if into_scratch else "first")))
    loaded.save(str(tmp_path / "second"))
    (name,) = [n for n in files_of(tmp_path / "second") if n.startswith("trajectories-")]
    other = ExperiencePool(replay_store_rbound=8)
    record(other, "a", 2, [0.7, 0.8])
    other.save(str(tmp_path / "third"))
    (foreign,) = [n for n in files_of(tmp_path / "third") if n.startswith("trajectories-")]
    for folder in ("first", "second"):  # another file under the saved names (one is the mapped file's, unlinked)
        shutil.copyfile(tmp_path / "third" / foreign, tmp_path / "third.arrow")
        os.replace(tmp_path / "third.arrow", tmp_path / folder / name)
    assert os.path.exists(shard.path) and loaded.trajectories("a") == want
    loaded.save(str(tmp_path / "fourth"))  # the mapped rows, not the file now under their name
    assert ExperiencePool.load(str(tmp_path / "fourth")).content_hash() == digest
    os.remove(shard.path)  # no name left for the mapped file: read through the mapping
    assert loaded.trajectories("a") == want
    loaded.save(str(tmp_path / "fifth"))
    assert ExperiencePool.load(str(tmp_path / "fifth")).content_hash() == digest == loaded.content_hash()


# --------------------------------------------------------------------------------------------------------------------
# The index without the rows (the trainer's ranks other than 0): the same decisions, no file
# --------------------------------------------------------------------------------------------------------------------


def fill_alike(pools, tasks="abcdefghij", version=0):
    """The same outcomes, in the same order, into every pool (as every rank records them)."""
    for task in tasks:
        for pool in pools:
            record(pool, task, 1, [0.5 - 0.01 * ord(task) - 0.001 * version], version=version)


def index_only_copy(tmp_path):
    holder = ExperiencePool(
        replay_max_trajectories_per_task=2, replay_store_rbound=8, shard_rows=4, work_dir=str(tmp_path)
    )
    fill_alike([holder], "abc")
    holder.add(traj("z", 0.3))
    holder._drop(holder.index.clear(holder.index.task("z")))  # a freed key: the copy must reuse it as the holder does
    snapshot = pickle.loads(pickle.dumps(holder.index_snapshot()))  # as `broadcast_object_list` sends it
    return holder, ExperiencePool.from_index_snapshot(snapshot)


def test_an_index_only_pool_decides_as_the_pool_it_copies_and_holds_no_row(tmp_path):
    holder, index_only = index_only_copy(tmp_path)
    assert not index_only.holds_rows and holder.holds_rows
    assert index_only.index_hash() == holder.index_hash() and index_only.index.free_keys == holder.index.free_keys
    for version in range(1, 4):  # evictions (dead rows, compactions on the holder) and new tasks
        fill_alike([holder, index_only], "abcdefghij"[: 3 + 2 * version], version)
        assert index_only.skip_set == holder.skip_set and index_only.buckets() == holder.buckets()
    assert index_only.index_hash() == holder.index_hash() and holder.num_trajectories == 16
    assert holder.index.num_keys < holder.index.next_traj_id  # the keys of evicted trajectories were handed out again
    tasks = holder.stored_tasks()
    assert [index_only.index.keys(index_only.index.task(t)) for t in tasks] == [
        holder.index.keys(holder.index.task(t)) for t in tasks
    ]
    assert (index_only.index.num_keys, index_only.index.free_keys) == (holder.index.num_keys, holder.index.free_keys)
    buckets = [pool.replay_buckets(2, 4, None) for pool in (index_only, holder)]
    assert [{d: m.tolist() for d, m in b.members.items()} for b in buckets] == [{1: [0, 1, 2, 4, 5, 6, 7, 8, 9]}] * 2
    assert [b.listing()[0].tolist() for b in buckets] == [[0, 1, 2, 4, 5, 6, 7]] * 2  # with 2 trajectories and a row
    assert index_only.stats() == holder.stats()
    assert index_only.scratch_folder() is None and index_only._trajectories is None
    assert index_only.storage_stats() == {}  # no log: no shard, no row
    assert index_only.select([], 1) == {}  # nothing to read
    index_only.flush()  # nothing to write
    index_only.compact()
    assert [p.name for p in tmp_path.iterdir()] == [Path(holder.scratch_folder()).name]  # no folder of its own
    with pytest.raises(RuntimeError, match="holds the index only"):
        index_only.save(str(tmp_path / "saved"))
    assert not (tmp_path / "saved").exists()
    holder.close()


def test_an_index_only_pool_refuses_reads_clearly(tmp_path):
    holder, index_only = index_only_copy(tmp_path)
    for read in (lambda: index_only.select(["a"], 1), lambda: index_only.task_row("a"), index_only.content_hash):
        with pytest.raises(RuntimeError, match="holds (its|the) index only"):
            read()
    holder.close()


def test_a_loaded_pool_names_its_new_files_apart_from_the_loaded_ones(tmp_path):
    """A loaded pool's scratch folder holds links to the loaded files under their names: the files it writes after
    take other names, and the loaded ones stay the very files (and bytes) the saved pool has."""
    pool = ExperiencePool(
        replay_max_trajectories_per_task=2, replay_store_rbound=8, shard_rows=4, work_dir=str(tmp_path)
    )
    fill_alike([pool], "abcdefgh")
    pool.save(str(tmp_path / "saved"))
    pool.close()
    loaded = ExperiencePool.load(str(tmp_path / "saved"), work_dir=str(tmp_path))
    scratch = Path(loaded.scratch_folder())
    linked = {p.name: inode(p) for p in scratch.glob("*.arrow")}
    assert set(linked) == shards_of(tmp_path / "saved")
    assert all(linked[name] == inode(tmp_path / "saved" / name) for name in linked)  # links, not copies
    fill_alike([loaded], "ijklmnop", version=1)
    loaded.flush()
    new = {str(p.relative_to(scratch)) for p in scratch.rglob("*.arrow")} - set(linked)
    assert new and all(re.fullmatch(r"trajectories-[0-9a-f]{16}\.arrow", name) for name in new)
    assert {name: inode(scratch / name) for name in linked} == linked
    assert ExperiencePool.load(str(tmp_path / "saved")).rejected_rows == 0
    loaded.save(str(tmp_path / "saved"))
    assert ExperiencePool.load(str(tmp_path / "saved")).content_hash() == loaded.content_hash()
    loaded.close()
