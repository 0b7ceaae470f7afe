"""`MultiTurnSettings`: the multi-turn engine's settings (`trl_exreplay.envs.multiturn`), given to the trainer with its
games, not fields of the config. Light to import: the ALFWorld recipe's `AlfWorldArguments` extends it."""

from __future__ import annotations

from dataclasses import dataclass

from ..parameters import check, document_fields, is_int, is_number, names
from ..untrusted_text import SPECIAL_TOKEN_MODES


@dataclass
class MultiTurnSettings:
    r"""
    The multi-turn engine's settings, given to the trainer with its games
    (`ExReplayGRPOTrainer(..., text_env_factory=..., multi_turn=MultiTurnSettings(...))`), not fields of the config.

    Parameters:
        > Multi-turn episodes (games given as `text_env_factory`)

        max_turns (`int`, *optional*, defaults to `10`):
            Model turns per episode at most (the episode then ends unsuccessful).
        max_tokens_per_turn (`int | None`, *optional*, defaults to `None`):
            Tokens of one model turn at most. None: max_completion_length.
        env_step_timeout (`float | None`, *optional*, defaults to `60.0`):
            Seconds an environment reset or step may take; a slower one ends its episode as a failure (counted in
            env/errors). None: no limit.
        env_workers (`int`, *optional*, defaults to `16`):
            Environment calls running at once (threads), so a slow one does not serialise.
        env_special_tokens (`str`, *optional*, defaults to `'remove'`):
            What an observation's spellings of the tokenizer's special or added tokens (`<eos>`, a role marker) become
            before it is tokenized, on every backend: 'remove' them (counted in env/special_tokens_removed), 'refuse'
            the episode (a counted environment fault: env/errors), or 'keep' them (a trusted environment that needs
            them). An environment's text is untrusted: a spelled token would put a chat turn or an end of sequence it
            wrote into every rollout and every replayed trajectory.
        system_prompt_column (`str`, *optional*, defaults to `'system_prompt'`):
            Dataset column with an optional system prompt for the episode.
    """

    max_turns: int = 10
    max_tokens_per_turn: int | None = None
    env_step_timeout: float | None = 60.0
    env_workers: int = 16
    env_special_tokens: str = "remove"
    system_prompt_column: str = "system_prompt"

    def __post_init__(self):
        check(is_int(self.max_turns) and self.max_turns >= 1, "max_turns", self.max_turns, "integers >= 1")
        per_turn = self.max_tokens_per_turn
        check(
            per_turn is None or (is_int(per_turn) and per_turn >= 1),
            "max_tokens_per_turn",
            per_turn,
            "None or integers >= 1",
        )
        timeout = self.env_step_timeout
        check(
            timeout is None or (is_number(timeout) and timeout > 0), "env_step_timeout", timeout, "None or numbers > 0"
        )
        check(is_int(self.env_workers) and self.env_workers >= 1, "env_workers", self.env_workers, "integers >= 1")
        check(
            self.env_special_tokens in SPECIAL_TOKEN_MODES,
            "env_special_tokens",
            self.env_special_tokens,
            names(SPECIAL_TOKEN_MODES),
        )
        column = self.system_prompt_column
        check(isinstance(column, str) and column != "", "system_prompt_column", column, "a non-empty column name")


document_fields(MultiTurnSettings)
