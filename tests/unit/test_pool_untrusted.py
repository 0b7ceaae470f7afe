"""A saved pool folder crafted by someone who can write it (issue 71): each file it names is rewritten and the pool
resealed (`reseal_pool`: sizes and checksums recomputed), so that what is refused here is the check behind the
checksums. Every case is a `PoolFormatError` naming the file and the field; none loads as other data."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest
from helpers import load_script, reseal_pool

from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory
from trl_exreplay.pool.check import PoolFormatError, file_checksum, state_checksum
from trl_exreplay.pool.persistence import read_state
from trl_exreplay.pool.store import TRAJECTORY_SCHEMA, read_arrow

FINGERPRINT = "0" * 64


def trajectory(task: str, entropy: float) -> Trajectory:
    return Trajectory(task, [1, 2], [3, 4], [1, 1], [-0.5, -0.25], [1.0], 1.0, entropy, policy_version=0)


def saved_pool(path) -> ExperiencePool:
    """Tasks a (3 trajectories, one more evicted from a written shard), b (1) and c (2), ids 0-6."""
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=4, shard_rows=2)
    pool.bind_tokenizer(FINGERPRINT)
    for task, entropies in (("a", (0.1, 0.2)), ("b", (0.3,)), ("c", (0.4, 0.5)), ("a", (0.05, 0.06))):
        successes = [trajectory(task, e) for e in entropies]
        pool.record_outcome(TaskOutcome(task, len(successes), 4, successes, task_row=json.dumps({"p": task})))
    assert pool.index.next_traj_id == 7 and pool.num_trajectories == 6  # a's 0.2 (id 1) evicted
    pool.save(str(path))
    return pool


def edit_state(path, edit, reseal: bool = True) -> None:
    """`edit(state)` of the pool's ``state.json``, then the pool resealed (with `reseal`) or the state's checksum."""
    with open(path / "state.json") as f:
        state = json.load(f)
    edit(state)
    state["checksum"] = state_checksum(state)
    with open(path / "state.json", "w") as f:
        json.dump(state, f)
    if reseal:
        reseal_pool(str(path))


def shards(path) -> list[str]:
    return [entry["name"] for entry in read_state(str(path))["shards"]]


def tasks_file(path) -> str:
    return read_state(str(path))["tasks"]["name"]


def rewrite(file, table: pa.Table, options: pa.ipc.IpcWriteOptions | None = None) -> None:
    """`file` replaced by a new file holding `table` (never written through: a live pool may map it)."""
    os.remove(file)
    with pa.OSFile(str(file), "wb") as sink, pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)


def edit_rows(path, edit) -> None:
    """Each shard's rows replaced by `edit(rows)`, then the pool resealed."""
    for name in shards(path):
        rows = edit(read_arrow(str(path / name)).to_pylist())
        rewrite(path / name, pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA))
    reseal_pool(str(path))


# ------------------------------------------------------------------------------------ 1: the Hub cache's blobs
def hub_snapshot(tmp_path, pool_dir, blobs_target):
    """The files of the pool at `pool_dir` as a Hub cache snapshot ``<repo>/snapshots/abc``, each a link to a copy
    outside the cache, and ``<repo>/blobs`` a link to `blobs_target` (a folder holding those copies)."""
    repo = tmp_path / "cache" / "datasets--me--pool"
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for file in sorted(pool_dir.iterdir()):
        (elsewhere / file.name).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(elsewhere / file.name)
    (repo / "blobs").symlink_to(blobs_target)
    return snapshot


@pytest.mark.parametrize("blobs", ["/", "the folder above the files"])
def test_a_hub_snapshot_whose_blobs_is_a_link_lets_no_file_resolve_outside(tmp_path, blobs):
    saved_pool(tmp_path / "pool")
    snapshot = hub_snapshot(tmp_path, tmp_path / "pool", "/" if blobs == "/" else tmp_path)
    with pytest.raises(
        PoolFormatError, match=r"snapshots/abc/state.json: resolves to .*elsewhere/state.json.*outside"
    ):
        ExperiencePool.load(str(snapshot))


def test_a_hub_snapshot_is_found_from_its_real_path(tmp_path):
    """Given through a link, the snapshot's real ``<repo>/blobs`` (a folder) is still where its files may lead."""
    pool = saved_pool(tmp_path / "pool")
    repo = tmp_path / "cache" / "datasets--me--pool"
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(sorted((tmp_path / "pool").iterdir())):
        (repo / "blobs" / str(i)).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.join("..", "..", "blobs", str(i)))  # relative, as the Hub's
    (tmp_path / "latest").symlink_to(snapshot)
    assert ExperiencePool.load(str(tmp_path / "latest")).content_hash() == pool.content_hash()


def test_a_link_out_is_named_printably_whatever_its_bytes(tmp_path):
    saved_pool(tmp_path / "pool")
    shard = tmp_path / "pool" / shards(tmp_path / "pool")[0]
    target = os.path.join(os.fsencode(tmp_path), b"out-\xff.arrow")
    with open(target, "wb") as f:
        f.write(shard.read_bytes())
    shard.unlink()
    os.symlink(target, os.fsencode(shard))
    with pytest.raises(PoolFormatError, match="outside the pool folder") as error:
        ExperiencePool.load(str(tmp_path / "pool"))
    assert "out-\\udcff.arrow" in str(error.value)
    str(error.value).encode("utf-8")  # a log file or a terminal can write it


# ------------------------------------------------------------------ 2: format 5's store ranks (issue 72: removed)
def with_store_ranks(path) -> None:
    """Each shard given format 5's `store_seq` column (the rank of a trajectory among all ever stored), resealed."""
    for name in shards(path):
        table = read_arrow(str(path / name))
        ranks = pa.array(table.column("traj_id").to_numpy(), pa.int64())
        rewrite(path / name, table.append_column("store_seq", ranks))
    reseal_pool(str(path))


def test_a_format_5_pool_is_refused_naming_its_state_and_the_format_this_version_reads(tmp_path):
    """Format 5 recorded store ranks for the replay window (issue 72 removed both): its pools are refused whole, by
    their state, before any file is mapped."""
    path = tmp_path / "pool"
    saved_pool(path)
    with_store_ranks(path)
    edit_state(path, lambda s: (s.update(format_version=5), s["counters"].update(stored_count=7)))
    with pytest.raises(
        PoolFormatError,
        match=r"pool/state\.json: format_version 5 is not 7, the one this version of trl_exreplay reads",
    ):
        ExperiencePool.load(str(path))


@pytest.mark.parametrize("case", ["a store_seq column", "counters.stored_count", "settings.replay_window"])
def test_format_5s_store_ranks_or_window_in_a_pool_are_refused_naming_the_file(tmp_path, case):
    path = tmp_path / "pool"
    saved_pool(path)
    if case == "a store_seq column":
        with_store_ranks(path)
        match = r"trajectories-[0-9a-f]{16}\.arrow: columns .* are not the expected"
    elif case == "counters.stored_count":
        edit_state(path, lambda s: s["counters"].update(stored_count=7))
        match = r"state\.json: `counters` holds unknown fields \['stored_count'\]; allowed: \['next_traj_id'"
    else:
        edit_state(path, lambda s: s["settings"].update(replay_window=None))
        match = (
            r"state\.json: `settings` holds unknown fields \['replay_window'\]; allowed: \['replay_max_trajectories"
        )
    with pytest.raises(PoolFormatError, match=match):
        ExperiencePool.load(str(path))


# --------------------------------------------------------- 2b: format 6's setting names (ExGRPO's; issue 72: the config's)
def test_a_format_6_pool_is_refused_naming_its_state_and_the_format_this_version_reads(tmp_path):
    """Format 6 named its settings as ExGRPO's keys (`experience_rbound`, ...): its pools are refused whole, by their
    state; the same names in a format-7 state are refused naming the fields allowed."""
    path = tmp_path / "pool"
    saved_pool(path)
    former = {"replay_max_trajectories_per_task": "max_trajectories_per_task", "replay_store_lbound": "experience_lbound",
              "replay_store_rbound": "experience_rbound", "replay_select_mode": "exp_select_mode",
              "replay_store_mode": "pool_store_mode", "replay_max_policy_age": "max_policy_age"}  # fmt: skip

    def format_6(state):
        state["settings"] = {former.get(name, name): value for name, value in state["settings"].items()}

    edit_state(path, format_6)
    with pytest.raises(PoolFormatError, match=r"unknown fields \['exp_select_mode', 'experience_lbound'"):
        ExperiencePool.load(str(path))
    edit_state(path, lambda s: s.update(format_version=6))
    with pytest.raises(PoolFormatError, match=r"pool/state\.json: format_version 6 is not 7, the one this version"):
        ExperiencePool.load(str(path))


# ------------------------------------------------------------------------------------ 3: names that are not UTF-8
@pytest.mark.parametrize(
    "which, column, nested",
    [("tasks", "task_id", False), ("tasks", "traj_ids", True), ("shard", "prompt_ids", False),
     ("shard", "logps", True)],
)  # fmt: skip
def test_a_column_name_that_is_not_utf8_is_refused_naming_the_file(tmp_path, which, column, nested):
    path = tmp_path / "pool"
    saved_pool(path)
    file = path / (tasks_file(path) if which == "tasks" else shards(path)[0])
    fuzz = load_script("benchmarks/pool_fuzz.py", "pool_fuzz")  # (its writer of such names)
    fuzz.write_with_raw_name(str(file), read_arrow(str(file)), column, b"\xff\xfe\x80" + b"z" * 4, nested)
    reseal_pool(str(path))
    # a nested name is read with U+FFFD in place of its bytes: not the expected type
    problem = "columns .*list<\ufffd+zzzz: .* are not the expected" if nested else "a column name is not UTF-8"
    with pytest.raises(PoolFormatError, match=f"{file.name}: (?s:{problem})"):
        ExperiencePool.load(str(path))


# ------------------------------------------------------------------------ 4 and the rest: every field of the state
@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda s: s.pop("tokenizer_fingerprint"), r"the state lacks the fields \['tokenizer_fingerprint'\]"),
        (lambda s: s.update(note="hi"), r"the state holds unknown fields \['note'\]"),
        (lambda s: s["counters"].update(evicted=3), r"`counters` holds unknown fields \['evicted'\]"),
        (lambda s: s["tasks"].update(live=9), r"`tasks` holds unknown fields \['live'\]"),
        (lambda s: s["shards"][1].update(sha256="x"), r"`shards\[1\]` holds unknown fields \['sha256'\]"),
        (lambda s: s["shards"][0].pop("live"), r"`shards\[0\]` lacks the fields \['live'\]"),
    ],
)
def test_a_state_must_hold_exactly_the_fields_a_save_writes(tmp_path, edit, problem):
    path = tmp_path / "pool"
    saved_pool(path)
    edit_state(path, edit)
    with pytest.raises(PoolFormatError, match=f"state.json: {problem}"):
        ExperiencePool.load(str(path))


@pytest.mark.parametrize("capacity", [2**31, 2**62])
def test_a_capacity_past_what_a_task_can_count_is_refused(tmp_path, capacity):
    path = tmp_path / "pool"
    saved_pool(path)
    edit_state(path, lambda s: s["settings"].update(replay_max_trajectories_per_task=capacity))
    with pytest.raises(
        PoolFormatError, match=r"`settings.replay_max_trajectories_per_task` must be an integer in \[1, "
    ):
        ExperiencePool.load(str(path))


def test_the_index_takes_memory_by_the_lists_it_holds_not_by_the_capacity(tmp_path):
    path = tmp_path / "pool"
    pool = saved_pool(path)
    edit_state(path, lambda s: s["settings"].update(replay_max_trajectories_per_task=2**31 - 1))
    loaded = ExperiencePool.load(str(path))  # a tasks x capacity matrix would be 2 TB
    assert loaded.index.slots.nbytes < 1 << 20
    assert [loaded.trajectories(t) for t in "abc"] == [pool.trajectories(t) for t in "abc"]
    for entropy in (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07):  # a's list grows past its first slots
        loaded.add(trajectory("a", entropy))
    assert len(loaded.trajectories("a")) == 10 and loaded.index.slots.nbytes < 1 << 20
    big = ExperiencePool(replay_max_trajectories_per_task=10**9)  # the same in code
    big.add(trajectory("a", 0.5))
    assert big.index.slots.nbytes < 1 << 20
    ten = ExperiencePool(replay_max_trajectories_per_task=10)  # 8 slots at first, then up to the capacity, not 16
    for entropy in range(12):
        ten.add(trajectory("a", -entropy))
    assert ten.index.slots.shape[1] == 10 and len(ten.trajectories("a")) == 10
    ten.configure(replay_max_trajectories_per_task=12)
    ten.add(trajectory("a", -20.0))
    assert ten.index.slots.shape[1] == 12 and len(ten.trajectories("a")) == 11


@pytest.mark.parametrize("which", ["tasks", "shard"])
@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_arrow_file_is_refused_before_it_is_decompressed(tmp_path, which, codec):
    """The pool never writes compressed buffers, and a few KB of them can decompress to GBs."""
    path = tmp_path / "pool"
    saved_pool(path)
    file = path / (tasks_file(path) if which == "tasks" else shards(path)[0])
    rewrite(file, read_arrow(str(file)), pa.ipc.IpcWriteOptions(compression=codec))

    def record(state):  # the new file's size and checksum (`reseal_pool` would read its rows with the pool's reader)
        for entry in [state["tasks"], *state["shards"]]:
            if entry["name"] == file.name:
                entry.update(size=file.stat().st_size, xxh3_64=file_checksum(str(file)))

    edit_state(path, record, reseal=False)
    with pytest.raises(PoolFormatError, match=f"{file.name}: holds a record batch message that is compressed"):
        ExperiencePool.load(str(path))


def test_the_fuzz_finds_no_escape_crash_silent_difference_or_unclear_error_in_these_kinds():
    fuzz = load_script("benchmarks/pool_fuzz.py", "pool_fuzz")
    kinds = "hub_layout,non_utf8_names,state_fields,capacity,compressed"
    result = fuzz.main(["--kinds", kinds, "--mutations", "60", "--seed", "71"])
    bad = ("signals", "silent_differences", "unclear_errors", "hangs", "escapes")
    assert {k: result[k] for k in bad} == dict.fromkeys(bad, 0), result["bad_cases"]
    assert result["clear_errors"] >= 50 and result["unchanged"] >= 1  # a real download's layout loads
