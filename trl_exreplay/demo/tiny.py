"""Tiny causal LMs with word-level tokenizers, built locally (no Hub access needed).

Used by the tests, the examples and the CPU recipe: a randomly initialised Llama with a few thousand parameters and a
`tokenizers` word-level tokenizer over a given vocabulary, with a chat template, pad and eos set.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

SPECIAL_TOKENS = ["<pad>", "<unk>", "<bos>", "<eos>", "<user>", "<assistant>", "<system>", "<tool>"]

# Each message is rendered as "<role> words <eos>"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '> ' + message['content'] + ' <eos> ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}"
)


def build_tiny_tokenizer(
    words: Iterable[str], lowercase: bool = False, isolate: str = "", phrases: Iterable[str] = ()
):
    """A `PreTrainedTokenizerFast` over `SPECIAL_TOKENS` + `words` (whitespace split, word level).

    `lowercase` lower-cases text before the split; `isolate` lists characters that are tokens of their own even
    inside a word ("," "." for prose: "drawer 1," is "drawer", "1", ","); they must be in `words` to be known.
    `phrases` are tokens that span several words ("drawer 1"): a text that contains one (words separated by single
    spaces, lower case when `lowercase`) gets its id, not those of its words; they join the vocabulary after `words`.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    phrases = list(phrases)
    vocab: dict[str, int] = {}
    for token in [*SPECIAL_TOKENS, *words, *phrases]:
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if lowercase:
        backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    chars = "".join("\\" + c for c in isolate)  # the isolated characters, escaped for a regex class
    if phrases:
        # One regex names every piece: a phrase, an isolated character, or a run of other non-space characters;
        # what matches nothing (whitespace) is dropped. Phrases of as many words are grouped by the words that may
        # end them ("(?:book|shelf) (?:12|1)"): one alternative per group, not per phrase, keeps tokenizing fast.
        # The regex takes the first alternative that matches, so groups of more words come first: a phrase that
        # starts with another ("desk 1 top 2" and "desk 1") is tried before it.
        endings: dict[str, set[str]] = {}
        for phrase in phrases:
            head, _, last = phrase.rpartition(" ")
            if head:
                endings.setdefault(head, set()).add(last)
        groups: dict[tuple[int, frozenset], list[str]] = {}
        for head, lasts in endings.items():
            groups.setdefault((head.count(" "), frozenset(lasts)), []).append(head)

        def either(texts):
            longest_first = sorted(texts, key=len, reverse=True)
            return "(?:" + "|".join(re.escape(t).replace("\\ ", " ") for t in longest_first) + ")"

        ordered = sorted(groups.items(), key=lambda group: -group[0][0])
        alternatives = [f"{either(heads)} {either(lasts)}(?![^\\s{chars}])" for (_, lasts), heads in ordered]
        alternatives += [f"[{chars}]"] if isolate else []
        alternatives.append(f"[^\\s{chars}]+")
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(alternatives)), behavior="removed", invert=True)
    elif isolate:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(f"[{chars}]"), behavior="isolated")]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[4:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    # Word-level tokens are whole words: decode with single spaces and no cleanup surprises.
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def build_tiny_model(
    tokenizer,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 512,
):
    """A randomly initialised `LlamaForCausalLM` sized for `tokenizer`, deterministic for a given `seed`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_tiny_model(path: str, words: Iterable[str], seed: int = 0, **model_kwargs) -> str:
    """Build a tiny model and tokenizer and `save_pretrained` both to `path` (returns `path`)."""
    tokenizer = build_tiny_tokenizer(words)
    model = build_tiny_model(tokenizer, seed=seed, **model_kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
