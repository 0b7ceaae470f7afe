"""Helpers for the scripts that run the trainer (the recipes): the checkpoint a run resumes from (`checkpoints`), a
stage launched in processes of its own (`launch`), models loaded and saved outside the trainer (`models`)."""
