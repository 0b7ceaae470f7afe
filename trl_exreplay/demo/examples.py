"""A small single-turn task used by the example script and the tests: say the task's target word.

Each task asks the model to "say" one word of a tiny vocabulary; the reward is 1 when the completion contains it. A
randomly initialised tiny model succeeds on some rollouts of some tasks, which is exactly what replay needs.
"""

from __future__ import annotations

WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "rock", "fish", "bird", "star"]
VOCABULARY = ["say", "the", "word", "please", "ok", *WORDS]


def say_word_dataset(num_tasks: int = 8, repeats: int = 1):
    """`datasets.Dataset` with columns prompt (conversational), task_id and target."""
    from datasets import Dataset

    rows = {"prompt": [], "task_id": [], "target": []}
    for _ in range(repeats):
        for i in range(num_tasks):
            word = WORDS[i % len(WORDS)]
            rows["prompt"].append([{"role": "user", "content": f"say the word {word}"}])
            rows["task_id"].append(f"task-{i}")
            rows["target"].append(word)
    return Dataset.from_dict(rows)


def said_target(completions, target, **kwargs) -> list[float]:
    """Reward: 1.0 when the completion contains the task's target word."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(word in text.split()) for text, word in zip(texts, target)]


# The README quick start's offline twin (examples/quick_start_offline.py) keeps TRL's `accuracy_reward`, which
# verifies `\boxed{...}` answers: each answer is one word of the tiny vocabulary, so a random tiny model answers
# some sums right (about one rollout in ten), enough for the pool to fill and replay to start within the run.
SUMS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1), (2, 2), (1, 1)]
SUMS_VOCABULARY = ["what", "is", "+", "?", "1", "2", "3", *(f"\\boxed{{{n}}}" for n in (2, 3, 4))]


def sums_dataset(repeats: int = 1):
    """`datasets.Dataset` of small sums in the format of TRL's math datasets: prompt (conversational), solution; each
    sum `repeats` times."""
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": f"what is {a} + {b} ?"}], "solution": str(a + b)} for a, b in SUMS]
    rows = rows * repeats
    return Dataset.from_list(rows)


def save_sums_model(path: str = "tiny-sums-model") -> str:
    """Save a tiny random model and its tokenizer for `sums_dataset` to `path`; returns `path`, to pass as `model=`."""
    from .tiny import save_tiny_model

    return save_tiny_model(path, SUMS_VOCABULARY)
