"""The package's one atomic writer (`trl_exreplay.pool.store.write_atomic`): a write that fails at any point leaves
neither a half-written file nor its temporary, and a file (or a folder) that existed keeps its old content; every
other save that must be whole goes through it."""

from __future__ import annotations

import json
import os

import pytest

from trl_exreplay.pool import store
from trl_exreplay.pool.store import write_atomic, write_json_atomic


class Boom(RuntimeError):
    pass


def fail_after(write):
    """`write`, then a failure: the temporary is half a save when the writer has to clean up."""

    def failing(tmp):
        write(tmp)
        raise Boom("disk full")

    return failing


def write_file(text):
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)

    return write


def write_folder(tmp):
    os.makedirs(os.path.join(tmp, "sub"))
    for name in ("config.json", os.path.join("sub", "weights.bin")):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(name)


@pytest.fixture
def failing_fsync(monkeypatch):
    """The writer's fsync fails: the write itself went through, the rename never happens."""

    def fsync(path):
        raise Boom(f"fsync {path}")

    monkeypatch.setattr(store, "fsync_path", fsync)


def test_a_write_appears_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.json"
    write_json_atomic(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    write_atomic(str(path), write_file("new"))
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]


@pytest.mark.parametrize("existed", [False, True])
def test_a_failed_write_leaves_no_half_file_and_no_temporary(tmp_path, existed):
    path = tmp_path / "f.json"
    if existed:
        path.write_text("old")
    with pytest.raises(Boom):
        write_atomic(str(path), fail_after(write_file("half")))
    assert sorted(os.listdir(tmp_path)) == (["f.json"] if existed else [])
    if existed:
        assert path.read_text() == "old"


@pytest.mark.usefixtures("failing_fsync")
def test_a_failed_fsync_leaves_no_half_file_and_no_temporary(tmp_path):
    with pytest.raises(Boom):
        write_json_atomic(str(tmp_path / "f.json"), {"a": 1})
    assert os.listdir(tmp_path) == []


def test_a_folder_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "model"
    with pytest.raises(Boom):
        write_atomic(str(path), fail_after(write_folder))
    assert os.listdir(tmp_path) == []  # the half-written temporary folder is gone, files and all
    write_atomic(str(path), write_folder)
    assert os.listdir(tmp_path) == ["model"] and (path / "sub" / "weights.bin").read_text() == os.path.join(
        "sub", "weights.bin"
    )


def test_a_folder_is_fsynced_file_by_file(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(store, "fsync_path", lambda p: synced.append(os.path.relpath(p, tmp_path)))
    write_atomic(str(tmp_path / "model"), write_folder)
    files = {os.path.basename(p) for p in synced}
    assert {"config.json", "weights.bin", "sub"} <= files  # the bytes of every file, and the names of every folder


# The former copies: each save below fails only through the shared writer's fsync, and leaves nothing behind.


@pytest.mark.usefixtures("failing_fsync")
def test_the_replay_schedule_saves_through_the_writer(tmp_path):
    from trl_exreplay.schedule import ReplaySchedule

    with pytest.raises(Boom):
        ReplaySchedule(started_at=3).save(str(tmp_path))
    assert os.listdir(tmp_path) == []  # it used to leave exreplay_schedule.json.tmp-<pid>


def test_the_replay_schedule_still_loads_what_it_saves(tmp_path):
    from trl_exreplay.schedule import ReplaySchedule

    ReplaySchedule(started_at=3).save(str(tmp_path))
    assert ReplaySchedule.load(str(tmp_path)) == ReplaySchedule(started_at=3) and len(os.listdir(tmp_path)) == 1


class FakeSaver:
    def __init__(self, name):
        self.name = name

    def save_pretrained(self, folder):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, self.name), "w") as f:
            f.write(self.name)


@pytest.mark.usefixtures("failing_fsync")
def test_a_recipe_model_saves_through_the_writer(tmp_path):
    from trl_exreplay.recipes.models import save_atomically

    with pytest.raises(Boom):
        save_atomically(str(tmp_path / "model"), FakeSaver("model.safetensors"), FakeSaver("tokenizer.json"))
    assert os.listdir(tmp_path) == []


def test_a_recipe_model_is_saved_whole(tmp_path):
    from trl_exreplay.recipes.models import save_atomically

    save_atomically(str(tmp_path / "model"), FakeSaver("model.safetensors"), FakeSaver("tokenizer.json"))
    assert os.listdir(tmp_path) == ["model"]
    assert sorted(os.listdir(tmp_path / "model")) == ["model.safetensors", "tokenizer.json"]


@pytest.mark.usefixtures("failing_fsync")
def test_the_model_card_is_written_through_the_writer(tmp_path):
    from trl_exreplay.hub import push_model

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(Boom):  # before anything is uploaded
        push_model(str(tmp_path), "user/model", "# card")
    assert os.listdir(tmp_path) == ["model.safetensors"]


def fake_merge(monkeypatch):
    """`merge_adapter`'s loaders replaced: the merged model and the tokenizer are `FakeSaver`s."""
    import peft
    import transformers

    merged = type("Peft", (), {"merge_and_unload": lambda self: FakeSaver("model.safetensors")})()
    monkeypatch.setattr(peft.AutoPeftModelForCausalLM, "from_pretrained", lambda *a, **k: merged)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeSaver("tokenizer.json"))


@pytest.mark.parametrize("in_place", [False, True])
def test_a_merged_adapter_is_saved_through_the_writer(tmp_path, monkeypatch, failing_fsync, in_place):
    """Into a new folder or in place of the adapter's own: a failed save leaves the adapter as it was and no
    temporary; a save that succeeds leaves the merged model alone."""
    from types import SimpleNamespace

    from trl_exreplay.recipes.models import merge_adapter

    fake_merge(monkeypatch)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    into = None if in_place else str(tmp_path / "merged")
    model_args = SimpleNamespace(model_revision=None, attn_implementation=None, dtype=None)
    with pytest.raises(Boom):
        merge_adapter(str(adapter), model_args, into=into)
    assert os.listdir(tmp_path) == ["adapter"] and os.listdir(adapter) == ["adapter_config.json"]
    monkeypatch.undo()
    fake_merge(monkeypatch)
    written = merge_adapter(str(adapter), model_args, into=into)
    assert sorted(os.listdir(written)) == ["model.safetensors", "tokenizer.json"]
    assert sorted(os.listdir(tmp_path)) == (["adapter"] if in_place else ["adapter", "merged"])
