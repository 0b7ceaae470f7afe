"""`trl_exreplay.untrusted_text`: removal of spelled special tokens and the token budget, against whole-text tokenization."""

from __future__ import annotations

import random

import pytest

from trl_exreplay.tiny import build_tiny_tokenizer
from trl_exreplay.untrusted_text import added_token_strings, remove_token_strings, token_prefix

WORDS = ["red", "blue", "door", "key", "open"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(WORDS)


def test_every_spelling_is_removed_even_one_that_removal_joins(tok):
    strings = added_token_strings(tok)
    assert strings[:2] == ["<assistant>", "<system>"] and "<eos>" in strings  # longest first
    assert remove_token_strings("<<eos>eos>open<us<user>er>", strings) == ("open", 4)
    assert remove_token_strings("open the red door", strings) == ("open the red door", 0)
    assert remove_token_strings("<eos>", []) == ("<eos>", 0)


@pytest.mark.parametrize("budget", [1, 2, 7, 40, 1000])
def test_the_prefix_holds_exactly_the_first_tokens_of_the_whole_text(tok, budget):
    rng = random.Random(budget)
    for _ in range(20):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 300)))
        whole = tok(text, add_special_tokens=False)["input_ids"]
        kept, cut = token_prefix(text, tok, budget)
        assert tok(kept, add_special_tokens=False)["input_ids"] == whole[:budget]
        assert cut == (len(whole) > budget) and text.startswith(kept)
    assert token_prefix("red", tok, 0) == ("", True)
