"""The direction control of `benchmarks/alfworld_rl_controls.py`: the models it plays are the warm start moved by
exactly the RL update, its reverse, and the update with random signs."""

import pytest
import torch
from helpers import load_script

from trl_exreplay.demo.tiny import save_tiny_model

WORDS = ["go", "to", "desk", "take", "book", "from", "put", "in/on", "shelf", "1", "2"]


@pytest.fixture(scope="module")
def controls():
    return load_script("benchmarks/alfworld_rl_controls.py", "alfworld_rl_controls")


def test_direction_models_are_the_warm_start_moved_by_the_update(controls, tmp_path):
    warm = save_tiny_model(str(tmp_path / "warm"), WORDS, seed=0, hidden_size=64)
    trained = save_tiny_model(str(tmp_path / "trained"), WORDS, seed=1, hidden_size=64)  # another point, same shapes
    from transformers import AutoModelForCausalLM

    warm_sd = AutoModelForCausalLM.from_pretrained(warm).state_dict()
    trained_sd = AutoModelForCausalLM.from_pretrained(trained).state_dict()
    models = controls.directions(warm, trained, seed=0)
    assert list(models) == ["warm start", "+delta (the RL model)", "-delta (reversed)", "+delta, random signs"]
    start, forward, reversed_, random_signs = (model.state_dict() for model in models.values())
    assert start.keys() == warm_sd.keys()
    flipped = total = 0
    for name in warm_sd:
        delta = trained_sd[name] - warm_sd[name]
        torch.testing.assert_close(start[name], warm_sd[name], rtol=0, atol=0)
        torch.testing.assert_close(forward[name], trained_sd[name], rtol=0, atol=0)
        torch.testing.assert_close(reversed_[name], warm_sd[name] - delta)
        moved = random_signs[name] - warm_sd[name]
        torch.testing.assert_close(moved.abs(), delta.abs())  # the same size, element by element
        changed = delta.abs() > 1e-6
        flipped += int(((moved * delta) < 0)[changed].sum())
        total += int(changed.sum())
    assert total > 10_000
    assert 0.45 < flipped / total < 0.55  # about half the signs flipped


def test_direction_refuses_a_model_of_another_architecture(controls, tmp_path):
    warm = save_tiny_model(str(tmp_path / "warm"), WORDS, seed=0, hidden_size=64)
    other = save_tiny_model(str(tmp_path / "other"), WORDS, seed=0, hidden_size=32)
    with pytest.raises(ValueError, match="--rl-model"):
        controls.directions(warm, other, seed=0)


@pytest.mark.parametrize("argv", [["--control", "direction"], ["--control", "sft", "--rl-model", "x"]])
def test_rl_model_goes_with_the_direction_control_only(controls, argv, capsys):
    with pytest.raises(SystemExit):
        controls.main(["--warm-start", "w", *argv])
    assert "--rl-model is required by --control direction" in capsys.readouterr().err
