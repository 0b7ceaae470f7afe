"""Tests for `trl_exreplay.hub`: the model card, which files are published, and the pool upload round trip.

The network is cut off by replacing `HfApi.create_repo` / `create_branch` / `create_commit` / `snapshot_download`
with a recorder that keeps what each commit uploads (the bytes at commit time, accumulated per repository as the Hub
does) and serves it back to `snapshot_download`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import datasets
import huggingface_hub
import pyarrow as pa
import pytest
from huggingface_hub import ModelCard
from trl import GRPOTrainer

from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer
from trl_exreplay.hub import CITATIONS, MODEL_FILE_PATTERNS, model_card, model_files, push_model
from trl_exreplay.pool import ExperiencePool, TaskOutcome, Trajectory, pool_from_hub, push_pool, tokenizer_fingerprint
from trl_exreplay.pool.check import PoolFormatError, state_checksum
from trl_exreplay.pool.persistence import STATE_FILE
from trl_exreplay.pool.store import TRAJECTORY_FEATURES

ARXIV_IDS = ("2510.02245", "2511.10395", "2010.03768", "2402.03300")
REPLAY_CONFIG = {
    "replay_ratio": 0.5,
    "replay_select_mode": "argmin",
    "replay_max_policy_age": None,
    "replay_store_rbound": 8,
}
VERSIONS = {"trl": "1.16.0", "transformers": "5.23.0", "torch": "2.9.0", "alfworld": "0.4.2", "trl_exreplay": "0.1"}

# The publishing rule, written out independently of MODEL_FILE_PATTERNS.
MODEL_NAMES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "tokenizer.model",
    "adapter_config.json",
    "README.md",
}


def publishable(name: str) -> bool:
    return name in MODEL_NAMES or name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def make_card(repo_id="me/tiny-alfworld", base_model="Qwen/Qwen3-0.6B", tags=("alfworld", "trl")):
    return model_card(
        repo_id=repo_id,
        base_model=base_model,
        environment="ALFWorld (text)",
        splits={"train": 3553, "valid_seen": 140, "valid_unseen": 134},
        replay_config=REPLAY_CONFIG,
        results={"valid_seen": {"before": 0.25, "after": 0.35}, "valid_unseen": {"before": 0.125, "after": 0.2}},
        versions=VERSIONS,
        tags=tags,
    )


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """Records the Hub calls instead of making them; keeps the committed bytes and serves them to downloads."""
    calls = SimpleNamespace(create_repo=[], create_branch=[], create_commit=[], snapshot_download=[], repos={})

    def create_repo(self, repo_id, **kwargs):
        calls.create_repo.append({"repo_id": repo_id, **kwargs})
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        calls.create_branch.append({"repo_id": repo_id, **kwargs})

    def create_commit(self, repo_id, operations, **kwargs):
        operations = list(operations)
        files = calls.repos.setdefault((repo_id, kwargs.get("revision")), {})  # a commit adds to what is there
        for op in operations:
            source = op.path_or_fileobj
            files[op.path_in_repo] = source if isinstance(source, bytes) else Path(source).read_bytes()
        calls.create_commit.append({"repo_id": repo_id, "operations": operations, **kwargs})
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc123")

    def snapshot_download(self, repo_id, *, repo_type=None, revision=None, **kwargs):
        # Laid out as the Hub cache does: file contents in blobs/, the snapshot folder made of symlinks to them.
        calls.snapshot_download.append({"repo_id": repo_id, "repo_type": repo_type, "revision": revision, **kwargs})
        cache = tmp_path / "hub-cache" / repo_id.replace("/", "--")
        folder = cache / "snapshots" / str(len(calls.snapshot_download))
        for i, (name, data) in enumerate(calls.repos[(repo_id, revision)].items()):
            blob = cache / "blobs" / f"{len(calls.snapshot_download)}-{i}"
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).symlink_to(blob)
        return str(folder)

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    monkeypatch.setattr(huggingface_hub.HfApi, "snapshot_download", snapshot_download)
    return calls


@pytest.fixture
def output_dir(tmp_path):
    """A real `save_pretrained` output plus the junk a training run leaves next to it."""
    out = tmp_path / "out"
    tokenizer = build_tiny_tokenizer(["go", "to", "desk", "1"])
    build_tiny_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = set(os.listdir(out))
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "model.safetensors").write_bytes(b"old")
    (out / "checkpoint-1" / "optimizer.pt").write_bytes(b"opt")
    (out / "checkpoint-1" / "config.json").write_text("{}")
    (out / "exreplay_pool").mkdir()
    (out / "exreplay_pool" / STATE_FILE).write_text("{}")
    (out / "runs").mkdir()
    (out / "runs" / "x").write_text("events")
    (out / "training_args.bin").write_bytes(b"pickle")
    (out / "optimizer.pt").write_bytes(b"pickle")
    (out / "pytorch_model.bin").write_bytes(b"pickle")
    (out / ".README.md.tmp-dead").write_text("half a card")
    return out, saved


def uploaded(commit) -> dict[str, object]:
    return {op.path_in_repo: op.path_or_fileobj for op in commit["operations"]}


# --------------------------------------------------------------------------------------------------------------------
# model card
# --------------------------------------------------------------------------------------------------------------------


def test_model_card_front_matter():
    card = ModelCard(make_card())
    assert card.data.library_name == "transformers"
    assert card.data.base_model == "Qwen/Qwen3-0.6B"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.tags == ["trl", "grpo", "exreplay", "alfworld"]  # the duplicate "trl" is dropped


def test_model_card_body():
    text = make_card()
    assert text.startswith("---\n")
    assert "# tiny-alfworld" in text
    assert "ExReplayGRPOTrainer" in text and "ALFWorld (text)" in text
    assert "| valid_seen | 140 |" in text and "| train | 3553 |" in text
    assert "| valid_seen | 25.0% | 35.0% |" in text
    assert "| valid_unseen | 12.5% | 20.0% |" in text
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-alfworld")' in text
    # sorted, one "key: value" line each
    lines = [f"{k}: {json.dumps(REPLAY_CONFIG[k])}" for k in sorted(REPLAY_CONFIG)]
    assert "```yaml\n" + "\n".join(lines) + "\n```" in text
    for package, version in VERSIONS.items():
        assert f"- {package}: {version}" in text
    assert text.count("```bibtex") == 4
    for entry in CITATIONS.values():
        assert entry in text
    for arxiv_id in ARXIV_IDS:
        assert arxiv_id in text


def test_citations_cover_the_four_papers():
    assert set(CITATIONS) == {"ExGRPO", "AgentEvolver", "ALFWorld", "GRPO"}
    for name, arxiv_id in zip(["ExGRPO", "AgentEvolver", "ALFWorld", "GRPO"], ARXIV_IDS):
        entry = CITATIONS[name]
        assert re.search(r"eprint\s*=\s*\{(arXiv:)?" + re.escape(arxiv_id) + r"\}", entry), name
        assert entry.count("{") == entry.count("}")
    assert CITATIONS["GRPO"] == GRPOTrainer._paper["citation"]  # TRL's own, as in its model cards


def test_model_card_without_base_model():
    card = ModelCard(make_card(base_model=None, tags=()))
    assert card.data.base_model is None
    assert "base_model" not in card.content.split("---")[1]
    assert card.data.tags == ["trl", "grpo", "exreplay"]


# --------------------------------------------------------------------------------------------------------------------
# model files
# --------------------------------------------------------------------------------------------------------------------


def test_model_files_is_the_top_level_allow_list(output_dir):
    out, saved = output_dir
    assert model_files(str(out)) == sorted(name for name in saved if publishable(name))
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(model_files(str(out)))
    assert "README.md" in MODEL_FILE_PATTERNS


def test_model_files_sharded_and_peft(tmp_path):
    names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "adapter_config.json",
        "adapter_model.safetensors",
        "adapter_model.bin",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "rng_state.pth",
        "scheduler.pt",
        "trainer_state.json",
    ]
    for name in names:
        (tmp_path / name).write_text("x")
    assert model_files(str(tmp_path)) == sorted(name for name in names if publishable(name))


# --------------------------------------------------------------------------------------------------------------------
# push_model
# --------------------------------------------------------------------------------------------------------------------


def test_push_model_uploads_exactly_the_model_files(hub, output_dir):
    out, saved = output_dir
    card = make_card()
    url = push_model(str(out), "me/tiny-alfworld", card, private=True, token="hf_fake")

    assert url == "https://huggingface.co/me/tiny-alfworld/commit/abc123"
    assert len(hub.create_repo) == 1
    repo_call = hub.create_repo[0]
    assert repo_call["repo_id"] == "me/tiny-alfworld"
    assert repo_call.get("repo_type") in (None, "model")
    assert repo_call["exist_ok"] is True and repo_call["private"] is True
    assert hub.create_branch == []

    assert len(hub.create_commit) == 1
    commit = hub.create_commit[0]
    assert commit["repo_id"] == "me/tiny-alfworld"
    assert commit["repo_type"] in (None, "model")
    assert commit["commit_message"] == "Upload model trained with trl-exreplay"
    files = uploaded(commit)
    expected = sorted({name for name in saved if publishable(name)} | {"README.md"})
    assert sorted(files) == expected
    assert [op.path_in_repo for op in commit["operations"]] == expected
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= set(files)
    for junk in ("training_args.bin", "optimizer.pt", "pytorch_model.bin", ".README.md.tmp-dead"):
        assert junk not in files
    assert not any(name.startswith(("checkpoint-", "exreplay_pool", "runs")) for name in files)
    for name, source in files.items():
        assert source == os.path.join(str(out), name)

    readme = (out / "README.md").read_text()
    assert readme == card
    data = ModelCard(readme).data
    assert data.base_model == "Qwen/Qwen3-0.6B"
    assert {"trl", "grpo", "exreplay", "alfworld"} <= set(data.tags)
    for text in ("25.0%", "35.0%", "alfworld: 0.4.2", *REPLAY_CONFIG, *ARXIV_IDS):
        assert text in readme
    assert {name for name in os.listdir(out) if name.startswith(".")} == {".README.md.tmp-dead"}  # no temp left


def test_push_model_overwrites_an_old_readme_and_uses_revision(hub, output_dir):
    out, _ = output_dir
    (out / "README.md").write_text("stale card")
    push_model(str(out), "me/tiny", "new card", revision="v1", commit_message="msg")
    assert (out / "README.md").read_text() == "new card"
    assert hub.create_branch == [{"repo_id": "me/tiny", "branch": "v1", "repo_type": None, "exist_ok": True}]
    assert hub.create_commit[0]["revision"] == "v1" and hub.create_commit[0]["commit_message"] == "msg"


def test_push_model_without_weights_raises(hub, tmp_path):
    out = tmp_path / "no_weights"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match="no_weights"):
        push_model(str(out), "me/tiny", "card")
    with pytest.raises(FileNotFoundError, match="missing"):
        push_model(str(tmp_path / "missing"), "me/tiny", "card")
    assert not (out / "README.md").exists()
    assert hub.create_repo == [] and hub.create_commit == []


# --------------------------------------------------------------------------------------------------------------------
# push_pool
# --------------------------------------------------------------------------------------------------------------------


def make_pool() -> ExperiencePool:
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_store_rbound=4)
    for i, (task_id, successes, entropies) in enumerate([("a", 1, [0.3]), ("b", 2, [0.9, 0.4, 0.6]), ("c", 4, [])]):
        trajectories = [
            Trajectory(task_id, [1, 2], [3 + j, 4], [1, 0], [-0.5, 0.0], [1.0, 0.25], 1.0, entropy=e, policy_version=i)
            for j, e in enumerate(entropies)
        ]
        row = json.dumps({"task_id": task_id, "prompt": f"put a {task_id} on the desk"})
        pool.record_outcome(TaskOutcome(task_id, successes, 4, trajectories, row))
    return pool


def files_under(folder) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
        for root, _, names in os.walk(folder)
        for name in names
    )


def shard_rows(files: dict[str, bytes]) -> int:
    """Rows in the uploaded trajectory shards."""
    return sum(
        pa.ipc.open_stream(pa.BufferReader(data)).read_all().num_rows
        for name, data in files.items()
        if name.startswith("trajectories-")
    )


def all_trajectories(pool) -> list[dict]:
    rows = [dict(t.__dict__) for task in pool.stored_tasks() for t in pool.trajectories(task)]
    return sorted(rows, key=lambda row: row["traj_id"])


def dataset_rows(folder, cache_dir) -> list[dict]:
    """The trajectories as `datasets.load_dataset(repo_id)` reads the repository: the files its card's default config
    names, with the features they declare. (Given a local folder, `load_dataset` takes a top-level state.json for
    `save_to_disk` output and refuses it; a Hub repository id is not checked that way, so the card is followed here.)
    """
    card = huggingface_hub.DatasetCard.load(str(Path(folder) / "README.md"))
    (default,) = [config for config in card.data.configs if config["config_name"] == "default"]
    data_files = [str(Path(folder) / name) for name in default["data_files"]]
    table = datasets.load_dataset("arrow", data_files=data_files, split="train", cache_dir=str(cache_dir))
    assert table.features == TRAJECTORY_FEATURES  # the features the shards declare
    return sorted(table, key=lambda r: r["traj_id"])


def trajectory(task_id, entropy, version=0):
    return Trajectory(task_id, [1], [2, 3], [1, 1], [-0.1, -0.2], [1.0], 1.0, entropy, version)


@pytest.mark.parametrize("empty", [False, True])
def test_push_pool_round_trip(hub, tmp_path, empty):
    pool = ExperiencePool() if empty else make_pool()
    assert empty or pool.num_trajectories == 3
    pool_dir = tmp_path / "exreplay_pool"
    pool.save(str(pool_dir))
    saved = files_under(pool_dir)
    (pool_dir / ".partial.tmp").write_text("leftover")
    if not empty:
        assert [name.split("-")[0] for name in saved] == ["state.json", "tasks", "trajectories"]

    url = push_pool(str(pool_dir), "me/alfworld-pool", private=False)

    assert url == "https://huggingface.co/me/alfworld-pool/commit/abc123"
    assert hub.create_repo == [
        {"repo_id": "me/alfworld-pool", "private": False, "repo_type": "dataset", "exist_ok": True}
    ]
    assert len(hub.create_commit) == 1
    assert hub.create_commit[0]["repo_type"] == "dataset"
    files = hub.repos[("me/alfworld-pool", None)]
    assert sorted(files) == sorted([*saved, "README.md"])  # the snapshot's files, not the leftover

    readme = files["README.md"].decode()
    card = huggingface_hub.DatasetCard(readme)
    assert {"trl", "exreplay"} <= set(card.data.tags)
    assert 'pool_from_hub("me/alfworld-pool"' in readme and "`completion_ids`" in readme
    assert 'datasets.load_dataset("me/alfworld-pool", split="train")' in readme

    loaded = pool_from_hub("me/alfworld-pool")
    assert hub.snapshot_download == [
        {"repo_id": "me/alfworld-pool", "repo_type": "dataset", "revision": None, "cache_dir": None}
    ]
    assert loaded.content_hash() == pool.content_hash()
    if not empty:
        assert card.data.configs[0]["data_files"] == [n for n in saved if n.startswith("trajectories-")]
        download = huggingface_hub.HfApi().snapshot_download("me/alfworld-pool", repo_type="dataset")
        want = all_trajectories(pool)
        assert len(want) == 3 and dataset_rows(download, tmp_path / "cache") == want


def test_push_pool_of_a_live_pool_compacts_and_pool_from_hub_checks_the_tokenizer(hub, tmp_path):
    tokenizer = build_tiny_tokenizer(["go", "to", "desk"])
    other = build_tiny_tokenizer(["go", "to", "shelf"])  # same size, one other word
    pool = ExperiencePool(replay_max_trajectories_per_task=2, replay_store_rbound=4, shard_rows=4)
    pool.bind_tokenizer(tokenizer_fingerprint(tokenizer))
    pool.record_outcome(TaskOutcome("a", 2, 4, [trajectory("a", 0.9), trajectory("a", 0.8)], '{"prompt": "a"}'))
    pool.record_outcome(TaskOutcome("b", 1, 4, [trajectory("b", 0.7)], '{"prompt": "b"}'))
    pool.record_outcome(TaskOutcome("c", 1, 4, [trajectory("c", 0.6)], '{"prompt": "c"}'))  # 4 rows: one shard
    pool.flush()
    pool.record_outcome(TaskOutcome("a", 1, 4, [trajectory("a", 0.3, 1)], None))  # evicts 0.9, a written row
    pool.flush()
    assert pool.storage_stats()["trajectory_dead_rows"] == 1

    push_pool(pool, "me/pool", private=True, token="hf_fake")

    files = hub.repos[("me/pool", None)]
    assert shard_rows(files) == pool.num_trajectories == 4  # no evicted row is published
    assert pool.storage_stats()["trajectory_dead_rows"] == 0
    want = all_trajectories(pool)
    assert [(row["task_id"], row["entropy"]) for row in want] == [
        ("a", pytest.approx(0.8)),
        ("b", pytest.approx(0.7)),
        ("c", pytest.approx(0.6)),
        ("a", pytest.approx(0.3)),
    ]
    loaded = pool_from_hub("me/pool", tokenizer=tokenizer)
    assert loaded.content_hash() == pool.content_hash()
    assert dataset_rows(tmp_path / "hub-cache" / "me--pool" / "snapshots" / "1", tmp_path / "cache1") == want
    shutil.rmtree(tmp_path / "hub-cache" / "me--pool" / "blobs")  # the Hub cache is cleaned: the pool keeps its rows
    assert all_trajectories(loaded) == want
    loaded.save(str(tmp_path / "from-hub"))
    assert ExperiencePool.load(str(tmp_path / "from-hub")).content_hash() == pool.content_hash()
    with pytest.raises(ValueError, match="another tokenizer"):
        pool_from_hub("me/pool", tokenizer=other)

    # A second push to the same repository: the first push's shards stay in it, unnamed; both readers see the new
    # pool only.
    pool.record_outcome(TaskOutcome("a", 4, 4, [], None))  # a leaves for the skip set
    push_pool(pool, "me/pool")
    loaded = pool_from_hub("me/pool")
    assert loaded.content_hash() == pool.content_hash() and loaded.stored_tasks() == ["b", "c"]
    assert shard_rows(hub.repos[("me/pool", None)]) == 4 + 2  # the old shard is still there
    assert dataset_rows(tmp_path / "hub-cache" / "me--pool" / "snapshots" / "3", tmp_path / "cache2") == (
        all_trajectories(pool)
    )


def test_push_pool_compacts_a_folder_with_evicted_rows_in_place(hub, tmp_path):
    pool = ExperiencePool(replay_max_trajectories_per_task=1, replay_store_rbound=4)
    for task in "tuv":
        pool.record_outcome(TaskOutcome(task, 1, 4, [trajectory(task, 0.5)], f'{{"prompt": "{task}"}}'))
    pool.flush()
    pool.record_outcome(TaskOutcome("t", 1, 4, [trajectory("t", 0.4, 1)], None))  # 1 of the shard's 3 rows evicted
    folder = tmp_path / "pool"
    pool.save(str(folder))
    state = json.loads((folder / STATE_FILE).read_text())
    assert [(e["rows"], e["live"]) for e in state["shards"]] == [(3, 2), (1, 1)]

    push_pool(str(folder), "me/pool")

    files = hub.repos[("me/pool", None)]
    assert shard_rows(files) == 3
    assert sorted(files) == sorted([*files_under(folder), "README.md"])  # the folder is the compacted snapshot
    assert [(e["rows"], e["live"]) for e in json.loads((folder / STATE_FILE).read_text())["shards"]] == [
        (1, 1),
        (2, 2),
    ]
    assert ExperiencePool.load(str(folder)).content_hash() == pool.content_hash()


def test_push_pool_custom_card_and_revision(hub, tmp_path):
    pool_dir = tmp_path / "pool"
    make_pool().save(str(pool_dir))
    push_pool(str(pool_dir), "me/pool", card="my card", revision="run-2", commit_message="pool at step 40")
    commit = hub.create_commit[0]
    assert hub.repos[("me/pool", "run-2")]["README.md"] == b"my card"
    assert commit["revision"] == "run-2" and commit["commit_message"] == "pool at step 40"
    assert hub.create_branch == [{"repo_id": "me/pool", "branch": "run-2", "repo_type": "dataset", "exist_ok": True}]
    loaded = pool_from_hub("me/pool", revision="run-2")
    assert hub.snapshot_download[-1]["revision"] == "run-2" and loaded.content_hash() == make_pool().content_hash()


def test_push_pool_rejects_a_folder_that_is_not_a_pool(hub, tmp_path):
    not_a_pool = tmp_path / "not_a_pool"
    not_a_pool.mkdir()
    (not_a_pool / "data.arrow").write_text("x")
    with pytest.raises(FileNotFoundError, match="not_a_pool"):
        push_pool(str(not_a_pool), "me/pool")

    (not_a_pool / STATE_FILE).write_text(json.dumps({"format_version": 999}))
    with pytest.raises(ValueError, match="format_version"):
        push_pool(str(not_a_pool), "me/pool")

    (not_a_pool / STATE_FILE).write_text("not json")
    with pytest.raises(ValueError, match="not_a_pool"):
        push_pool(str(not_a_pool), "me/pool")

    incomplete = tmp_path / "incomplete"
    make_pool().save(str(incomplete))
    for shard in incomplete.glob("trajectories-*"):
        shard.unlink()
    with pytest.raises(ValueError, match="incomplete/trajectories-[0-9a-f]{16}.arrow: cannot be read"):
        push_pool(str(incomplete), "me/pool")
    assert hub.create_repo == [] and hub.create_commit == []


def test_push_pool_uploads_nothing_from_a_hub_snapshot_whose_blobs_is_a_link(hub, tmp_path):
    """Issue 71: ``<repo>/blobs`` is a place a snapshot's files may lead only as a folder; a link to ``/`` made every
    file anywhere one of the pool's, and `push_pool` uploaded the files it led to."""
    make_pool().save(str(tmp_path / "pool"))
    repo = tmp_path / "cache" / "datasets--me--pool"
    snapshot = repo / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    for file in (tmp_path / "pool").iterdir():
        os.replace(file, tmp_path / "elsewhere" / file.name)
        (snapshot / file.name).symlink_to(tmp_path / "elsewhere" / file.name)
    (repo / "blobs").symlink_to("/")
    with pytest.raises(PoolFormatError, match=r"snapshots/abc/state.json: resolves to .* outside the pool folder"):
        push_pool(str(snapshot), "me/pool")
    assert hub.create_repo == [] and hub.create_commit == []


def test_push_pool_refuses_a_state_without_a_tokenizer_fingerprint(hub, tmp_path):
    """Issue 71: the card names the fingerprint; without the field, the push failed with a raw KeyError."""
    folder = tmp_path / "pool"
    make_pool().save(str(folder))
    state = json.loads((folder / STATE_FILE).read_text())
    del state["tokenizer_fingerprint"]
    state["checksum"] = state_checksum(state)
    (folder / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(PoolFormatError, match=r"state.json: the state lacks the fields \['tokenizer_fingerprint'\]"):
        push_pool(str(folder), "me/pool")
    assert hub.create_repo == [] and hub.create_commit == []


def test_the_readmes_hub_snippet_pushes_the_model_and_the_pool_and_starts_a_run_from_it(hub, tmp_path, monkeypatch):
    """README's "Push the model and the pool", run as written after a short training run (the Hub recorded): the
    model's files and the pool go up, and a new trainer starts from the pool it downloads."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import make_trainer

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if "push_pool(" in b)
    pushed, started = snippet.split("\n# later:")
    started = started.split("\n", 1)[1]  # the comment's own line
    # transformers reads the repository's id off create_repo's answer, and uploads the model with upload_folder
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kw: huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}"))  # fmt: skip
    models = []

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        models.append((repo_id, sorted(os.listdir(folder_path))))
        return SimpleNamespace(commit_url="recorded", oid="0", pr_url=None)

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    trainer = make_trainer(tmp_path / "run", max_steps=4, replay_start_ratio=0.25, push_to_hub=True,
                           hub_model_id="you/Qwen2.5-0.5B-GRPO")  # fmt: skip
    names = {"trainer": trainer, "exit_distributed": lambda: None}
    exec(pushed, names)
    assert trainer.pool.num_trajectories > 0
    assert [(repo, "model.safetensors" in files) for repo, files in models] == [("you/Qwen2.5-0.5B-GRPO", True)]
    assert shard_rows(hub.repos[("you/Qwen2.5-0.5B-GRPO-pool", None)]) == trainer.pool.num_trajectories
    names.pop("__builtins__", None)
    trainer.save_model(str(tmp_path / "model"))  # the model as the README's script names it: a path (or Hub id)
    later = {"tokenizer": trainer.processing_class, "GRPOTrainer": type(trainer), "model": str(tmp_path / "model"),
             "accuracy_reward": trainer.reward_funcs[0], "args": trainer.args, "dataset": trainer.train_dataset}  # fmt: skip
    later = {**names, **later}  # the snippet's imports, at its top, hold for both parts
    exec(started, later)
    assert later["trainer"] is not trainer and later["trainer"].pool.content_hash() == trainer.pool.content_hash()
