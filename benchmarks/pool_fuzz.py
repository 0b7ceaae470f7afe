"""Fuzz the loading of a saved experience pool: no damage may crash the process or be read as other data.

Saves a small pool twice (a format-5 folder: ``state.json``, a tasks table with task rows and each task's trajectory
ids, trajectory shards, one holding an evicted row; a tokenizer fingerprint), then
applies random mutations to copies of its folder, each loaded (with the tokenizer and the model's vocabulary size),
read and hashed in a forked child process (`os.fork`: no interpreter start per mutation), and classifies each:

* ``signals``: the child died of a signal (segfault, bus error, abort): never acceptable;
* ``silent_differences``: it loaded, rejected no row, and its content or its replay read differ from the saved pool's:
  other data read as if it were the pool: never acceptable;
* ``clear_errors``: it refused with a `PoolFormatError`, or a `ValueError` / `FileNotFoundError` naming the pool;
* ``counted_rejections``: it loaded with rows refused and counted (``rejected_rows > 0``);
* ``unchanged``: it loaded the very same pool (the mutation touched nothing it reads);
* ``unclear_errors``: any other exception (a raw `KeyError`, an Arrow error without a file name...);
* ``hangs``: the child ran past ``--timeout``;
* ``escapes``: a case whose files lead out of the pool folder loaded, or passed `push_pool`'s check of the folder
  (it would have uploaded them): never acceptable, whatever the bytes read.

Mutations: byte flips, truncations, appended bytes, swapped files, edits of ``state.json`` (kept as edited, so its
checksum no longer matches, or resealed with fresh checksums as a careful attacker would: then only values no pool
can have are edited: a shard listed twice or dropped, ``live`` above ``rows``, format 4's layout...), ``tasks.name`` or
``shards[i].name`` leaving the folder (``..``, absolute), symlinks and hard links to files outside, crafted shard rows
with valid checksums (NaN log-probs, a mask value of 2, token ids past the vocabulary, lists of unequal length, nulls, a
row removed, moved, duplicated within or across shards, or no task lists, a row's task id changed, two rows of different
tasks swapping trajectory ids) and crafted tasks tables with valid checksums (a trajectory id no shard holds or listed
twice, one moved to another task's list, an evicted row's id listed under another task, a task row that is not JSON,
nulls, a task over the capacity, format 4's columns). A resealed edit to a value a pool can legitimately have (its seed, say) is what an owner of the pool may
do, so none is made.

Issue 71's kinds, resealed too: the pool laid out as a Hub cache snapshot whose ``blobs`` is a link (to ``/``, above
the files) or a folder of links out (and, as a control, a real download's layout, which must load); column names that
are not UTF-8; a field of the state, its counters or a file entry dropped (``tokenizer_fingerprint``...) or
added; a capacity past int32; Arrow files with compressed buffers (a few KB of zstd that hold 64 MiB, too).

    OMP_NUM_THREADS=1 python benchmarks/pool_fuzz.py --mutations 2000
    OMP_NUM_THREADS=1 python benchmarks/pool_fuzz.py --kinds traversal,symlink,hardlink,hub_layout --mutations 300
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from trl_exreplay.demo.tiny import build_tiny_tokenizer  # noqa: E402
from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory  # noqa: E402
from trl_exreplay.pool.check import PoolFormatError, file_checksum, state_checksum  # noqa: E402
from trl_exreplay.pool.hub import _pool_state as pool_state  # noqa: E402
from trl_exreplay.pool.store import TRAJECTORY_SCHEMA, read_arrow, write_arrow  # noqa: E402

OUTCOMES = (
    "signals",
    "silent_differences",
    "clear_errors",
    "counted_rejections",
    "unchanged",
    "unclear_errors",
    "hangs",
    "escapes",
)
VOCAB = 64


# ------------------------------------------------------------------------------------------------------- the pool
def build_pool(folder: str, tokenizer) -> None:
    """A pool of 5 trajectory shards (4 of 4 rows, one of them holding an evicted row, and one of 1 row) and its tasks
    table, saved twice (incrementally) in `folder`."""
    from trl_exreplay.pool import tokenizer_fingerprint

    rng = np.random.default_rng(0)
    pool = ExperiencePool(replay_max_trajectories_per_task=3, replay_store_rbound=4, shard_rows=4)
    pool.bind_tokenizer(tokenizer_fingerprint(tokenizer))

    def outcome(task: str, successes: int, version: int) -> TaskOutcome:
        trajectories = []
        for _ in range(successes):
            n = int(rng.integers(2, 7))
            trajectories.append(
                Trajectory(
                    task,
                    rng.integers(0, VOCAB, 3).tolist(),
                    rng.integers(0, VOCAB, n).tolist(),
                    [1] * (n - 1) + [0],
                    (-rng.random(n)).tolist(),
                    [1.0],
                    1.0,
                    entropy=float(rng.random()),
                    policy_version=version,
                )
            )
        return TaskOutcome(task, successes, 4, trajectories, task_row=json.dumps({"prompt": f"task {task}"}))

    with pool:
        for i, (task, successes) in enumerate([("a", 2), ("b", 1), ("c", 3), ("d", 4), ("e", 0), ("f", 2)]):
            pool.record_outcome(outcome(task, successes, i))
        pool.save(folder)
        for i, (task, successes) in enumerate([("a", 1), ("g", 2), ("h", 3), ("b", 2), ("c", 1)]):
            pool.record_outcome(outcome(task, successes, 10 + i))
        pool.save(folder)


def fingerprint_of(pool: ExperiencePool) -> str:
    """The pool's content hash and a replay read of it (each stored task's best trajectory, as the trainer reads)."""
    chosen = pool.select(pool.stored_tasks(), 1)
    read = [(t.task_id, t.traj_id, t.completion_ids, t.logps) for ts in chosen.values() for t in ts]
    return pool.content_hash() + json.dumps(read)


# ------------------------------------------------------------------------------------------------------ mutations
def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(out)


def _state(folder: str) -> dict:
    with open(os.path.join(folder, "state.json")) as f:
        return json.load(f)


def _entries(state: dict) -> list[dict]:
    """The file entries of a state (its tasks table's, then its shards'), as far as an edit left them."""
    shards = state.get("shards")
    entries = [state.get("tasks")] + (shards if isinstance(shards, list) else [])
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)]


def _write_state(folder: str, state: dict, reseal: bool) -> None:
    if reseal:
        for entry in _entries(state):
            path = os.path.join(folder, entry["name"])
            if os.path.isfile(path):
                entry.update(size=os.path.getsize(path), xxh3_64=file_checksum(path))
        state["checksum"] = state_checksum(state)
    path = os.path.join(folder, "state.json")
    os.remove(path)  # the file may be a link: replace it, never write through it
    with open(path, "w") as f:
        json.dump(state, f)


def _rewrite(path: str, table: pa.Table) -> None:
    os.remove(path)  # the file may be a link: replace it, never write through it
    write_arrow(path, table)  # as the pool writes a shard or a tasks table


def flip(folder, rng, outside):
    name = rng.choice(_files(folder))
    path = os.path.join(folder, name)
    data = bytearray(open(path, "rb").read())
    if not data:
        return f"flip {name} (empty)"
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] ^= rng.randint(1, 255)
    os.remove(path)
    open(path, "wb").write(data)
    return f"flip {name}"


def truncate(folder, rng, outside):
    name = rng.choice(_files(folder))
    path = os.path.join(folder, name)
    size = os.path.getsize(path)
    data = open(path, "rb").read()[: rng.randrange(max(size, 1))]
    os.remove(path)
    open(path, "wb").write(data)
    return f"truncate {name}"


def append(folder, rng, outside):
    name = rng.choice(_files(folder))
    path = os.path.join(folder, name)
    data = open(path, "rb").read() + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    os.remove(path)
    open(path, "wb").write(data)
    return f"append {name}"


def swap(folder, rng, outside):
    a, b = rng.sample(_files(folder), 2)
    tmp = os.path.join(folder, ".swap")
    os.replace(os.path.join(folder, a), tmp)
    os.replace(os.path.join(folder, b), os.path.join(folder, a))
    os.replace(tmp, os.path.join(folder, b))
    return f"swap {a} {b}"


def _plausible_value(rng, value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return rng.choice([value + 1, value - 1, 0, -1, 2**40, None, "1", 1.5])
    if isinstance(value, float):
        return rng.choice([value * 2, float("nan"), -value, None])
    if isinstance(value, str):
        return rng.choice(["", value[:-1], value + "x", "../" + value, "/etc/passwd", None, 3])
    if value is None:
        return rng.choice([0, "x", -1])
    if isinstance(value, list):
        return rng.choice([[], value[:-1], value + value[:1], None])
    if isinstance(value, dict):
        return rng.choice([{}, None, [value]])
    return None


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _leaves(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _leaves(child, (*path, i))
    yield path


def _set(state, path, value):
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def edit_state(folder, rng, outside):
    """An edit of any value of state.json (a counter, `tasks.name`, `shards[i].rows`, ...), the file's checksum left as
    it was (damage, or a careless edit)."""
    state = _state(folder)
    path = rng.choice([p for p in _leaves(state) if p])
    target = state
    for key in path:
        target = target[key]
    _set(state, path, _plausible_value(rng, target))
    _write_state(folder, state, reseal=False)
    return f"edit state {'.'.join(map(str, path))}"


def _reseal_invalid(folder, rng, outside):
    """An edit no pool can have, resealed (a careful attacker, or a tool that rewrites checksums)."""
    state = _state(folder)
    tasks = state["tasks"]
    shard = rng.choice(state["shards"])
    edits = {
        "capacity below the tasks held": lambda: state["settings"].update(replay_max_trajectories_per_task=1),
        "unknown selection mode": lambda: state["settings"].update(replay_select_mode="argmedian"),
        "rbound -1": lambda: state["settings"].update(replay_store_rbound=-1),
        "capacity 0": lambda: state["settings"].update(replay_max_trajectories_per_task=0),
        "negative counter": lambda: state["counters"].update(next_traj_id=-5),
        "traj ids past next_traj_id": lambda: state["counters"].update(next_traj_id=1),
        "orders past the stamp": lambda: state["counters"].update(stamp=1),
        "live above rows": lambda: shard.update(live=shard["rows"] + 1),
        "rows not the file's": lambda: shard.update(rows=shard["rows"] + 1),
        "live not the shard's live rows": lambda: shard.update(live=shard["live"] - 1),
        "deleted fingerprint": lambda: state.update(tokenizer_fingerprint=None),
        "settings not an object": lambda: state.update(settings=[1, 2]),
        "missing counters": lambda: state.pop("counters"),
        "missing tasks entry": lambda: state.pop("tasks"),
        "unknown setting": lambda: state["settings"].update(capacity=3),
        "a shard listed twice": lambda: state["shards"].append(dict(shard)),
        "a shard dropped": lambda: state["shards"].remove(shard),
        "the tasks table listed as a shard": lambda: state["shards"].append({**tasks, "rows": 8, "live": 8}),
        "tasks.name a shard's name": lambda: state.update(tasks={**tasks, "name": shard["name"]}),
        "shards keyed by folder (format 4)": lambda: state.update(shards={"trajectories": state["shards"]}),
        "format_version 4": lambda: state.update(format_version=4),
    }
    what = rng.choice(sorted(edits))
    edits[what]()
    _write_state(folder, state, reseal=True)
    return f"resealed edit: {what}"


def traversal(folder, rng, outside):
    """`tasks.name` or a `shards[i].name` leaving the folder, pointing at a real copy of the file (resealed)."""
    state = _state(folder)
    if rng.random() < 0.3:
        where, entry = "tasks", state["tasks"]
    else:
        index = rng.randrange(len(state["shards"]))
        where, entry = f"shards[{index}]", state["shards"][index]
    source = entry["name"]
    copy = os.path.join(outside, f"{source.split('-')[0]}-{rng.randrange(10**9)}.arrow")
    shutil.copyfile(os.path.join(folder, source), copy)
    entry["name"] = rng.choice([os.path.relpath(copy, folder), copy, f"../{os.path.basename(copy)}"])
    _write_state(folder, state, reseal=True)
    return f"traversal name {entry['name']!r} for {where}", folder, True


def symlink_out(folder, rng, outside):
    """A pool file replaced by a symlink to a file outside the folder, with the same or other content."""
    name = rng.choice(_files(folder))
    path = os.path.join(folder, name)
    copy = os.path.join(outside, f"link-{rng.randrange(10**9)}")
    shutil.copyfile(path, copy)
    if rng.random() < 0.5:
        with open(copy, "ab") as f:
            f.write(b"x")
    os.remove(path)
    os.symlink(copy, path)
    return f"symlink {name} -> outside", folder, True


def hardlink_out(folder, rng, outside):
    """A pool file replaced by a hard link to a file outside with other content (a file the attacker wants read)."""
    name = rng.choice(_files(folder))
    path = os.path.join(folder, name)
    secret = os.path.join(outside, f"secret-{rng.randrange(10**9)}")
    with open(secret, "wb") as f:
        f.write(rng.choice([b"secret", open(path, "rb").read()[:-1] + b"\x00"]))
    os.remove(path)
    os.link(secret, path)
    return f"hard link {name} -> outside"


def _live_ids(folder: str, state: dict) -> set[int]:
    """The trajectory ids the tasks table lists (the shard rows that hold the others are dead)."""
    table = read_arrow(os.path.join(folder, state["tasks"]["name"]))
    return set(table.column("traj_ids").combine_chunks().values.to_pylist())


def crafted_rows(folder, rng, outside):
    """Shard rows a model cannot train on, rows the tasks table cannot match (missing, held twice, dead, moved, of
    another task), or nulls, in shards rewritten with valid checksums and their `rows`/`live` recorded to match."""
    state = _state(folder)
    live = _live_ids(folder, state)
    entries = state["shards"]
    entry = rng.choice(entries)
    path = os.path.join(folder, entry["name"])
    rows = read_arrow(path).to_pylist()
    choices = [
        *("nan logp", "inf reward", "mask 2", "id past vocab", "negative id", "nan entropy", "unequal lists"),
        *("null in a list", "null value", "rows reordered", "dead row added", "row's traj id unlisted", "row removed"),
        *("row duplicated in its shard", "row duplicated across shards", "row moved to another shard"),
        *("row's task id changed", "traj ids swapped across tasks"),
    ]
    what = rng.choice(choices)
    at = rng.choice([i for i, r in enumerate(rows) if r["traj_id"] in live] or range(len(rows)))
    row = rows[at]
    other = rng.choice([e for e in entries if e is not entry])
    if what == "nan logp":
        row["logps"][0] = float("nan")
    elif what == "inf reward":
        row["reward"] = float("inf")
    elif what == "mask 2":
        row["completion_mask"][0] = 2
    elif what == "id past vocab":
        row["completion_ids"][0] = VOCAB + 5
    elif what == "negative id":
        row["prompt_ids"][0] = -1
    elif what == "nan entropy":
        row["entropy"] = float("nan")
    elif what == "unequal lists":
        row[rng.choice(["completion_ids", "completion_mask", "logps"])].pop()
    elif what == "null in a list":
        row[rng.choice(["prompt_ids", "completion_ids", "completion_mask", "logps", "rewards"])][0] = None
    elif what == "null value":
        row[rng.choice(TRAJECTORY_SCHEMA.names)] = None
    elif what == "rows reordered":  # rows are found by id, not by place
        rng.shuffle(rows)
    elif what == "dead row added":  # a row no task lists: ignored
        rows.append({**row, "traj_id": state["counters"]["next_traj_id"] + 100})
    elif what == "row's traj id unlisted":  # the task's trajectory is missing, the row dead
        row["traj_id"] = state["counters"]["next_traj_id"] + 100
    elif what == "row removed":
        rows.pop(at)
    elif what == "row duplicated in its shard":
        rows.append(dict(row))
    elif what == "row's task id changed":  # the row is then of another task than the one listing its id: refused
        tasks = read_arrow(os.path.join(folder, state["tasks"]["name"])).column("task_id").to_pylist()
        row["task_id"] = rng.choice([t for t in tasks if t != row["task_id"]] + ["zzz"])
    elif what == "traj ids swapped across tasks":  # each row then carries an id the other task lists: both refused
        held = {
            e["name"]: rows if e is entry else read_arrow(os.path.join(folder, e["name"])).to_pylist() for e in entries
        }
        partners = [
            (e, r) for e in entries for r in held[e["name"]] if r["traj_id"] in live and r["task_id"] != row["task_id"]
        ]
        shard, partner = rng.choice(partners)
        row["traj_id"], partner["traj_id"] = partner["traj_id"], row["traj_id"]
        if shard is not entry:
            _rewrite(
                os.path.join(folder, shard["name"]),
                pa.Table.from_pylist(held[shard["name"]], schema=TRAJECTORY_SCHEMA),
            )
            shard.update(rows=len(held[shard["name"]]), live=sum(r["traj_id"] in live for r in held[shard["name"]]))
    else:
        other_path = os.path.join(folder, other["name"])
        other_rows = read_arrow(other_path).to_pylist() + [row]
        if what == "row moved to another shard":
            rows.pop(at)
        _rewrite(other_path, pa.Table.from_pylist(other_rows, schema=TRAJECTORY_SCHEMA))
        other.update(rows=len(other_rows), live=sum(r["traj_id"] in live for r in other_rows))
    _rewrite(path, pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA))
    entry.update(rows=len(rows), live=sum(r["traj_id"] in live for r in rows))
    _write_state(folder, state, reseal=True)
    return f"crafted row ({what}) in {entry['name']}"


def crafted_tasks(folder, rng, outside):
    """A tasks table a pool cannot have written (a trajectory id no shard holds, one listed twice or under another
    task, an evicted row's id listed, a task row that is not JSON, nulls, a task over the capacity, old columns...),
    rewritten with valid checksums."""
    state = _state(folder)
    path = os.path.join(folder, state["tasks"]["name"])
    table = read_arrow(path)
    columns = {name: table.column(name).to_pylist() for name in table.column_names}
    t = rng.randrange(table.num_rows)
    lists = columns["traj_ids"]
    held = [i for i, ids in enumerate(lists) if ids]
    short = [i for i, ids in enumerate(lists) if len(ids) < state["settings"]["replay_max_trajectories_per_task"]]
    counters = state["counters"]
    types = dict(zip(table.column_names, table.schema.types))
    choices = [
        *("task row not JSON", "traj id no shard holds", "traj id listed twice", "traj id past next_traj_id"),
        *("negative traj id", "task over the capacity", "task id twice", "difficulty out of range"),
        *("order past the stamp", "null traj_ids", "null in traj_ids", "null task id", "format 4 columns"),
        *("traj_ids as int32", "column missing"),
        *("traj id moved to another task", "dead row listed under another task"),
    ]
    what = rng.choice(choices)
    if what == "task row not JSON":
        columns["task_row"][t] = rng.choice(['{"prompt": "cut', "", "[1, 2", "NaN-ish {"])
    elif what == "traj id no shard holds":  # a valid id (below next_traj_id) with no row: a counted "missing row"
        lists[rng.choice(short)].append(counters["next_traj_id"])
        counters["next_traj_id"] += 1
    elif what == "traj id moved to another task":  # the row is then of another task than the one listing it: refused
        source = rng.choice(held)
        traj_id = rng.choice(lists[source])
        lists[source].remove(traj_id)
        lists[rng.choice([i for i in short if i != source])].append(traj_id)
    elif what == "dead row listed under another task":  # an evicted row's id, listed under a task not the row's
        listed = {i for ids in lists for i in ids}
        dead = [r for e in state["shards"] for r in read_arrow(os.path.join(folder, e["name"])).to_pylist()]
        row = rng.choice([r for r in dead if r["traj_id"] not in listed])
        lists[rng.choice([i for i in short if columns["task_id"][i] != row["task_id"]])].append(row["traj_id"])
    elif what == "traj id listed twice":
        lists[rng.choice(short)].append(rng.choice(lists[rng.choice(held)]))
    elif what == "traj id past next_traj_id":
        lists[rng.choice(short)].append(counters["next_traj_id"] + rng.choice([0, 5, 2**40]))
    elif what == "negative traj id":
        lists[rng.choice(short)].append(-1)
    elif what == "task over the capacity":  # new ids, below next_traj_id, one past the capacity
        ids = lists[rng.choice(held)]
        while len(ids) <= state["settings"]["replay_max_trajectories_per_task"]:
            ids.append(counters["next_traj_id"])
            counters["next_traj_id"] += 1
    elif what == "task id twice":
        columns["task_id"][t] = columns["task_id"][(t + 1) % table.num_rows]
    elif what == "difficulty out of range":
        columns["difficulty"][t] = rng.choice([-2, -(2**31)])
    elif what == "order past the stamp":
        columns[rng.choice(["difficulty_order", "skip_order", "store_order"])][t] = counters["stamp"] + 1
    elif what == "null traj_ids":
        lists[t] = None
    elif what == "null in traj_ids":
        lists[rng.choice(held)][0] = None
    elif what == "null task id":
        columns["task_id"][t] = None
    elif what == "format 4 columns":
        columns.update(traj_shard=[[0] * len(ids) for ids in lists], traj_row=[list(range(len(ids))) for ids in lists])
        types.update(traj_shard=pa.list_(pa.int32()), traj_row=pa.list_(pa.int32()))
    elif what == "traj_ids as int32":
        types["traj_ids"] = pa.list_(pa.int32())
    else:
        columns.pop(rng.choice(sorted(columns)))
    _rewrite(path, pa.table({name: pa.array(values, types[name]) for name, values in columns.items()}))
    _write_state(folder, state, reseal=True)
    return f"crafted tasks table ({what})"


def hub_layout(folder, rng, outside):
    """The pool as a Hub cache snapshot ``<repo>/snapshots/abc`` made of links (the files' bytes unchanged): into a
    real ``blobs`` folder, as a download lays it out (must load as the pool), or to the files moved outside, with
    ``blobs`` a link to ``/``, to the folder above them or to theirs, or a folder of links to them (escapes if it
    loads or passes `push_pool`'s check: issue 71, item 1)."""
    repo = os.path.join(folder, "hub", "datasets--me--pool")
    snapshot, blobs = os.path.join(repo, "snapshots", "abc"), os.path.join(repo, "blobs")
    os.makedirs(snapshot)
    targets = {"/": "/", "above the files": os.path.dirname(outside), "the files' folder": outside}
    what = rng.choice(["a folder (a download)", "a folder of links out", *(f"a link to {t}" for t in targets)])
    if what.startswith("a folder"):
        os.makedirs(blobs)
    else:
        os.symlink(targets[what.removeprefix("a link to ")], blobs)
    for i, name in enumerate(n for n in _files(folder) if not n.startswith("hub")):
        if what == "a folder (a download)":
            os.replace(os.path.join(folder, name), os.path.join(blobs, str(i)))
            os.symlink(os.path.join("..", "..", "blobs", str(i)), os.path.join(snapshot, name))
            continue
        os.replace(os.path.join(folder, name), os.path.join(outside, name))
        if what == "a folder of links out":
            os.symlink(os.path.join(outside, name), os.path.join(blobs, str(i)))
            os.symlink(os.path.join("..", "..", "blobs", str(i)), os.path.join(snapshot, name))
        else:
            os.symlink(os.path.join(outside, name), os.path.join(snapshot, name))
    return f"hub snapshot, blobs {what}", snapshot, what != "a folder (a download)"


def write_with_raw_name(path: str, table: pa.Table, column: str, raw: bytes, nested: bool) -> None:
    """`table` written to `path` with the name of `column` (`nested`: of its list's item) replaced by the bytes `raw`,
    which pyarrow cannot write itself: a placeholder of the same length is written, then its bytes replaced."""
    placeholder = "Z" * len(raw)
    at = table.schema.get_field_index(column)
    if nested:
        item = pa.list_(pa.field(placeholder, table.schema.field(at).type.value_type))
        table = table.set_column(at, column, table.column(column).cast(item))
    else:
        table = table.rename_columns([placeholder if name == column else name for name in table.column_names])
    _rewrite(path, table)
    with open(path, "rb") as f:
        data = f.read()
    assert data.count(placeholder.encode()) == 1, "the placeholder must be found once"
    os.remove(path)
    with open(path, "wb") as f:
        f.write(data.replace(placeholder.encode(), raw))


def non_utf8_names(folder, rng, outside):
    """A column name of the tasks table or a shard, or its list's item name, whose bytes are not UTF-8 (issue 71,
    item 3), resealed."""
    state = _state(folder)
    entry = rng.choice([state["tasks"], *state["shards"]])
    path = os.path.join(folder, entry["name"])
    table = read_arrow(path)
    nested = rng.random() < 0.5
    column = rng.choice([f.name for f in table.schema if pa.types.is_list(f.type) or not nested])
    raw = bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randint(1, 3))) + b"z" * 4  # a stray continuation byte
    write_with_raw_name(path, table, column, raw, nested)
    _write_state(folder, state, reseal=True)
    return f"name not UTF-8: {'the item of ' if nested else ''}{column} in {entry['name']}"


def state_fields(folder, rng, outside):
    """A field a save writes dropped (``tokenizer_fingerprint``: issue 71, item 4), or one it never writes added, at
    the top of the state, in its counters or in a file entry, resealed."""
    state = _state(folder)
    where = rng.choice(["the state", "counters", "tasks", "a shard"])
    target = {"the state": state, "counters": state["counters"], "tasks": state["tasks"]}.get(where)
    target = target if target is not None else rng.choice(state["shards"])
    if rng.random() < 0.5:  # (not the fields a reseal writes again)
        key = rng.choice(sorted(set(target) - {"checksum", "size", "xxh3_64"}))
        del target[key]
        what = f"{where} without {key}"
    else:
        key = rng.choice(sorted({"note", "rows", "live", "evicted", "sha256", "version"} - set(target)))
        target[key] = rng.choice([0, 7, "x", None, [1]])
        what = f"{where} with {key}"
    _write_state(folder, state, reseal=True)
    return f"state fields: {what}"


def capacity(folder, rng, outside):
    """A capacity past what the index counts a task's trajectories in (int32), resealed: it sized a tasks x capacity
    matrix (numpy's memory error)."""
    state = _state(folder)
    state["settings"]["replay_max_trajectories_per_task"] = rng.choice([2**31, 2**40, 2**62, 2**63])
    _write_state(folder, state, reseal=True)
    return f"capacity {state['settings']['replay_max_trajectories_per_task']}"


def compressed(folder, rng, outside):
    """The tasks table or a shard written with compressed buffers (zstd or lz4; the pool writes none), or a shard whose
    evicted row holds 64 MiB of zeros in 2.5 KB of zstd, resealed: refused before anything is decompressed."""
    state = _state(folder)
    entry = rng.choice([state["tasks"], *state["shards"]])
    codec = rng.choice(["zstd", "lz4"])
    what = f"{entry['name']} in {codec}"
    table = read_arrow(os.path.join(folder, entry["name"]))
    if rng.random() < 0.3:  # the bomb, in the shard of the evicted row
        live = _live_ids(folder, state)
        tables = {e["name"]: read_arrow(os.path.join(folder, e["name"])) for e in state["shards"]}
        entry = next(e for e in state["shards"] if not live >= set(tables[e["name"]].column("traj_id").to_pylist()))
        table = tables[entry["name"]]
        at = next(i for i, traj_id in enumerate(table.column("traj_id").to_pylist()) if traj_id not in live)
        zeros = pa.ListArray.from_arrays([0, 1 << 24], pa.array(np.zeros(1 << 24, np.int32)))
        column = table.schema.get_field_index("prompt_ids")
        bomb = table.slice(at, 1).set_column(column, "prompt_ids", zeros)  # 64 MiB of token 0, in a row no task lists
        table = pa.concat_tables([table.slice(0, at), bomb, table.slice(at + 1)])
        codec, what = "zstd", f"{entry['name']} with 64 MiB of zeros in zstd"
    os.remove(os.path.join(folder, entry["name"]))
    with pa.OSFile(os.path.join(folder, entry["name"]), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
            writer.write_table(table)
    _write_state(folder, state, reseal=True)
    return f"compressed: {what}"


MUTATIONS = {
    "flip": (flip, 30),
    "truncate": (truncate, 10),
    "append": (append, 6),
    "swap": (swap, 6),
    "edit_state": (edit_state, 14),
    "resealed_invalid_state": (_reseal_invalid, 10),
    "traversal": (traversal, 6),
    "symlink": (symlink_out, 5),
    "hardlink": (hardlink_out, 5),
    "crafted_rows": (crafted_rows, 8),
    "crafted_tasks": (crafted_tasks, 6),
    "hub_layout": (hub_layout, 4),  # issue 71
    "non_utf8_names": (non_utf8_names, 3),
    "state_fields": (state_fields, 4),
    "capacity": (capacity, 2),
    "compressed": (compressed, 3),
}


# -------------------------------------------------------------------------------------------------------- children
def load_in_child(folder: str, tokenizer, timeout: float, leads_out: bool = False) -> tuple[str, dict]:
    """Load, read and hash the pool at `folder` in a forked child, and (`leads_out`: for a case whose files lead out of
    the folder) run `push_pool`'s check of the folder; returns (outcome, details)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        os.close(read)
        signal.alarm(int(timeout))
        try:
            with ExperiencePool.load(folder, tokenizer=tokenizer, vocab_size=VOCAB) as pool:
                result = {"ok": True, "fingerprint": fingerprint_of(pool), "rejected": pool.rejected_rows}
        except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
            result = {"ok": False, "type": type(e).__name__, "message": str(e)[:500],
                      "clear": isinstance(e, PoolFormatError)
                      or (isinstance(e, (ValueError, FileNotFoundError)) and folder in str(e))}  # fmt: skip
        if leads_out:
            try:
                pool_state(folder)  # what `push_pool` checks before it uploads the files the state names
                result["pushed"] = True
            except BaseException:  # noqa: BLE001 - refused, as it must be
                result["pushed"] = False
        os.write(write, json.dumps(result).encode())
        os.close(write)
        os._exit(0)
    os.close(write)
    chunks = []
    while True:
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return ("hangs" if sig == signal.SIGALRM else "signals"), {"signal": signal.Signals(sig).name}
    return "reported", json.loads(b"".join(chunks) or b"{}")


def classify(report: dict, reference: str, leads_out: bool = False) -> str:
    if leads_out and (report.get("ok") or report.get("pushed")):
        return "escapes"
    if not report.get("ok"):
        return "clear_errors" if report.get("clear") else "unclear_errors"
    if report["rejected"] > 0:
        return "counted_rejections"
    return "unchanged" if report["fingerprint"] == reference else "silent_differences"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=2000)
    parser.add_argument("--kinds", help=f"comma-separated kinds to draw from (default: all): {', '.join(MUTATIONS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a child may take")
    parser.add_argument("--json", help="write the counts and every non-benign case here")
    parser.add_argument("--verbose", action="store_true", help="print every mutation and its outcome")
    args = parser.parse_args(argv)
    package_logger = logging.getLogger("trl_exreplay")
    level = package_logger.level
    package_logger.setLevel(logging.ERROR)  # each rejection is counted here, not logged
    try:
        return _fuzz(args)
    finally:
        package_logger.setLevel(level)  # a caller (a test session) keeps its warnings


def _fuzz(args) -> dict:

    tokenizer = build_tiny_tokenizer(["go", "to", "the", "door", "key"])
    work = tempfile.mkdtemp(prefix="pool-fuzz-")
    try:
        pristine = os.path.join(work, "pristine")
        build_pool(pristine, tokenizer)
        with ExperiencePool.load(pristine, tokenizer=tokenizer, vocab_size=VOCAB) as pool:
            reference = fingerprint_of(pool)
        kinds = args.kinds.split(",") if args.kinds else list(MUTATIONS)
        unknown = sorted(set(kinds) - set(MUTATIONS))
        if unknown:
            raise SystemExit(f"unknown kinds {unknown}; known: {', '.join(MUTATIONS)}")
        names, weights = zip(*((name, MUTATIONS[name][1]) for name in kinds))
        counts: Counter = Counter()
        by_kind: dict[str, Counter] = {name: Counter() for name in names}
        bad_cases = []
        start = time.perf_counter()
        for i in range(args.mutations):
            rng = random.Random(args.seed * 1_000_003 + i)
            kind = rng.choices(names, weights)[0]
            case = os.path.join(work, "case")
            outside = os.path.join(work, "outside")
            shutil.rmtree(case, ignore_errors=True)
            shutil.rmtree(outside, ignore_errors=True)
            os.makedirs(outside)
            shutil.copytree(pristine, case)
            what = MUTATIONS[kind][0](case, rng, outside)
            what, folder, leads_out = what if isinstance(what, tuple) else (what, case, False)
            status, report = load_in_child(folder, tokenizer, args.timeout, leads_out)
            outcome = status if status != "reported" else classify(report, reference, leads_out)
            counts[outcome] += 1
            by_kind[kind][outcome] += 1
            if outcome in ("signals", "silent_differences", "unclear_errors", "hangs", "escapes"):
                bad_cases.append({"i": i, "mutation": what, "outcome": outcome, "report": report})
            if args.verbose:
                print(f"{i:5d} {outcome:20s} {what}  {report.get('message', '')[:160]}", flush=True)
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {"mutations": args.mutations, **{name: counts[name] for name in OUTCOMES}}
    print(", ".join(f"{k} {v}" for k, v in result.items()))
    print(f"({seconds:.0f} s; by mutation: " + "; ".join(
        f"{kind}: " + " ".join(f"{o}={n}" for o, n in sorted(c.items())) for kind, c in by_kind.items() if c) + ")")  # fmt: skip
    for case in bad_cases[:20]:
        print("  BAD", case)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "seconds": seconds, "by_kind": by_kind, "bad_cases": bad_cases}, f, indent=1)
    return {**result, "bad_cases": bad_cases}


if __name__ == "__main__":
    outcome = main()
    sys.exit(1 if outcome["signals"] or outcome["silent_differences"] or outcome["escapes"] else 0)
