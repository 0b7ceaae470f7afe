"""The tiny word-level tokenizer: multi-word phrase tokens."""

from __future__ import annotations

from trl_exreplay.demo.tiny import SPECIAL_TOKENS, build_tiny_tokenizer

WORDS = ["take", "book", "from", "shelf", "desk", "a", "1", "2", "12", ",", "."]


def pieces(tokenizer, text: str) -> list[str]:
    return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_phrases_are_single_tokens_only_where_a_whole_phrase_stands():
    phrases = ["book 1", "book 2", "shelf 1", "shelf 12", "desk 1"]
    tokenizer = build_tiny_tokenizer(WORDS, lowercase=True, isolate=",.", phrases=phrases)
    first = len(SPECIAL_TOKENS) + len(WORDS)  # phrases come after the words
    assert tokenizer.convert_tokens_to_ids(phrases) == list(range(first, first + len(phrases)))
    assert pieces(tokenizer, "Take Book 2 from shelf 12.") == ["take", "book 2", "from", "shelf 12", "."]
    assert pieces(tokenizer, "a book 1, a shelf 1") == ["a", "book 1", ",", "a", "shelf 1"]
    # not a phrase: a number the phrases lack, a word that merely ends like one, a phrase inside a longer number
    assert pieces(tokenizer, "desk 2 abook 1 shelf 123") == ["desk", "2", "<unk>", "1", "shelf", "<unk>"]
    assert pieces(tokenizer, "book\n1") == ["book", "1"]  # words joined by a single space only
    text = "take book 2 from shelf 12 , a desk 1 ."
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_a_phrase_that_starts_with_another_phrase_wins_where_it_stands():
    # "desk 1" ends where "desk 1 top 2" goes on: the longer phrase must be tried first, whatever the order given
    for phrases in (["desk 1", "desk 1 top 2"], ["desk 1 top 2", "desk 1"]):
        tokenizer = build_tiny_tokenizer([*WORDS, "top"], phrases=phrases)
        text = "a desk 1 top 2 desk 1 top 1"
        assert pieces(tokenizer, text) == ["a", "desk 1 top 2", "desk 1", "top", "1"]


def test_without_phrases_the_tokenizer_is_unchanged():
    plain = build_tiny_tokenizer(WORDS, lowercase=True, isolate=",.")
    assert pieces(plain, "take book 2 from shelf 12.") == ["take", "book", "2", "from", "shelf", "12", "."]
    assert plain.get_vocab() == build_tiny_tokenizer(WORDS, lowercase=True, isolate=",.", phrases=[]).get_vocab()
