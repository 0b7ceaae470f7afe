"""Smoke test of an installed trl-exreplay wheel (.ci/run runs it in a fresh venv that holds the wheel alone).

    python /path/to/checkout/tools/wheel_smoke.py      # from a folder outside the checkout

Asserts that `trl_exreplay` comes from site-packages, not from the checkout; that a tiny trainer replays in its
second step; that ALFWorld games are generated from the package data (`alfred_pairs.json`, read through
`importlib.resources`); and walks the README's quick start on its offline twin (examples/quick_start_offline.py),
which tests/integration/test_quick_start.py also runs from the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
QUICK_START = REPOSITORY / "examples" / "quick_start_offline.py"


def assert_installed() -> None:
    import trl_exreplay

    location = Path(trl_exreplay.__file__).resolve()
    assert REPOSITORY not in location.parents, f"trl_exreplay was imported from the checkout: {location}"
    assert "site-packages" in location.parts, f"trl_exreplay is not an installed package: {location}"
    # the wheel must ship the package data that the ALFWorld generator reads through importlib.resources
    table = Path(str(resources.files("trl_exreplay.alfworld").joinpath("alfred_pairs.json")))
    assert table.is_file() and table.resolve().parent == location.parent / "alfworld", table


def train_with_replay(folder: Path) -> None:
    """Two steps of the say-the-word task: the first fills the pool, the second replays from it."""
    from trl_exreplay import ExReplayGRPOConfig, ExReplayGRPOTrainer
    from trl_exreplay.demo.examples import VOCABULARY, said_target, say_word_dataset
    from trl_exreplay.demo.tiny import build_tiny_model, build_tiny_tokenizer

    config = ExReplayGRPOConfig(
        output_dir=str(folder / "replay"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
        replay_start_ratio=0.25,
        disable_tqdm=True,
    )
    tokenizer = build_tiny_tokenizer(VOCABULARY)
    trainer = ExReplayGRPOTrainer(
        model=build_tiny_model(tokenizer, seed=0),
        reward_funcs=said_target,
        args=config,
        train_dataset=say_word_dataset(num_tasks=4, repeats=8),
        processing_class=tokenizer,
    )
    trainer.train()
    replayed = [e["replay/rows_fraction"] for e in trainer.state.log_history if "replay/rows_fraction" in e]
    assert replayed == [0.0, replayed[1]] and replayed[1] > 0, f"replayed row shares per step: {replayed}"
    assert trainer.pool.stats()["pool_trajectories"] > 0


def generate_alfworld(folder: Path) -> None:
    """Two verified ALFWorld games; the (object, receptacle) weights come from the installed json."""
    from trl_exreplay.alfworld import generate_games

    report = generate_games(folder / "alfworld", "train", num_games=2, seed=0, workers=1)
    assert report.written == 2 and report.failed == 0 and report.verified, report.summary()
    for game_file in report.game_files:
        game = json.loads(Path(game_file).read_text())
        assert game["solvable"] and game["walkthrough"], game_file


def walk_quick_start(folder: Path) -> None:
    """Run the README quick start's offline twin as a newcomer would (`python examples/...` in their own folder):
    it must train to its end, replay, and leave a checkpoint holding the pool."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(QUICK_START)], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (checkpoint,) = (folder / "Qwen2.5-0.5B-GRPO").glob("checkpoint-*")
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] > 0
    replayed = [e["replay/rows_fraction"] for e in state["log_history"] if "replay/rows_fraction" in e]
    assert max(replayed, default=0) > 0, f"no replayed rows in the quick start's logs: {replayed}"
    assert (checkpoint / "exreplay_pool" / "state.json").is_file()


def main() -> None:
    assert_installed()
    with tempfile.TemporaryDirectory() as tmp:
        for check in (train_with_replay, generate_alfworld, walk_quick_start):
            folder = Path(tmp) / check.__name__
            folder.mkdir()
            check(folder)
            print(f"wheel smoke: {check.__name__} ok", flush=True)


if __name__ == "__main__":
    main()
