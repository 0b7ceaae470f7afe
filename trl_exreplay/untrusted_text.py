"""Untrusted text (retrieved experience, an environment's observations) made safe to tokenize into a prompt.

Two rules, as pure functions of a tokenizer and a string:

* **No forged tokens.** A tokenizer parses the text of its added tokens (`<|im_start|>`, `<eos>`, a role marker)
  wherever it occurs, even inside ordinary text. Retrieved text spelling one would put a chat turn or an end of
  sequence into the trained prompt, so `remove_token_strings` deletes every such spelling (again and again: deleting one
  can join the pieces of another, `<eo<eos>s>`).
* **A token budget.** `token_prefix` keeps the first `max_tokens` tokens of a text without tokenizing all of it
  (a 2-million-word observation costs what its kept prefix costs), by tokenizing ever longer prefixes.

Example:

```python
from trl_exreplay.tiny import build_tiny_tokenizer
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

__all__ = ["added_token_strings", "remove_token_strings", "token_prefix"]

_FIRST_CHARS_PER_TOKEN = 8  # the first prefix tried holds this many characters per wanted token, then doubles


def added_token_strings(tokenizer) -> list[str]:
    """The text of every token the tokenizer matches before its model runs (special or added), longest first."""
    strings = {str(token) for token in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    strings |= set(getattr(tokenizer, "all_special_tokens", []))
    return sorted((s for s in strings if s), key=lambda s: (-len(s), s))


def remove_token_strings(text: str, token_strings: list[str]) -> tuple[str, int]:
    """`text` without any spelling of `token_strings`, and how many were removed."""
    if not token_strings:
        return text, 0
    pattern = re.compile("|".join(re.escape(s) for s in token_strings))
    removed = 0
    while True:
        text, count = pattern.subn("", text)
        if not count:
            return text, removed
        removed += count


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
