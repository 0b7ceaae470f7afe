"""A tiny deterministic text game for tests and CPU examples: take the key, then open the door of the right colour."""

from __future__ import annotations

COLOURS = ["red", "green", "blue", "white", "black", "gold"]
KEY_DOOR_VOCABULARY = [
    "you",
    "see",
    "a",
    "door",
    "and",
    "key",
    "take",
    "the",
    "open",
    "opens",
    "nothing",
    "happens",
    "have",
    "locked",
    "is",
    "need",
    "first",
    *COLOURS,
]


class KeyDoorEnv:
    """Task row: `{"task_id": ..., "door": <colour>}`. Win (reward 1) by saying "key" in one turn and the door's colour
    in a later one. An action with neither word is invalid ("nothing happens")."""

    def __init__(self):
        self.door = None
        self.has_key = False

    def reset(self, task):
        self.door = task["door"]
        self.has_key = False
        return f"you see a {self.door} door and a key"

    def step(self, action):
        words = action.split()
        if "key" in words and not self.has_key:
            self.has_key = True
            return "you have the key", 0.0, False, {}
        if self.door in words:
            if self.has_key:
                return f"the {self.door} door opens", 1.0, True, {}
            return f"the {self.door} door is locked you need the key first", 0.0, False, {}
        return "nothing happens", 0.0, False, {"invalid_action": True}

    def admissible_actions(self):
        return ["open the " + self.door + " door"] + ([] if self.has_key else ["take the key"])

    def close(self):
        pass


def key_door_dataset(num_tasks: int = 4, repeats: int = 1):
    """Tasks for `KeyDoorEnv` with a `task_id` and a `door` column."""
    from datasets import Dataset

    rows = {"task_id": [], "door": []}
    for _ in range(repeats):
        for i in range(num_tasks):
            rows["task_id"].append(f"door-{i}")
            rows["door"].append(COLOURS[i % len(COLOURS)])
    return Dataset.from_dict(rows)
