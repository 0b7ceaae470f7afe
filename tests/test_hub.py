"""Tests for `trl_exreplay.hub`: the model card, which files are published, and the pool upload round trip.

The network is cut off by replacing `HfApi.create_repo` / `create_branch` / `create_commit` with recorders.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import ModelCard
from trl import GRPOTrainer

from trl_exreplay.hub import CITATIONS, MODEL_FILE_PATTERNS, model_card, model_files, push_model, push_pool
from trl_exreplay.pool import STATE_FILE, TRAJECTORIES_DIR, ExperiencePool, TaskOutcome, Trajectory
from trl_exreplay.tiny import build_tiny_model, build_tiny_tokenizer

ARXIV_IDS = ("2510.02245", "2511.10395", "2010.03768", "2402.03300")
REPLAY_CONFIG = {"replay_ratio": 0.5, "exp_select_mode": "argmin", "max_policy_age": None, "experience_rbound": 8}
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
def hub(monkeypatch):
    """Records the Hub calls instead of making them."""
    calls = SimpleNamespace(create_repo=[], create_branch=[], create_commit=[])

    def create_repo(self, repo_id, **kwargs):
        calls.create_repo.append({"repo_id": repo_id, **kwargs})
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        calls.create_branch.append({"repo_id": repo_id, **kwargs})

    def create_commit(self, repo_id, operations, **kwargs):
        operations = list(operations)
        calls.create_commit.append({"repo_id": repo_id, "operations": operations, **kwargs})
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc123")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
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
    pool = ExperiencePool(max_trajectories_per_task=2, experience_rbound=4)
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


def rebuild(commit, target) -> None:
    """Lay out what was uploaded by its path_in_repo, as `snapshot_download` would."""
    for path_in_repo, source in uploaded(commit).items():
        dest = os.path.join(target, *path_in_repo.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if isinstance(source, bytes):
            with open(dest, "wb") as f:
                f.write(source)
        else:
            shutil.copyfile(source, dest)


@pytest.mark.parametrize("empty", [False, True])
def test_push_pool_round_trip(hub, tmp_path, empty):
    pool = ExperiencePool() if empty else make_pool()
    assert empty or pool.num_trajectories == 3
    pool_dir = tmp_path / "exreplay_pool"
    pool.save(str(pool_dir))
    saved = files_under(pool_dir)
    (pool_dir / ".partial.tmp").write_text("leftover")
    if not empty:
        assert f"{TRAJECTORIES_DIR}/dataset_info.json" in saved

    url = push_pool(str(pool_dir), "me/alfworld-pool", private=False)

    assert url == "https://huggingface.co/me/alfworld-pool/commit/abc123"
    assert hub.create_repo == [
        {"repo_id": "me/alfworld-pool", "private": False, "repo_type": "dataset", "exist_ok": True}
    ]
    assert len(hub.create_commit) == 1
    commit = hub.create_commit[0]
    assert commit["repo_type"] == "dataset"
    assert sorted(uploaded(commit)) == sorted([*saved, "README.md"])

    readme = uploaded(commit)["README.md"].decode()
    assert {"trl", "exreplay"} <= set(huggingface_hub.DatasetCard(readme).data.tags)
    assert 'snapshot_download("me/alfworld-pool", repo_type="dataset")' in readme
    assert "ExperiencePool.load" in readme and "`completion_ids`" in readme

    rebuilt = tmp_path / "download"
    rebuild(commit, rebuilt)
    assert ExperiencePool.load(str(rebuilt)).content_hash() == pool.content_hash()


def test_push_pool_custom_card_and_revision(hub, tmp_path):
    pool_dir = tmp_path / "pool"
    make_pool().save(str(pool_dir))
    push_pool(str(pool_dir), "me/pool", card="my card", revision="run-2", commit_message="pool at step 40")
    commit = hub.create_commit[0]
    assert uploaded(commit)["README.md"] == b"my card"
    assert commit["revision"] == "run-2" and commit["commit_message"] == "pool at step 40"
    assert hub.create_branch == [{"repo_id": "me/pool", "branch": "run-2", "repo_type": "dataset", "exist_ok": True}]


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
    shutil.rmtree(incomplete / TRAJECTORIES_DIR)
    with pytest.raises(ValueError, match=TRAJECTORIES_DIR):
        push_pool(str(incomplete), "me/pool")
    assert hub.create_repo == [] and hub.create_commit == []
