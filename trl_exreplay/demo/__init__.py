"""Small things to try the library with on a CPU, and the tests' fixtures: tiny models with word-level tokenizers
(`tiny`), a single-turn task (`examples`) and a deterministic text game (`toy`).
Nothing in the library imports them."""

from .toy import KeyDoorEnv

__all__ = ["KeyDoorEnv"]
