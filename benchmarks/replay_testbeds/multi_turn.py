"""`multi-turn`: the key-and-door game grown into a family of rooms with distractors, played through `text_env_factory`.

A room has 1 to 3 doors of different colours and a key of each door's colour; the goal names one door. The agent
must take the goal's key ("take blue key"), then open the goal's door ("open blue door"): reward 1. Opening another
door with its key ends the episode unsuccessfully (the distractor); a door without its key stays locked; holding a
second key drops the first. The number of doors is the difficulty. Rooms (the doors' order and the goal) are drawn
from a seed and split into training and held-out rooms, so held-out success needs the skill (read the goal, act on
its colour), not the memory of rooms.
"""

from __future__ import annotations

import itertools
import random

from .base import Testbed

COLOURS = ["red", "green", "blue", "white", "black", "gold"]
VOCABULARY = [
    "you", "see", "a", "and", "door", "doors", "key", "keys", "goal", "open", "the", "take", "opens", "wrong", "room",
    "is", "locked", "have", "nothing", "happens", ".", *COLOURS,
]  # fmt: skip
HELDOUT_FRACTION = 0.3


class DoorsEnv:
    """Task row: `{"task_id", "doors": "red blue", "goal": "blue"}`. See the module docstring for the rules."""

    def reset(self, task):
        self.doors = task["doors"].split()
        self.goal = task["goal"]
        self.held = None
        listed = " and ".join(f"a {c} door" for c in self.doors)
        return f"you see {listed} . the keys are {' '.join(self.doors)} . goal open the {self.goal} door"

    def step(self, action):
        words = action.split()
        colours = [w for w in words if w in self.doors]
        if not colours:
            return "nothing happens", 0.0, False, {"invalid_action": True}
        colour = colours[0]
        if "key" in words:
            self.held = colour
            return f"you have the {colour} key", 0.0, False, {}
        if self.held != colour:
            return f"the {colour} door is locked", 0.0, False, {}
        if colour == self.goal:
            return f"the {colour} door opens", 1.0, True, {}
        return f"the {colour} door opens the wrong room", 0.0, True, {}

    def close(self):
        pass


def doors_summary(trajectory) -> str:
    """The environment's summariser hook: a won episode's actions, in the game's own words ("take blue key and open
    blue door")."""
    return " and ".join(trajectory.actions)


def rooms(seed: int = 0) -> dict[str, list[dict]]:
    """Every room of 1 to 3 doors, split into `train` and `heldout` at random (the same for every run)."""
    all_rooms = []
    for n in (1, 2, 3):
        for doors in itertools.permutations(COLOURS, n):
            for goal in doors:
                all_rooms.append({"task_id": f"{' '.join(doors)} > {goal}", "doors": " ".join(doors), "goal": goal,
                                  "num_doors": n})  # fmt: skip
    rng = random.Random(seed)
    rng.shuffle(all_rooms)
    split = {"train": [], "heldout": []}
    for n in (1, 2, 3):
        group = [r for r in all_rooms if r["num_doors"] == n]
        cut = round(len(group) * HELDOUT_FRACTION)
        split["heldout"] += group[:cut]
        split["train"] += group[cut:]
    return split


class MultiTurn(Testbed):
    name = "multi-turn"
    summary = "doors game, 1-3 doors (distractors), 3 turns; held-out: 30% of rooms never trained on"
    vocabulary = VOCABULARY
    model_kwargs = dict(hidden_size=64, num_layers=2, num_heads=4)
    training = dict(
        per_device_train_batch_size=64,
        num_generations=8,
        max_steps=300,
        # GRPO's best rate on the tuning seeds 50-54 (docs/results.md, "every group teaches"); 1e-2, the earlier
        # tests' rate, collapsed GRPO's policy on 3 of those 5 seeds. Runs made at 1e-2 keep it in their results.json.
        learning_rate=3.3e-3,
        temperature=1.0,
        beta=0.0,
    )
    limits = dict(max_turns=3, max_completion_length=48, max_tokens_per_turn=4)
    eval_every = 20
    target_levels = (0.10, 0.20)
    trl_comparable = False  # played through `text_env_factory`, which TRL's GRPOTrainer does not have

    def __init__(self):
        self.split = rooms()

    def trainer_kwargs(self):
        return {**self.limits, "env_workers": 1}

    # The tiny model's word-level tokenizer splits on spaces only: the library's default template ("...task:<EXP>{}
    # </EXP>") and summary ("...actions: take red key; open red door") come out mostly as <unk> (18 of 24 tokens), the
    # key words glued to punctuation. The environment's own summary and a template of vocabulary words instead.
    experience_settings = {"guidance_template": "{} . "}

    def experience_provider(self):
        from trl_exreplay.guidance.offline import OfflineExperienceProvider

        return OfflineExperienceProvider(summarize_fn=doors_summary)

    def text_env_factory(self):
        return DoorsEnv

    def train_dataset(self, repeats: int):
        from datasets import Dataset

        rows = list(self.split["train"])
        random.Random(1).shuffle(rows)
        return Dataset.from_list(rows * max(1, repeats // 4))

    def heldout_success(self, model, tokenizer, seed: int = 0) -> float:
        import torch

        from trl_exreplay.envs.evaluation import evaluate_policy

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            result = evaluate_policy(
                model, tokenizer, self.split["heldout"] * 2, DoorsEnv, do_sample=True, temperature=1.0, top_k=0,
                workers=1, batch_size=256, group_column="num_doors", **self.limits,
            )  # fmt: skip
        if result.errors:
            raise RuntimeError(f"{result.errors} held-out episodes failed in the environment")
        self.last_detail = {f"{n} doors": won / played for n, (won, played) in sorted(result.per_group.items())}
        return result.success_rate
