"""The testbeds of `benchmarks/replay_vs_grpo.py`, by name."""

from .alfworld import AlfWorld, AlfWorldFewGames
from .multi_turn import MultiTurn
from .single_turn import SingleTurn

TESTBEDS = {cls.name: cls for cls in (SingleTurn, MultiTurn, AlfWorld, AlfWorldFewGames)}
