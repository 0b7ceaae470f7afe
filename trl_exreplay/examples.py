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
