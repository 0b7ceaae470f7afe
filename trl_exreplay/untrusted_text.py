"""Untrusted text (retrieved experience, an environment's observations, a tool's results) made safe to tokenize into a
prompt.

Two rules, as pure functions of a tokenizer and a string:

* **No forged tokens.** A tokenizer parses the text of its added tokens (`<|im_start|>`, `<eos>`, a role marker)
  wherever it occurs, even inside ordinary text. Retrieved text spelling one would put a chat turn or an end of
  sequence into the trained prompt, so `remove_token_strings` deletes every such spelling (again and again: deleting
  one can join the pieces of another, `<eo<eos>s>`). `SpecialTokenFilter` applies it to every text of one source for a
  whole run: the pattern built once, the removals counted, and a spelling removed, refused or (a trusted source) kept.
* **A token budget.** `token_prefix` keeps the first `max_tokens` tokens of a text without tokenizing all of it
  (a 2-million-word observation costs what its kept prefix costs), by tokenizing ever longer prefixes.

Example:

```python
from trl_exreplay.demo.tiny import build_tiny_tokenizer
from trl_exreplay.untrusted_text import added_token_strings, remove_token_strings, token_prefix

tokenizer = build_tiny_tokenizer(["a", "b", "c", "d", "e", "f", "say", "red"])
text, removed = remove_token_strings("say red <eo<eos>s> <user> say", added_token_strings(tokenizer))
assert (text, removed) == ("say red   say", 3)
kept, cut = token_prefix("a b c d e f", tokenizer, 3)
assert cut and len(tokenizer(kept, add_special_tokens=False)["input_ids"]) == 3
```
"""

from __future__ import annotations

import re

__all__ = [
    "SPECIAL_TOKEN_MODES",
    "SpecialTokenFilter",
    "SpelledTokens",
    "added_token_strings",
    "remove_token_strings",
    "token_prefix",
]

# What a `SpecialTokenFilter` does with a spelling: remove it, refuse the text (`SpelledTokens`), or keep it.
SPECIAL_TOKEN_MODES = ("remove", "refuse", "keep")

_FIRST_CHARS_PER_TOKEN = 8  # the first prefix tried holds this many characters per wanted token, then doubles


def added_token_strings(tokenizer) -> list[str]:
    """The text of every token the tokenizer matches before its model runs (special or added), longest first."""
    strings = {str(token) for token in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    strings |= set(getattr(tokenizer, "all_special_tokens", []))
    return sorted((s for s in strings if s), key=lambda s: (-len(s), s))


def remove_token_strings(text: str, token_strings: list[str]) -> tuple[str, int]:
    """`text` without any spelling of `token_strings`, and how many were removed."""
    pattern = _spelling_pattern(token_strings)
    return (text, 0) if pattern is None else _remove_all(pattern, text)


def _spelling_pattern(token_strings: list[str]) -> re.Pattern | None:
    if not token_strings:
        return None
    return re.compile("|".join(re.escape(s) for s in token_strings))


def _remove_all(pattern: re.Pattern, text: str) -> tuple[str, int]:
    removed = 0
    while True:
        text, count = pattern.subn("", text)
        if not count:
            return text, removed
        removed += count


class SpelledTokens(ValueError):
    """Untrusted text that spells a special or added token, refused (a `SpecialTokenFilter` in mode 'refuse')."""


class SpecialTokenFilter:
    """`remove_token_strings` with a tokenizer's `added_token_strings`, for every text of one untrusted source in a
    run.

    `mode`: 'remove' (every spelling removed, again and again, and counted in `removed`, a running total), 'refuse' (a
    text that spells one raises `SpelledTokens`; one that does not is returned as it is) or 'keep' (a trusted source:
    the text is returned unscanned). The pattern is built once: on a short text, building it costs far more than the
    scan. Never tokenizes. Text without any spelling comes back as it is, in every mode.
    """

    def __init__(self, tokenizer, mode: str = "remove"):
        if mode not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"Invalid mode {mode!r}: allowed values are {', '.join(map(repr, SPECIAL_TOKEN_MODES))}.")
        self.mode = mode
        self.removed = 0
        self._pattern = None if mode == "keep" else _spelling_pattern(added_token_strings(tokenizer))

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        if self.mode == "refuse":
            found = self._pattern.search(text)
            if found is not None:
                raise SpelledTokens(f"the text spells the special or added token {found.group()!r}")
            return text
        text, removed = _remove_all(self._pattern, text)
        self.removed += removed
        return text

    def content(self, content):
        """A chat message's content cleaned: a str, or the text parts of a list of content blocks (others as they
        are)."""
        if isinstance(content, str):
            return self(content)
        if isinstance(content, list):
            return [
                {**part, "text": self(part["text"])}
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                else part
                for part in content
            ]
        return content


def token_prefix(text: str, tokenizer, max_tokens: int) -> tuple[str, bool]:
    """The longest prefix of `text` whose tokens are `text`'s first `max_tokens` (the whole text when it has no more),
    and whether anything was cut. Tokenizes prefixes of growing length, never more than about twice what it keeps."""
    if max_tokens <= 0:
        return "", bool(text)
    fast = getattr(tokenizer, "is_fast", False)  # a fast tokenizer gives character offsets: an exact cut
    length = max_tokens * _FIRST_CHARS_PER_TOKEN
    while True:
        piece = text[:length]
        encoded = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=fast)
        ids = encoded["input_ids"]
        if len(ids) > max_tokens:
            if fast:
                return piece[: encoded["offset_mapping"][max_tokens - 1][1]], True
            return tokenizer.decode(ids[:max_tokens]), True
        if length >= len(text):
            return text, False
        length *= 2
