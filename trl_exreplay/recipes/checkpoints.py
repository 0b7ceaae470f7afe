"""Which checkpoint a run resumes from: `--resume_from_checkpoint` resolved before any work, so that a wrong value
fails at once, not after the games and the warm start."""

from __future__ import annotations

import os


def checkpoint_to_resume(training_args) -> str | None:
    """`--resume_from_checkpoint`: a checkpoint folder, or `true` for the newest complete `checkpoint-*` in
    `output_dir`. Resolved before any work, so that a wrong value fails at once, not after the games and the warm
    start. A run killed while saving leaves a folder without `trainer_state.json` (written last): it is skipped."""
    value = training_args.resume_from_checkpoint
    if value is None or str(value).lower() in ("", "false"):
        return None
    if str(value).lower() != "true":
        if not os.path.isfile(os.path.join(value, "trainer_state.json")):
            raise ValueError(
                f"Invalid value {value!r} for `resume_from_checkpoint`: allowed values are a checkpoint "
                "folder (one holding trainer_state.json), true (the newest checkpoint in `output_dir`) "
                "or false."
            )
        return value
    from transformers.trainer_utils import sort_checkpoints  # checkpoint-<step> folders by step, oldest first

    output_dir = training_args.output_dir
    for path in reversed(sort_checkpoints(output_dir)):
        if os.path.isfile(os.path.join(path, "trainer_state.json")):
            return path
        print(f"resume_from_checkpoint: skipping {path}, an incomplete checkpoint (no trainer_state.json)")
    hint = " (this config saves none: set --save_strategy steps)" if training_args.save_strategy == "no" else ""
    raise ValueError(
        f"Invalid value {value!r} for `resume_from_checkpoint`: `output_dir` {output_dir!r} holds no "
        f"complete checkpoint-* folder to resume from{hint}."
    )
