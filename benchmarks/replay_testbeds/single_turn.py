"""`single-turn`: repeat a sequence of 2 to 5 symbols (the ExGRPO setting, scaled to a tiny model on CPU).

A problem is "repeat c a f" and its only right answer is "c a f"; the reward is 1 for exactly that. The length is the
difficulty: after the short supervised warm start (lengths 2 and 3 only) a sampled answer of length 2 or 3 is often
right and one of length 4 or 5 rarely, so a batch's tasks spread over the difficulty buckets and rare successes on hard
problems exist, which is what replay feeds on. Training and held-out problems are disjoint draws of the same family.
"""

from __future__ import annotations

import random

from .base import Testbed, chat_prompt, sampled_answers, supervised_warm_start

SYMBOLS = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p"]
VOCABULARY = ["repeat", *SYMBOLS]
LENGTHS = (2, 3, 4, 5)
PROBLEMS_PER_LENGTH = 48  # training problems of each length
HELDOUT_PER_LENGTH = 64
WARM_START_PER_LENGTH = {2: 48, 3: 48, 4: 8, 5: 4}  # mostly short: long answers start rare


def problems(seed: int = 0) -> dict[str, list[list[str]]]:
    """Disjoint `train`, `heldout` and `warm_start` symbol sequences, the same for every run (`seed` is the family's)."""
    rng = random.Random(seed)
    seen: set[tuple[str, ...]] = set()

    def draw(length: int, count: int) -> list[list[str]]:
        out = []
        while len(out) < count:
            sequence = tuple(rng.choice(SYMBOLS) for _ in range(length))
            if sequence not in seen:
                seen.add(sequence)
                out.append(list(sequence))
        return out

    split = {"train": [], "heldout": [], "warm_start": []}
    for length in LENGTHS:
        split["heldout"] += draw(length, HELDOUT_PER_LENGTH)
        split["train"] += draw(length, PROBLEMS_PER_LENGTH)
        split["warm_start"] += draw(length, WARM_START_PER_LENGTH[length])
    return split


def as_rows(sequences: list[list[str]]) -> list[dict]:
    return [
        {"prompt": chat_prompt("repeat " + " ".join(s)), "task_id": "repeat " + " ".join(s), "answer": " ".join(s),
         "length": len(s)}
        for s in sequences
    ]  # fmt: skip


def repeated_exactly(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is exactly the answer (whitespace-normalised), else 0.0."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(" ".join(text.split()) == target) for text, target in zip(texts, answer)]


class SingleTurn(Testbed):
    name = "single-turn"
    summary = "repeat 2-5 symbols; warm start on lengths 2-3; held-out: 256 unseen sequences"
    vocabulary = VOCABULARY
    model_kwargs = dict(hidden_size=64, num_layers=2, num_heads=4)
    training = dict(
        per_device_train_batch_size=64,
        num_generations=8,
        max_steps=400,
        learning_rate=3e-4,
        max_completion_length=8,
        temperature=1.0,
        beta=0.0,
    )
    eval_every = 25
    target_levels = (0.45, 0.50)

    def __init__(self):
        self.split = problems()

    def train_dataset(self, repeats: int):
        from datasets import Dataset

        rows = as_rows(self.split["train"]) * repeats
        return Dataset.from_list(rows)

    def reward_funcs(self):
        return [repeated_exactly]

    def warm_start(self, model, tokenizer, seed: int) -> None:
        pairs = [(row["prompt"], row["answer"]) for row in as_rows(self.split["warm_start"])]
        supervised_warm_start(model, tokenizer, pairs, steps=200, seed=seed, lr=1e-3)

    def heldout_success(self, model, tokenizer, seed: int = 0) -> float:
        rows = as_rows(self.split["heldout"])
        answers = sampled_answers(model, tokenizer, [r["prompt"] for r in rows], self.training["max_completion_length"],
                                  seed=seed)  # fmt: skip
        right = [" ".join(a.split()) == r["answer"] for a, r in zip(answers, rows)]
        self.last_detail = {
            f"length {n}": sum(ok for ok, r in zip(right, rows) if r["length"] == n) / HELDOUT_PER_LENGTH
            for n in LENGTHS
        }
        return sum(right) / len(rows)
