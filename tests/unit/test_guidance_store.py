"""The offline experience store and provider: BM25 retrieval (order, ties, dedup, lazy index), the default summaries,
and the saved experience folder: exact round trips, untrusted folders refused by one error naming the file, and saves
killed at random instants or before each filesystem operation that always leave a loadable folder."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import subprocess
import sys

import pyarrow as pa
import pytest
from helpers import kill_a_save_at_random, load_script

from trl_exreplay.guidance import ExperienceProvider, ExperienceRecord, SummaryInput
from trl_exreplay.guidance.offline import OfflineExperienceProvider
from trl_exreplay.guidance.store import (
    RECORD_SCHEMA,
    ExperienceFormatError,
    ExperienceStore,
    load_experience,
    save_experience,
)
from trl_exreplay.pool.check import file_checksum

SAVER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts", "experience_saver.py")
QUERIES = [
    "put a mug in the sink",  # c0
    "put a mug in the cabinet",  # c1
    "heat an egg in the microwave",  # c2
    "put a clean mug in the sink",  # c3
    "cool a bottle in the fridge",  # c4
    "put a plate in the sink",  # c5
]


def record(i: int, query: str, content: str | None = None, step: int = 0) -> ExperienceRecord:
    return ExperienceRecord(f"t{i}", query, content if content is not None else f"c{i}", f"t{i}:src", step)


def corpus_store() -> ExperienceStore:
    return ExperienceStore(record(i, q) for i, q in enumerate(QUERIES))


# --------------------------------------------------------------------------------------------------------------------
# Retrieval
# --------------------------------------------------------------------------------------------------------------------


def test_bm25_ranks_records_by_their_query_text():
    store = corpus_store()
    # both words, short record first; then one word each: "mug" and "sink" are equally rare, the records equally
    # long: a tie, in insertion order. c2, c4 share no word and are never returned.
    assert store.retrieve("mug sink", 10) == ["c0", "c3", "c1", "c5"]
    assert store.retrieve("sink", 10) == ["c0", "c5", "c3"]  # c0 and c5 tie; c3 is longer
    assert store.retrieve("put the mug in the sink", 2) == ["c0", "c3"]
    assert store.retrieve("MICROWAVE, please!", 5) == ["c2"]  # lower-cased, punctuation split off


def test_k_is_clamped_and_zero_score_records_are_dropped():
    store = corpus_store()
    assert store.retrieve("egg", 100) == ["c2"]  # k far above the corpus size; the 5 others score 0
    assert store.retrieve("fridge bottle", 1) == ["c4"]
    assert store.retrieve("zebra", 3) == []  # no word of the corpus
    assert store.retrieve("mug", 0) == []
    with pytest.raises(ValueError, match="k must be"):
        store.retrieve("mug", -1)


def test_an_empty_store_and_a_stopword_query_give_nothing():
    assert ExperienceStore().retrieve("put a mug in the sink", 3) == []
    assert corpus_store().retrieve("the a in of", 3) == []
    assert corpus_store().retrieve("", 3) == []
    only_stopwords = ExperienceStore([record(0, "the a"), record(1, "of it")])  # nothing bm25s could index
    assert only_stopwords.retrieve("the mug", 3) == []


def test_duplicates_are_skipped_and_counted_and_a_content_is_returned_once():
    store = corpus_store()
    store.add([record(0, QUERIES[0]), record(9, QUERIES[0], "c0", step=5)])  # same query and content as c0
    assert len(store) == len(QUERIES) and store.duplicates == 2
    store.add([record(7, "put a mug in a sink basin", "c0")])  # same content, another query: kept
    assert len(store) == len(QUERIES) + 1 and store.duplicates == 2
    assert store.retrieve("mug sink", 3) == ["c0", "c3", "c1"]  # the second "c0" is not returned again
    store.add([record(8, "wash a mug", "new"), record(8, "wash a mug", "new")])  # a duplicate within one call
    assert store.duplicates == 3
    with pytest.raises(TypeError, match="ExperienceRecord"):
        store.add([{"query": "x"}])


def test_retrieval_is_deterministic_with_ties_in_insertion_order():
    records = [record(i, "open the red door", f"door {i}") for i in range(8)]  # all tie
    records += [record(9, "open the blue box", "box")]
    first = ExperienceStore(records)
    assert first.retrieve("open door", 5) == [f"door {i}" for i in range(5)]
    again = ExperienceStore(records)
    for query in ("open door", "red box", "open", "blue door"):
        assert first.retrieve(query, 4) == again.retrieve(query, 4) == first.retrieve(query, 4)
    assert ExperienceStore(records[::-1]).retrieve("open door", 3) == ["door 7", "door 6", "door 5"]
    # Many ties, interleaved with another score (an unstable sort reorders ties among more than 16 items).
    many = ExperienceStore(
        record(i, "open the red door" if i % 3 else "open the big red door", f"{i}") for i in range(60)
    )
    expected = [str(i) for i in range(60) if i % 3] + [str(i) for i in range(60) if i % 3 == 0]
    assert many.retrieve("red door", 100) == expected


def test_the_index_is_rebuilt_lazily_after_an_add(monkeypatch):
    import bm25s

    builds = []
    original = bm25s.BM25.index
    monkeypatch.setattr(bm25s.BM25, "index", lambda self, *a, **k: builds.append(1) or original(self, *a, **k))
    store = corpus_store()
    assert builds == []  # adding builds nothing
    store.retrieve("mug", 3)
    store.retrieve("sink", 3)
    assert len(builds) == 1  # one build for both
    store.add([record(6, "slice a tomato", "tomato")])
    store.add([record(7, "slice a tomato with a knife", "knife")])
    assert len(builds) == 1
    assert store.retrieve("tomato knife", 3) == ["knife", "tomato"]  # the new records are seen
    assert len(builds) == 2
    assert store.records()[-1].content == "knife"
    store.records().clear()  # a copy
    assert len(store) == 8


# --------------------------------------------------------------------------------------------------------------------
# The offline provider
# --------------------------------------------------------------------------------------------------------------------


def won(actions, source="t1:9f2c", query="put a mug in the sink", step=3) -> SummaryInput:
    return SummaryInput(source, "t1", query, list(actions), reward=1.0, step=step)


def test_the_default_summaries_are_exact():
    provider = OfflineExperienceProvider(max_actions=3)
    assert isinstance(provider, ExperienceProvider) and provider.shared is False
    inputs = [
        won(["go to\ttable 1 ", "take  mug 1\nfrom table 1", "", "go to sink 1"]),
        won(["  The answer is 42.\n\nBecause 6 * 7 = 42.  "], source="t2:1"),
        won(["a", "b", "c", "d", "e"], source="t3:1"),
        won([" ", "\n"], source="t4:1"),  # no action holds text: no record
        won([""], source="t5:1"),
    ]
    records = provider.summarize(inputs)
    assert [r.content for r in records] == [
        "A successful attempt at this task took these actions: go to table 1; take mug 1 from table 1; go to sink 1",
        "A successful answer to this task was: The answer is 42.\n\nBecause 6 * 7 = 42.",
        "A successful attempt at this task took these actions: a; b; c; ... (2 more)",
    ]
    assert records[0] == ExperienceRecord("t1", "put a mug in the sink", records[0].content, "t1:9f2c", 3)
    assert [r.source for r in records] == ["t1:9f2c", "t2:1", "t3:1"]
    with pytest.raises(ValueError, match="max_actions"):
        OfflineExperienceProvider(max_actions=0)


def test_summarize_is_pure_and_the_rest_delegates_to_the_store():
    store = ExperienceStore()
    provider = OfflineExperienceProvider(store)
    records = provider.summarize([won(["go to sink 1", "put mug 1 in sink 1"])])
    assert len(store) == 0 and provider.retrieve("mug sink", 3) == []
    provider.add(records)
    assert provider.records() == records == store.records()
    assert provider.retrieve("a mug for the sink", 3) == [records[0].content]


def test_the_summarize_hook_is_used_and_may_decline():
    seen = []

    def hook(trajectory: SummaryInput) -> str | None:
        seen.append(trajectory.source)
        return {"a": "Plan: find the mug first.", "b": None, "c": ""}[trajectory.source]

    provider = OfflineExperienceProvider(summarize_fn=hook)
    records = provider.summarize([won(["x", "y"], source=s) for s in ("a", "b", "c")])
    assert seen == ["a", "b", "c"]
    assert records == [ExperienceRecord("t1", "put a mug in the sink", "Plan: find the mug first.", "a", 3)]
    with pytest.raises(TypeError, match="str or None"):
        OfflineExperienceProvider(summarize_fn=lambda t: 42).summarize([won(["x"])])


# --------------------------------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------------------------------

RECORDS = [
    ExperienceRecord("t1", "put a mug in the sink", "Take the mug first.", "t1:a", 1),
    ExperienceRecord("t2", "chauffer un œuf 🥚", "Utilise le micro-ondes.\nPuis pose-le.", "t2:b", 2),
    ExperienceRecord("", "", "", "", 0),
]
BACKLOG = [
    SummaryInput("t3:c", "t3", "cool a bottle", ["go to fridge 1", "cool bottle 1"], 1.0, 4, ["fridge 1 is closed"]),
    SummaryInput("t4:d", "t4", "数学", ["答案是 42"], -0.5, 5),
    SummaryInput("t5:e", "t5", "nothing", [], 0.0, 2**40, []),
]


def saved(tmp_path, records=RECORDS, backlog=BACKLOG, name="exp") -> str:
    folder = str(tmp_path / name)
    save_experience(folder, records, backlog)
    return folder


def manifest_of(folder: str) -> dict:
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def write_manifest(folder: str, manifest: dict) -> None:
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f)


def data_file(folder: str, table: str = "records") -> tuple[str, str]:
    name = manifest_of(folder)["tables"][table]["data_files"][0]
    return name, os.path.join(folder, name)


def reseal(folder: str, name: str, path: str) -> None:
    """Record the file's new size and checksum in the manifest, as anyone who edits the file can."""
    manifest = manifest_of(folder)
    manifest["files"][name] = {"size": os.path.getsize(path), "xxh3_64": file_checksum(path)}
    write_manifest(folder, manifest)


def forge(folder: str, table: str, data: pa.Table) -> str:
    """Replace a table's data file by `data` and record its new size and checksum: only the content is wrong."""
    name, path = data_file(folder, table)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, data.schema) as writer:
        writer.write_table(data)
    reseal(folder, name, path)
    return path


def records_table(**changes) -> pa.Table:
    columns = {
        "task_id": pa.array(["t"], pa.string()),
        "query": pa.array(["q"], pa.string()),
        "content": pa.array(["c"], pa.string()),
        "source": pa.array(["s"], pa.string()),
        "step": pa.array([1], pa.int64()),
    }
    columns.update(changes)
    return pa.table(columns)


def test_a_save_loads_back_exactly(tmp_path):
    folder = saved(tmp_path)
    loaded = load_experience(folder)
    assert loaded.records == RECORDS and loaded.backlog == BACKLOG and loaded.skipped == 0
    assert all(type(b.reward) is float and type(b.step) is int for b in loaded.backlog)
    for records, backlog in (([], []), (RECORDS, []), ([], BACKLOG)):  # over the previous save, in place
        save_experience(folder, records, backlog)
        loaded = load_experience(folder)
        assert (loaded.records, loaded.backlog, loaded.skipped) == (records, backlog, 0)
    manifest = manifest_of(folder)
    assert manifest["format_version"] == 1
    assert {t: e["rows"] for t, e in manifest["tables"].items()} == {"records": 0, "backlog": len(BACKLOG)}
    version = {name.split("/")[0] for name in manifest["files"]}
    assert len(version) == 1 and sorted(os.listdir(folder)) == sorted(["manifest.json", *version])
    for name, entry in manifest["files"].items():
        path = os.path.join(folder, name)
        assert entry == {"size": os.path.getsize(path), "xxh3_64": file_checksum(path)}
    assert sorted(os.listdir(tmp_path)) == ["exp"]  # no temp sibling left


def test_the_tables_are_datasets_folders(tmp_path):
    import datasets

    folder = saved(tmp_path)
    name, _ = data_file(folder, "backlog")
    table = datasets.load_from_disk(os.path.join(folder, os.path.dirname(name)))
    assert table.to_list() == [b.as_dict() for b in BACKLOG]


def test_an_error_after_the_commit_keeps_the_committed_save(tmp_path, monkeypatch):
    """The save's last fsync fails (or an interrupt lands) after its manifest is in place: what it names stays."""
    import trl_exreplay.guidance.store as store

    folder = str(tmp_path / "exp")
    fsync = store.fsync_path

    def fsync_failing_after_the_commit(path):
        if os.path.exists(os.path.join(folder, "manifest.json")):
            raise OSError(5, "Input/output error")
        fsync(path)

    monkeypatch.setattr(store, "fsync_path", fsync_failing_after_the_commit)
    with pytest.raises(OSError, match="Input/output error"):
        save_experience(folder, RECORDS, BACKLOG)
    loaded = load_experience(folder)
    assert loaded.records == RECORDS and loaded.backlog == BACKLOG


def test_a_save_refuses_values_load_would_refuse_and_folders_it_does_not_own(tmp_path):
    with pytest.raises(ValueError, match=r"records\[0\].step"):
        save_experience(str(tmp_path / "a"), [record(0, "q", step=-1)], [])
    with pytest.raises(TypeError, match=r"backlog\[0\].actions"):
        save_experience(str(tmp_path / "a"), [], [SummaryInput("s", "t", "q", ["ok", 3], 1.0, 0)])
    assert not os.path.exists(tmp_path / "a")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds something other than a saved experience"):
        save_experience(str(other), RECORDS, BACKLOG)
    assert os.listdir(other) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    save_experience(str(empty), RECORDS, [])
    assert load_experience(str(empty)).records == RECORDS
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        load_experience(str(other))


def test_non_finite_rewards_are_skipped_and_counted(tmp_path, caplog):
    backlog = [
        SummaryInput("a", "t", "q", ["x"], math.nan, 0),
        BACKLOG[0],
        SummaryInput("b", "t", "q", ["x"], -math.inf, 0),
    ]
    folder = saved(tmp_path, backlog=backlog)
    with caplog.at_level(logging.WARNING, logger="trl_exreplay.guidance.store"):
        loaded = load_experience(folder)
    assert loaded.backlog == [BACKLOG[0]] and loaded.skipped == 2 and loaded.records == RECORDS
    assert "2 backlog row(s)" in caplog.text and "non-finite reward" in caplog.text


def _set_file(name):
    def edit(manifest, folder):
        manifest["files"][name] = {"size": 3, "xxh3_64": "0" * 16}

    return edit


def _set(path, value):
    def edit(manifest, folder):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


MANIFEST_EDITS = {
    "a name with ..": (_set_file("../x"), "'../x' is not allowed"),
    "a name through ..": (_set_file("v-0000000000000000/../../x"), "is not allowed"),
    "an absolute path": (_set_file("/etc/passwd"), "'/etc/passwd' is not allowed"),
    "a hidden name": (_set_file("v-0000000000000000/records/.x"), "is not allowed"),
    "another table": (_set_file("v-0000000000000000/other/x"), "is not allowed"),
    "an unknown version": (_set(["format_version"], 2), "format_version 2 is not one"),
    "a version as text": (_set(["format_version"], "1"), "format_version '1'"),
    "an unknown key": (_set(["extra"], 1), "exactly the keys"),
    "a negative size": (lambda m, f: m["files"][data_file(f)[0]].update(size=-1), "size` must be an integer >= 0"),
    "a bad checksum field": (lambda m, f: m["files"][data_file(f)[0]].update(xxh3_64="zz"), "16 hex digits"),
    "wrong rows": (_set(["tables", "records", "rows"], 4), "`tables.records.rows` is 4"),
    "an unlisted data file": (_set(["tables", "records", "data_files"], ["v-0/records/x.arrow"]), "not listed"),
    "no data file": (_set(["tables", "backlog", "data_files"], []), "non-empty list"),
    "a missing table": (lambda m, f: m["tables"].pop("backlog"), "exactly the keys"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_a_crafted_manifest_is_refused_naming_it(tmp_path, case):
    folder = saved(tmp_path)
    edit, problem = MANIFEST_EDITS[case]
    manifest = manifest_of(folder)
    edit(manifest, folder)
    write_manifest(folder, manifest)
    with pytest.raises(ExperienceFormatError, match="manifest.json") as caught:
        load_experience(folder)
    assert caught.value.file == os.path.join(folder, "manifest.json")
    assert problem in caught.value.problem, caught.value.problem


def test_a_damaged_manifest_is_refused(tmp_path):
    folder = saved(tmp_path)
    path = os.path.join(folder, "manifest.json")
    text = open(path, "rb").read()
    for damaged, problem in (
        (text[: len(text) // 2], "not valid JSON"),
        (b"[1, 2]", "must hold a JSON object"),
        (b"\xff\xfe", "not valid JSON"),
        (b" " * (1 << 20) + b"{}", "larger than"),
    ):
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(ExperienceFormatError, match=problem) as caught:
            load_experience(folder)
        assert caught.value.file == path


def test_damaged_or_escaping_files_are_refused_naming_them(tmp_path):
    outside = tmp_path / "outside.arrow"
    outside.write_bytes(b"secret")

    def missing(path):
        os.remove(path)

    def longer(path):
        with open(path, "ab") as f:
            f.write(b"\0")

    def flipped(path):
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))

    def escaping(path):
        os.remove(path)
        os.symlink(outside, path)

    def fifo(path):
        os.remove(path)
        os.mkfifo(path)

    cases = [
        (missing, "records", "cannot be read"),
        (longer, "records", "bytes; the manifest recorded"),
        (flipped, "backlog", "checksum mismatch"),
        (escaping, "records", "outside the experience folder"),
        (fifo, "backlog", "not a regular file"),
    ]
    for damage, table, problem in cases:
        folder = saved(tmp_path, name=damage.__name__)
        _, path = data_file(folder, table)
        damage(path)
        with pytest.raises(ExperienceFormatError, match=problem) as caught:
            load_experience(folder)
        assert caught.value.file == path, damage.__name__
    # A symlink to a file inside the folder is fine: it is checked by content.
    folder = saved(tmp_path, name="linked")
    name, path = data_file(folder)
    os.rename(path, os.path.join(folder, os.path.dirname(name), "moved.arrow"))
    os.symlink("moved.arrow", path)
    assert load_experience(folder).records == RECORDS


def test_forged_tables_are_refused_naming_them(tmp_path):
    cases = [
        (records_table(step=pa.array(["1"], pa.string())), "are not the expected"),  # a column of another type
        (records_table(step=pa.array([1], pa.int32())), "are not the expected"),
        (pa.table({"content": ["c"]}), "are not the expected"),
        (records_table(step=pa.array([-3], pa.int64())), "column `step` holds -3"),
        (records_table(content=pa.array([None], pa.string())), "column `content` holds 1 null"),
        (records_table(), "`tables.records.rows` is 3, but its data files hold 1"),  # rows against the manifest
    ]
    for i, (table, problem) in enumerate(cases):
        folder = saved(tmp_path, name=f"forged{i}")
        path = forge(folder, "records", table)
        with pytest.raises(ExperienceFormatError, match=problem) as caught:
            load_experience(folder)
        assert caught.value.file in (path, os.path.join(folder, "manifest.json"))
    folder = saved(tmp_path, name="not-arrow")
    name, path = data_file(folder)
    with open(path, "wb") as f:
        f.write(b"not an arrow stream at all")
    reseal(folder, name, path)
    with pytest.raises(ExperienceFormatError, match="not an Arrow stream") as caught:
        load_experience(folder)
    assert caught.value.file == path


# --------------------------------------------------------------------------------------------------------------------
# Killed saves
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # kills a saving process at many points
def test_killed_saves_always_leave_the_last_complete_experience(tmp_path):
    """A writer process saving changing experience again and again into one folder is SIGKILLed at a random instant
    of a random save; the folder must load as the last save that completed, or as the one in flight (a kill after
    its commit). The next writer's save removes what the killed one left in the folder."""
    saver = load_script("tests/scripts/experience_saver.py", "experience_saver")
    folder = str(tmp_path / "exp")
    chooser = random.Random(2024)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trials, killed_mid_save, left = 5, 0, []

    def leftovers_gone():  # the previous writer's leftovers are gone after this writer's first save
        assert not set(left) & set(os.listdir(folder)), left
        left.clear()

    for trial in range(trials):
        command = [sys.executable, SAVER, folder, str(trial)]
        committed, in_flight = kill_a_save_at_random(command, chooser, chooser.randint(2, 3), env, leftovers_gone)
        loaded = load_experience(folder)
        assert loaded.skipped == 0
        digest = saver.digest(loaded.records, loaded.backlog)
        assert digest in {committed, in_flight}, f"trial {trial}: the folder is not a complete save"
        killed_mid_save += in_flight is not None
        left[:] = saver.leftovers(folder)
    assert killed_mid_save >= 2  # the kills really landed inside saves
    save_experience(folder, RECORDS, BACKLOG)
    assert sorted(os.listdir(tmp_path)) == ["exp"] and len(os.listdir(folder)) == 2  # manifest, one version


@pytest.mark.slow  # kills a saving process at many points
def test_a_save_killed_before_any_of_its_filesystem_operations_leaves_a_complete_folder(tmp_path):
    """The deterministic complement: a forked writer is killed before its 1st, 2nd, ... filesystem operation of three
    saves in turn (the first into no folder, then over a saved one); each time the folder must load as the last
    committed save (nothing, before the first), or the new one once committed; a complete save leaves no leftover."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, SAVER, str(tmp_path / "exp"), "3", "--sweep"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["bad"] == [] and report["leftovers_after_save"] == []
    assert report["kills"] >= 3 * 10
    assert report["loaded_none"] > 0 and report["loaded_old"] > 0 and report["loaded_new"] > 0
    assert report["left_something"] > 0  # the kills left temp folders, and the following saves removed them


def test_the_store_keeps_its_newest_records_within_its_bound_and_retrieves_from_them():
    store = ExperienceStore(max_records=3)
    colours = ["red", "green", "blue", "white", "black"]
    make = lambda i: ExperienceRecord(f"t{i}", f"open {colours[i]} door", f"{colours[i]} key first", "", i)  # noqa: E731
    store.add([make(i) for i in range(2)])
    assert store.retrieve("open green door", 1) == ["green key first"]  # an index built over the first two
    store.add([make(i) for i in range(2, 5)])
    assert [r.step for r in store.records()] == [2, 3, 4] and store.dropped == 2
    assert store.retrieve("open green door", 5) == ["blue key first", "white key first", "black key first"]  # rebuilt
    store.add([make(0)])  # dropped ones are no longer duplicates
    assert [r.step for r in store.records()] == [3, 4, 0] and store.duplicates == 0
    with pytest.raises(ValueError, match="max_records"):
        ExperienceStore(max_records=0)


def test_a_table_that_expands_far_beyond_its_file_is_refused(tmp_path):
    """Compressed IPC buffers: a small file that would fill memory when read. Its checksums are resealed, as anyone
    who edits the file can do."""
    folder = saved(tmp_path)
    name, path = data_file(folder, "records")
    big = "x" * 4_000_000
    data = pa.table(
        {"task_id": ["t"], "query": [big], "content": ["c"], "source": [""], "step": pa.array([0], pa.int64())},
        schema=RECORD_SCHEMA,
    )
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, data.schema, options=options) as writer:
        writer.write_table(data)
    assert os.path.getsize(path) < 100_000
    reseal(folder, name, path)
    with pytest.raises(ExperienceFormatError, match="expands to more than 8x") as caught:
        load_experience(folder)
    assert caught.value.file == path


def test_a_manifest_nested_too_deep_for_json_is_a_format_error(tmp_path):
    folder = saved(tmp_path)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ExperienceFormatError, match="not valid JSON"):
        load_experience(folder)
