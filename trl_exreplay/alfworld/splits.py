"""ALFWorld task types and scene splits (no dependency on `alfworld`).

The scene splits mirror ALFRED/ALFWorld: training games come from floor plans 7-30 (kitchens), 207-230 (living
rooms), 307-330 (bedrooms) and 407-430 (bathrooms) minus the four "unseen" scenes; `valid_seen` reuses the training
scenes with new object placements; `valid_unseen` uses only the unseen scenes (never used for training).
Floor plans 1-6, 201-206, 301-306 and 401-406 (ALFRED's test scenes) are used by no split.
"""

from __future__ import annotations

# Same numbering as alfworld.agents.environment.alfred_tw_env.TASK_TYPES.
TASK_TYPES: dict[int, str] = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
ALL_TASK_TYPES: tuple[str, ...] = tuple(TASK_TYPES[i] for i in sorted(TASK_TYPES))
# Task types that pass through an appliance: (object flag in ALFRED's VAL_ACTION_OBJECTS, appliance type, verb).
APPLIANCE_TASKS: dict[str, tuple[str, str, str]] = {
    "pick_clean_then_place_in_recep": ("Cleanable", "SinkBasin", "clean"),
    "pick_heat_then_place_in_recep": ("Heatable", "Microwave", "heat"),
    "pick_cool_then_place_in_recep": ("Coolable", "Fridge", "cool"),
}

VALID_UNSEEN_SCENES: tuple[int, ...] = (10, 219, 308, 424)
TRAIN_SCENES: tuple[int, ...] = tuple(
    s for start in (7, 207, 307, 407) for s in range(start, start + 24) if s not in VALID_UNSEEN_SCENES
)
SPLIT_SCENES: dict[str, tuple[int, ...]] = {
    "train": TRAIN_SCENES,
    "valid_seen": TRAIN_SCENES,
    "valid_unseen": VALID_UNSEEN_SCENES,
}
SPLITS: tuple[str, ...] = tuple(SPLIT_SCENES)


def room_type(scene: int) -> str:
    """ALFRED room type of a floor plan number (same ranges as alfworld.gen.constants.SCENE_TYPE)."""
    for name, base in (("Kitchen", 0), ("LivingRoom", 200), ("Bedroom", 300), ("Bathroom", 400)):
        if base + 1 <= scene <= base + 30:
            return name
    raise ValueError(f"no ALFRED floor plan {scene}")


def normalize_task_types(task_types) -> list[str]:
    """Task types given as names or ALFWorld ids (1-6), in canonical order without duplicates; None means all six."""
    if task_types is None:
        return list(ALL_TASK_TYPES)
    if isinstance(task_types, (str, int)):
        task_types = [task_types]
    wanted = set()
    for t in task_types:
        if isinstance(t, int) or (isinstance(t, str) and t.isdigit()):
            if int(t) not in TASK_TYPES:
                raise ValueError(f"unknown ALFWorld task type id {t!r}; expected 1-6")
            wanted.add(TASK_TYPES[int(t)])
        elif t in ALL_TASK_TYPES:
            wanted.add(t)
        else:
            raise ValueError(f"unknown ALFWorld task type {t!r}; expected one of {', '.join(ALL_TASK_TYPES)} or 1-6")
    if not wanted:
        raise ValueError("task_types is empty")
    return [t for t in ALL_TASK_TYPES if t in wanted]
