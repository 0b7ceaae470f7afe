"""`trl_exreplay.recipes.checkpoints.checkpoint_to_resume`: which checkpoint a run resumes from, decided before any work."""

from types import SimpleNamespace

import pytest

from trl_exreplay.recipes.checkpoints import checkpoint_to_resume


def args(output_dir, value, save_strategy="steps"):
    return SimpleNamespace(output_dir=str(output_dir), resume_from_checkpoint=value, save_strategy=save_strategy)


def checkpoint(output_dir, step, complete=True):
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "trainer_state.json").write_text("{}")
    return folder


@pytest.mark.parametrize("value", [None, "", "false", "False"])
def test_no_resume(tmp_path, value):
    assert checkpoint_to_resume(args(tmp_path, value)) is None


def test_true_takes_the_newest_complete_checkpoint_by_step_not_by_name(tmp_path, capsys):
    checkpoint(tmp_path, 9)
    checkpoint(tmp_path, 10)
    checkpoint(tmp_path, 12, complete=False)  # killed while saving: trainer_state.json is written last
    (tmp_path / "checkpoint-final").mkdir()  # not a step: ignored
    assert checkpoint_to_resume(args(tmp_path, "true")) == str(tmp_path / "checkpoint-10")
    assert "skipping" in capsys.readouterr().out and "checkpoint-12" not in str(
        checkpoint_to_resume(args(tmp_path, "True"))
    )


def test_a_named_folder_must_be_a_complete_checkpoint(tmp_path):
    good = checkpoint(tmp_path, 3)
    assert checkpoint_to_resume(args(tmp_path, str(good))) == str(good)
    bad = checkpoint(tmp_path, 4, complete=False)
    with pytest.raises(ValueError, match="allowed values are a checkpoint folder"):
        checkpoint_to_resume(args(tmp_path, str(bad)))


def test_true_without_a_complete_checkpoint_says_why(tmp_path):
    checkpoint(tmp_path, 5, complete=False)
    with pytest.raises(ValueError, match=r"holds no complete checkpoint-\* folder to resume from\.$"):
        checkpoint_to_resume(args(tmp_path, "true"))
    with pytest.raises(ValueError, match="this config saves none"):
        checkpoint_to_resume(args(tmp_path / "missing", "true", save_strategy="no"))
