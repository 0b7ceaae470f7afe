"""Fuzz the loading of a saved experience pool: no damage may crash the process or be read as other data.

Saves a small pool twice (several trajectory shards, a tasks table with task rows, a tokenizer fingerprint), then
applies random mutations to copies of its folder, each loaded (with the tokenizer and the model's vocabulary size),
read and hashed in a forked child process (`os.fork`: no interpreter start per mutation), and classifies each:

* ``signals``: the child died of a signal (segfault, bus error, abort): never acceptable;
* ``silent_differences``: it loaded, rejected no row, and its content or its replay read differ from the saved pool's:
  other data read as if it were the pool: never acceptable;
* ``clear_errors``: it refused with a `PoolFormatError`, or a `ValueError` / `FileNotFoundError` naming the pool;
* ``counted_rejections``: it loaded with rows refused and counted (``rejected_rows > 0``);
* ``unchanged``: it loaded the very same pool (the mutation touched nothing it reads);
* ``unclear_errors``: any other exception (a raw `KeyError`, an Arrow error without a file name...);
* ``hangs``: the child ran past ``--timeout``.

Mutations: byte flips, truncations, appended bytes, swapped files, edits of ``state.json`` (kept as edited, so its
checksum no longer matches, or resealed with fresh checksums as a careful attacker would: then only values no pool
can have are edited), shard names that leave the folder (``..``, absolute), symlinks and hard links to files outside,
and crafted rows with valid checksums (NaN log-probs, a mask value of 2, token ids past the vocabulary, a task row that
is not JSON). A resealed edit
to a value a pool can legitimately have (its seed, say) is what an owner of the pool may do, so none is made.

    OMP_NUM_THREADS=1 python benchmarks/pool_fuzz.py --mutations 2000
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
from trl_exreplay.pool.store import TRAJECTORY_SCHEMA, read_arrow, write_arrow  # noqa: E402

OUTCOMES = (
    "signals",
    "silent_differences",
    "clear_errors",
    "counted_rejections",
    "unchanged",
    "unclear_errors",
    "hangs",
)
VOCAB = 64


# ------------------------------------------------------------------------------------------------------- the pool
def build_pool(folder: str, tokenizer) -> None:
    """A pool of 4 trajectory shards (of 4 rows) and its tasks table, saved twice (incrementally) in
    `folder`."""
    from trl_exreplay.pool import tokenizer_fingerprint

    rng = np.random.default_rng(0)
    pool = ExperiencePool(max_trajectories_per_task=3, experience_rbound=4, shard_rows=4)
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
        for i, (task, successes) in enumerate([("a", 1), ("g", 2), ("h", 3), ("b", 2)]):
            pool.record_outcome(outcome(task, successes, 10 + i))
        pool.save(folder)


def fingerprint_of(pool: ExperiencePool) -> str:
    """The pool's content hash and a replay read of it (each stored task's best trajectory, as the trainer reads)."""
    chosen = pool.choose(pool.stored_tasks(), 1)
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


def _write_state(folder: str, state: dict, reseal: bool) -> None:
    if reseal:
        for name, entry in state.get("files", {}).items():
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                entry.update(size=os.path.getsize(path), xxh3_64=file_checksum(path))
        state["checksum"] = state_checksum(state)
    path = os.path.join(folder, "state.json")
    os.remove(path)  # the file may be a link: replace it, never write through it
    with open(path, "w") as f:
        json.dump(state, f)


def _shards(folder: str, kind: str = "trajectories") -> list[str]:
    return [f"{kind}/{e['name']}" for e in _state(folder)["shards"][kind]]


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
    """An edit of any value of state.json, the file's checksum left as it was (damage, or a careless edit)."""
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
    shard = rng.choice(state["shards"]["trajectories"])
    edits = {
        "capacity below the tasks held": lambda: state["settings"].update(max_trajectories_per_task=1),
        "unknown selection mode": lambda: state["settings"].update(exp_select_mode="argmedian"),
        "rbound -1": lambda: state["settings"].update(experience_rbound=-1),
        "capacity 0": lambda: state["settings"].update(max_trajectories_per_task=0),
        "negative counter": lambda: state["counters"].update(next_traj_id=-5),
        "traj ids past next_traj_id": lambda: state["counters"].update(next_traj_id=1),
        "live above rows": lambda: shard.update(live=shard["rows"] + 1),
        "rows not the file's": lambda: shard.update(rows=shard["rows"] + 1),
        "num_tasks wrong": lambda: state.update(num_tasks=state["num_tasks"] + 1),
        "num_trajectories wrong": lambda: state.update(num_trajectories=state["num_trajectories"] - 1),
        "deleted fingerprint": lambda: state.update(tokenizer_fingerprint=None),
        "settings not an object": lambda: state.update(settings=[1, 2]),
        "missing counters": lambda: state.pop("counters"),
        "unknown setting": lambda: state["settings"].update(capacity=3),
        "a shard listed twice": lambda: state["shards"]["trajectories"].append(dict(shard)),
        "a shard dropped": lambda: state["shards"]["trajectories"].remove(shard),
    }
    what = rng.choice(sorted(edits))
    edits[what]()
    _write_state(folder, state, reseal=True)
    return f"resealed edit: {what}"


def _rename_entry(state, kind, index, new_name):
    old = state["shards"][kind][index]["name"]
    state["shards"][kind][index]["name"] = new_name
    state["files"][f"{kind}/{new_name}"] = state["files"].pop(f"{kind}/{old}")


def traversal(folder, rng, outside):
    """A shard or tasks file name leaving the folder, pointing at a real copy of the file (resealed)."""
    state = _state(folder)
    kind = rng.choice(["trajectories", "tasks"])
    if kind == "tasks":
        source = state["tasks_file"]
    else:
        index = rng.randrange(len(state["shards"][kind]))
        source = f"{kind}/{state['shards'][kind][index]['name']}"
    copy = os.path.join(outside, f"copy-{rng.randrange(10**9)}.arrow")
    shutil.copyfile(os.path.join(folder, source), copy)
    new = rng.choice([os.path.relpath(copy, os.path.join(folder, "x")), copy, f"../{os.path.basename(copy)}"])
    if kind == "tasks":
        state["files"][new] = state["files"].pop(source)
        state["tasks_file"] = new
    else:
        _rename_entry(state, kind, index, new)
    _write_state(folder, state, reseal=True)
    return f"traversal name {new!r} for {source}"


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
    return f"symlink {name} -> outside"


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


def crafted_rows(folder, rng, outside):
    """Rows a model cannot train on, in a shard rewritten with valid checksums; or a task row that is not JSON, in a
    tasks table rewritten with valid checksums."""
    if rng.random() < 0.2:
        path = os.path.join(folder, _state(folder)["tasks_file"])
        tasks = read_arrow(path)
        rows = tasks.column("task_row").to_pylist()
        rows[rng.randrange(len(rows))] = '{"prompt": "cut'
        tasks = tasks.set_column(tasks.column_names.index("task_row"), "task_row", pa.array(rows, pa.string()))
        os.remove(path)
        write_arrow(path, tasks)
        _write_state(folder, _state(folder), reseal=True)
        return "crafted task row (not JSON) in the tasks table"
    name = rng.choice(_shards(folder))
    path = os.path.join(folder, name)
    rows = read_arrow(path).to_pylist()
    row = rng.choice(rows)
    what = rng.choice(["nan logp", "inf reward", "mask 2", "id past vocab", "negative id", "nan entropy"])
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
    else:
        row["entropy"] = float("nan")
    table = pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)
    os.remove(path)
    write_arrow(path, table)  # as the pool writes a shard
    _write_state(folder, _state(folder), reseal=True)
    return f"crafted row ({what}) in {name}"


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
}


# -------------------------------------------------------------------------------------------------------- children
def load_in_child(folder: str, tokenizer, timeout: float) -> tuple[str, dict]:
    """Load, read and hash the pool at `folder` in a forked child; returns (outcome, details)."""
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


def classify(report: dict, reference: str) -> str:
    if not report.get("ok"):
        return "clear_errors" if report.get("clear") else "unclear_errors"
    if report["rejected"] > 0:
        return "counted_rejections"
    return "unchanged" if report["fingerprint"] == reference else "silent_differences"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutations", type=int, default=2000)
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
        names, weights = zip(*((name, weight) for name, (_, weight) in MUTATIONS.items()))
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
            status, report = load_in_child(case, tokenizer, args.timeout)
            outcome = status if status != "reported" else classify(report, reference)
            counts[outcome] += 1
            by_kind[kind][outcome] += 1
            if outcome in ("signals", "silent_differences", "unclear_errors", "hangs"):
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
    sys.exit(1 if outcome["signals"] or outcome["silent_differences"] else 0)
