"""`trl_exreplay.untrusted_text`: removal of spelled special tokens and the token budget, against whole-text tokenization."""

from __future__ import annotations

import random

import pytest

from trl_exreplay.demo.tiny import build_tiny_tokenizer
from trl_exreplay.untrusted_text import (
    SpecialTokenFilter,
    SpelledTokens,
    added_token_strings,
    remove_token_strings,
    token_prefix,
)

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


def test_a_filter_removes_and_counts_refuses_or_keeps(tok):
    remove = SpecialTokenFilter(tok)
    assert remove("<<eos>eos>open<us<user>er>") == "open" and remove.removed == 4
    assert remove("open the red door") == "open the red door" and remove.removed == 4  # a running total
    blocks = [{"type": "text", "text": "red <system>"}, {"type": "image", "image": "<eos>"}]
    assert remove.content(blocks) == [{"type": "text", "text": "red "}, {"type": "image", "image": "<eos>"}]
    assert remove.content("<tool> blue") == " blue" and remove.content(None) is None and remove.removed == 6
    refuse = SpecialTokenFilter(tok, "refuse")
    assert refuse("open the red door") == "open the red door"
    with pytest.raises(SpelledTokens, match="'<eos>'"):
        refuse("open <eo<eos>s> door")
    assert isinstance(SpelledTokens("x"), ValueError) and refuse.removed == 0
    keep = SpecialTokenFilter(tok, "keep")
    assert keep("<eos> <system>") == "<eos> <system>" and keep.removed == 0
    with pytest.raises(ValueError, match=r"Invalid mode 'drop'"):
        SpecialTokenFilter(tok, "drop")


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
