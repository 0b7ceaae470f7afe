"""Offline ALFWorld game generator.

The official ALFWorld games (json_2.1.1) cannot be downloaded everywhere, but the `alfworld` wheel ships what is
needed to build equivalent ones: the PDDL domain and text grammar (`alfworld/data`), ALFRED's object/receptacle
constants and goal library (`alfworld/gen`), and per-floor-plan layouts (openable receptacles with the agent
poses that reach them, the objects in the scene, a grid of reachable points). From these the generator writes,
for each game, the two files `AlfredTWEnv` reads, laid out like the official data::

    <out_dir>/json_2.1.1/<split>/<task_type>-<Object>-None-<Parent|Lamp>-<scene>/<task_id>/game.tw-pddl
                                                                                  /traj_data.json

`game.tw-pddl` holds the PDDL domain, the grammar with the task description filled in, the PDDL problem,
`solvable: true` and a walkthrough. The walkthrough is written constructively (the generator knows where
everything is) and played on the real engine before the game is written; games whose walkthrough does not win,
or that are already won at the start, are rejected and counted.

Task choice: among the (object, receptacle) pairs a scene allows (for look_at_obj_in_light, (object, lamp)), a
pair is drawn with weight = the number of ALFRED train trials that use it (`alfred_pairs.json`, derived from
ALFRED's `oct21.json` by `tools/alfred_pair_counts.py`) + `_UNSEEN_PAIR_WEIGHT`, so the games follow ALFRED's
task distribution ("put a mug in the coffee machine" is common, "put a mug in the garbage can" rare).

Reproducibility: game `i` of `(split, seed)` depends only on `(split, seed, i, task type, wording)`, drawn from
its own random stream (so the first N games of a run of M > N games are the N games of a run of N); nothing
depends on dict/set iteration order, hashing or time, so the same arguments give byte-identical files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from importlib import resources
from importlib.metadata import PackageNotFoundError, version

from .engine import _IMPORT_HINT, map_in_pool, play_walkthrough
from .splits import ALL_TASK_TYPES, APPLIANCE_TASKS, SPLIT_SCENES, normalize_task_types, room_type

try:
    import alfworld
    import alfworld.gen.constants as C
    import alfworld.gen.goal_library as glib
    import numpy as np
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(_IMPORT_HINT) from e

__all__ = [
    "GenerationReport",
    "WORDINGS",
    "alfworld_version",
    "build_game",
    "generate_games",
    "pair_weights",
    "pddl_name",
]

_ALFWORLD_DIR = os.path.dirname(alfworld.__file__)
_LAYOUTS = os.path.join(_ALFWORLD_DIR, "gen", "layouts")
_DOMAIN = os.path.join(_ALFWORLD_DIR, "data", "alfred.pddl")
_GRAMMAR = os.path.join(_ALFWORLD_DIR, "data", "alfred.twl2")

WORDINGS = ("put", "move")  # "put X in/on Y" (classic ALFWorld, default) or "move X to Y" (alfworld 0.4.2)

_STATIC_RECEPS = frozenset(C.RECEPTACLES) - frozenset(C.MOVABLE_RECEPTACLES)
_PICKUPABLE = frozenset(t for t in frozenset().union(*C.VAL_RECEPTACLE_OBJECTS.values()) if not t.endswith("Sliced"))
_LAMPS = ("DeskLamp", "FloorLamp")
_LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "DiningTable", "CoffeeTable", "Shelf", "TVStand", "CounterTop")
# Receptacles the layouts often lack (they are in objects.json only): how many instances to create.
_CREATED_COUNT = {"CoffeeMachine": 1, "Toaster": 1, "GarbageCan": 1, "SinkBasin": 1}
# Layout receptacle ids of these types get the ALFRED basin suffix (they demangle to "sinkbasin N").
_BASINS = {"Sink": "SinkBasin", "Bathtub": "BathtubBasin"}
_APPLIANCE = APPLIANCE_TASKS  # (object flag, appliance type, verb) of the tasks that pass through an appliance
_OBJECT_FLAGS = (
    ("Cleanable", "cleanable"),
    ("Heatable", "heatable"),
    ("Coolable", "coolable"),
    ("Sliceable", "sliceable"),
)
_MAX_ATTEMPTS = 64
# Instances per pickupable type (1, 2, 3): mostly one, as in ALFRED scenes; fewer objects also load faster.
_INSTANCE_WEIGHTS = (5, 3, 2)
# Package data: {"source", "counts": {task_type: {"Object|Parent": ALFRED train trials}}} (Parent is the lamp
# for look_at_obj_in_light), written by tools/alfred_pair_counts.py.
_PAIR_TABLE = "alfred_pairs.json"
# Weight added to every valid pair's ALFRED count: valid pairs ALFRED never used (count 0) stay possible but rare
# (an unused pair is drawn half as often as a pair ALFRED used once, 1/2k as often as one used k times).
_UNSEEN_PAIR_WEIGHT = 0.5


class _Reject(Exception):
    """A sampled game cannot be built (the reason is counted in the report)."""


@lru_cache(maxsize=1)
def alfworld_version() -> str:
    try:
        return version("alfworld")
    except PackageNotFoundError:  # pragma: no cover
        return "unknown"


def pddl_name(alfred_id: str) -> str:
    """ALFRED object id -> PDDL-safe name (ALFRED's `fix_pddl_str_chars`)."""
    for a, b in (("-", "_minus_"), ("#", "-"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        alfred_id = alfred_id.replace(a, b)
    return alfred_id


def _coord(v: float) -> str:
    return ("+" if v >= 0 else "-") + f"{abs(v):05.2f}"


def _loc_name(x: float, z: float, rot: int, horizon: int) -> str:
    """ALFRED location name `loc|x|z|rotation|horizon` (grid units of AGENT_STEP_SIZE, rotation in quarter turns)."""
    step = C.AGENT_STEP_SIZE
    return f"loc|{round(x / step):d}|{round(z / step):d}|{round(rot / 90) % 4:d}|{int(horizon):d}"


def _game_rng(split: str, seed: int, index: int, attempt: int) -> random.Random:
    # The salt names the module where the generator was first written (trl_exreplay.envs.alfworld); it stays so, or
    # every game of every seed would change (tests/integration/test_alfworld_generate.py pins one game's bytes).
    key = f"trl_exreplay.envs.alfworld|{split}|{seed}|{index}|{attempt}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


@cache
def _alfred_pair_counts() -> dict[str, dict[tuple[str, str], int]]:
    """{task_type: {(object, parent or lamp): ALFRED train trials}} from the package data (read once)."""
    text = resources.files(__package__).joinpath(_PAIR_TABLE).read_text(encoding="utf-8")
    return {
        task_type: {tuple(pair.split("|")): int(n) for pair, n in counts.items()}
        for task_type, counts in json.loads(text)["counts"].items()
    }


def pair_weights(task_type: str, pairs: Sequence[tuple[str, str]]) -> list[float]:
    """Sampling weight of each (object type, parent receptacle type or lamp type) pair for `task_type`.

    The weight is the number of ALFRED train trials of `task_type` with that pair (sliced objects counted as
    their base object) plus `_UNSEEN_PAIR_WEIGHT`, so pairs ALFRED never used stay possible but rare.
    """
    table = _alfred_pair_counts()
    if task_type not in table:
        raise ValueError(f"no ALFRED pair counts for task type {task_type!r}")
    counts = table[task_type]
    return [counts.get((obj, parent), 0) + _UNSEEN_PAIR_WEIGHT for obj, parent in pairs]


@cache
def _static_text(path: str) -> str:
    with open(path) as f:
        return f.read()


@cache
def _layout(scene: int):
    base = os.path.join(_LAYOUTS, f"FloorPlan{scene}")
    with open(base + "-openable.json") as f:
        openable = json.load(f)
    with open(base + "-objects.json") as f:
        objtypes = frozenset(json.load(f))
    points = tuple(tuple(float(v) for v in p) for p in np.load(base + "-layout.npy").tolist())
    return tuple(sorted((k, tuple(v)) for k, v in openable.items())), objtypes, points


# ------------------------------------------------------------------------------------------------------------------
# Scene, task and placements
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class _Scene:
    receps: dict[str, dict]  # ALFRED id -> {"type", "x", "z", "loc"}
    objtypes: frozenset
    start: str  # agent start location (hosts no receptacle)


def _load_scene(scene: int, rng: random.Random) -> _Scene:
    openable, objtypes, points = _layout(scene)
    receps: dict[str, dict] = {}
    for rid, pose in openable:
        rtype = rid.split("|")[0]
        if rtype in _BASINS:
            rtype = _BASINS[rtype]
            if not rid.endswith("|" + rtype):
                rid = f"{rid}|{rtype}"
        if rtype not in _STATIC_RECEPS:
            continue
        x, z, rot, hor = pose
        receps[rid] = {"type": rtype, "x": float(x), "z": float(z), "rot": int(rot), "hor": int(hor)}

    # Receptacles the scene has (objects.json) but the layout does not list: create them at free reachable points.
    present = {d["type"] for d in receps.values()}
    wanted = {_BASINS.get(t, t) for t in objtypes} & _STATIC_RECEPS
    free = list(points)
    rng.shuffle(free)
    for rtype in sorted(wanted - present):
        src = next((k for k, v in _BASINS.items() if v == rtype), rtype)
        count = rng.randint(2, 4) if rtype == "StoveBurner" else _CREATED_COUNT.get(rtype, 1)
        for _ in range(count):
            if not free:
                raise _Reject("no free layout point for a missing receptacle")
            x, z = free.pop()
            rid = None
            while rid is None or rid in receps:
                rid = f"{src}|{_coord(x + rng.uniform(-0.5, 0.5))}|+00.90|{_coord(z + rng.uniform(-0.5, 0.5))}"
                if src != rtype:
                    rid += "|" + rtype
            receps[rid] = {"type": rtype, "x": x, "z": z, "rot": rng.choice((0, 90, 180, 270)), "hor": 30}

    # Every receptacle gets its own location (two receptacles at one location would share "go to" targets).
    used: set[str] = set()
    for rid in sorted(receps):
        d = receps[rid]
        hor = d["hor"]
        while _loc_name(d["x"], d["z"], d["rot"], hor) in used:
            hor += 15  # a distinct, harmless camera horizon
        d["loc"] = _loc_name(d["x"], d["z"], d["rot"], hor)
        used.add(d["loc"])

    # The agent starts at a reachable point where no receptacle is.
    while True:
        if not free:
            raise _Reject("no free layout point for the agent")
        x, z = free.pop()
        start = _loc_name(x, z, rng.choice((0, 90, 180, 270)), 30)
        if start not in used:
            break
    return _Scene(receps, objtypes, start)


def _hosts(otype: str, receps: dict, exclude=()) -> list[str]:
    return sorted(
        r
        for r, d in receps.items()
        if otype in C.VAL_RECEPTACLE_OBJECTS.get(d["type"], ()) and d["type"] not in exclude
    )


def _target_exclusions(task_type: str, parent: str) -> set[str]:
    """Receptacle types a target object must not start in (the goal must not hold at the start)."""
    excl = {parent} if parent else set()
    if task_type in _APPLIANCE:
        excl |= {"SinkBasin", "Microwave", "Fridge"}
    return excl


def _sample_task(
    task_type: str, scene: _Scene, rng: random.Random, targets: Sequence[str] | None = None
) -> tuple[str, str, str]:
    """(object type, parent receptacle type or "", lamp type or ""), weighted by ALFRED's pair counts; the object is
    one of `targets` (ALFRED type names) when given."""
    receps, objtypes = scene.receps, scene.objtypes
    rtypes = {d["type"] for d in receps.values()}
    cands = sorted(t for t in objtypes & _PICKUPABLE if _hosts(t, receps) and (targets is None or t in targets))
    if targets is not None and not cands:
        raise _Reject("no allowed target object in the scene")
    if task_type in _APPLIANCE:
        flag, appliance, _ = _APPLIANCE[task_type]
        if appliance not in rtypes:
            raise _Reject(f"scene has no {appliance}")
        cands = [t for t in cands if t in C.VAL_ACTION_OBJECTS[flag]]
    pairs: list[tuple[str, str]] = []  # (object, parent or lamp)
    if task_type == "look_at_obj_in_light":
        lamps = sorted(objtypes & set(_LAMPS))
        if not lamps:
            raise _Reject("scene has no lamp")
        if not cands:
            raise _Reject("no object for the task")
        pairs = [(obj, lamp) for obj in cands for lamp in lamps]
    else:
        for obj in cands:
            parents = sorted({receps[r]["type"] for r in _hosts(obj, receps)})
            if task_type in _APPLIANCE:  # the appliance itself is not the destination
                parents = [p for p in parents if p != _APPLIANCE[task_type][1]]
            # the object must be able to start somewhere other than the destination
            pairs += [(obj, p) for p in parents if _hosts(obj, receps, exclude=_target_exclusions(task_type, p))]
        if not pairs:
            raise _Reject("no (object, receptacle) pair for the task")
    pairs.sort()  # a fixed order: the draw depends only on the random stream
    obj, other = rng.choices(pairs, weights=pair_weights(task_type, pairs))[0]
    return (obj, "", other) if task_type == "look_at_obj_in_light" else (obj, other, "")


def _place_objects(task_type: str, obj_t: str, parent_t: str, toggle_t: str, scene: _Scene, rng) -> dict[str, dict]:
    """{object id: {"type", "recep"}}: 1-3 instances of every pickupable type of the scene in allowed receptacles."""
    receps = scene.receps
    objects: dict[str, dict] = {}

    def add(otype: str, allowed: list[str]) -> None:
        recep = rng.choice(allowed)
        oid = None
        while oid is None or oid in objects:
            oid = "{}|{}|{}|{}".format(
                otype,
                _coord(receps[recep]["x"] + rng.uniform(-0.6, 0.6)),
                _coord(rng.uniform(0.1, 1.6)),
                _coord(receps[recep]["z"] + rng.uniform(-0.6, 0.6)),
            )
        objects[oid] = {"type": otype, "recep": recep}

    for otype in sorted(scene.objtypes & _PICKUPABLE):
        if otype == obj_t:
            allowed = _hosts(otype, receps, exclude=_target_exclusions(task_type, parent_t))
            low = 2 if task_type == "pick_two_obj_and_place" else 1
        else:
            allowed = _hosts(otype, receps)
            low = 1
        if not allowed:
            if otype == obj_t:
                raise _Reject("target object has no allowed start receptacle")
            continue
        for _ in range(max(low, rng.choices((1, 2, 3), weights=_INSTANCE_WEIGHTS)[0])):
            add(otype, allowed)
    if toggle_t:
        add(toggle_t, [r for r in sorted(receps) if receps[r]["type"] in _LAMP_HOSTS] or sorted(receps))
    return objects


# ------------------------------------------------------------------------------------------------------------------
# PDDL problem, grammar, walkthrough
# ------------------------------------------------------------------------------------------------------------------
def _problem(name: str, scene: _Scene, objects: dict, task_type: str, obj_t: str, parent_t: str, toggle_t: str) -> str:
    receps = scene.receps
    # Declare every type constant: the domain names KnifeType, SinkBasinType, MicrowaveType... even when absent.
    otypes = sorted((set(C.OBJECTS) | set(C.MOVABLE_RECEPTACLES)) - _STATIC_RECEPS)
    rtypes = sorted(_STATIC_RECEPS)
    locs = sorted({d["loc"] for d in receps.values()} | {scene.start})
    lines = [f"(define (problem {name})", "  (:domain alfred)", "  (:objects", "    agent1 # agent"]
    lines += [f"    {loc} # location" for loc in locs]
    lines += [f"    {r} # receptacle" for r in sorted(receps)]
    lines += [f"    {o} # object" for o in sorted(objects)]
    lines += [f"    {t}Type # otype" for t in otypes]
    lines += [f"    {t}Type # rtype" for t in rtypes]
    lines += ["  )", "  (:init", f"    (atLocation agent1 {scene.start})"]
    for r in sorted(receps):
        d = receps[r]
        lines.append("    (receptacleType {} {}Type)".format(r, d["type"]))
        lines.append("    (receptacleAtLocation {} {})".format(r, d["loc"]))
        if d["type"] in C.OPENABLE_CLASS_SET:
            lines.append(f"    (openable {r})")
    present_otypes = sorted({d["type"] for d in objects.values()})
    for rt in sorted({d["type"] for d in receps.values()}):
        for ot in present_otypes:
            if ot in C.VAL_RECEPTACLE_OBJECTS.get(rt, ()):
                lines.append(f"    (canContain {rt}Type {ot}Type)")
    for o in sorted(objects):
        t, recep = objects[o]["type"], objects[o]["recep"]
        lines.append(f"    (objectType {o} {t}Type)")
        lines.append(f"    (inReceptacle {o} {recep})")
        lines.append("    (objectAtLocation {} {})".format(o, receps[recep]["loc"]))
        if t in _LAMPS:
            lines.append(f"    (toggleable {o})")
            continue
        lines.append(f"    (pickupable {o})")
        if t in C.MOVABLE_RECEPTACLES_SET:
            lines.append(f"    (isReceptacleObject {o})")
        for flag, pred in _OBJECT_FLAGS:
            if t in C.VAL_ACTION_OBJECTS[flag]:
                lines.append(f"    ({pred} {o})")
    lines.append("  )")
    # The goal library's goal text ends with the parenthesis that closes `define`.
    goal = glib.gdict[task_type]["pddl"].format(obj=obj_t, recep=parent_t, toggle=toggle_t)
    return pddl_name("\n".join(lines) + "\n" + goal)


def _replace_once(text: str, old: str, new: str) -> str:
    if old not in text:
        raise RuntimeError(f"alfworld grammar changed: {old!r} not found (alfworld {alfworld_version()})")
    return text.replace(old, new)


def _grammar(goal_text: str, wording: str) -> str:
    g = _static_text(_GRAMMAR)
    if wording == "put":  # classic ALFWorld wording (the inverse of alfworld's scripts/patch_tw-pddl.py)
        g = _replace_once(g, '"move {o} to {r}"', '"put {o} in/on {r}"')
        g = _replace_once(g, "You move the {o.name} to the {r.name}.", "You put the {o.name} in/on the {r.name}.")
        g = _replace_once(g, "move (object) to (receptacle):  place", "put (object) in/on (receptacle): place")
    return _replace_once(g, "UNKNOWN GOAL", goal_text)


def _goal_text(task_type: str, obj_t: str, parent_t: str, toggle_t: str, rng: random.Random) -> str:
    """ALFWorld's templated task description (alfworld.agents.utils.misc.get_templated_task_desc, seeded)."""
    template = rng.choice(glib.gdict[task_type]["templates"])
    return template.format(obj=obj_t.lower(), recep=parent_t.lower(), toggle=toggle_t.lower(), mrecep="")


class _Namer:
    """The names AlfredDemangler gives PDDL ids in the game text ("cabinet 3", "apple 1")."""

    def __init__(self, pddl_ids: list[str]):
        from alfworld.agents.utils.misc import Demangler
        from textworld.generator.game import EntityInfo

        ids = sorted({i.lower() for i in pddl_ids})
        self._demangler = Demangler(game_infos={i: EntityInfo(i, "") for i in ids})

    def __call__(self, alfred_id: str) -> str:
        return self._demangler.demangle_alfred_name(pddl_name(alfred_id).lower())


def _walkthrough(task_type, obj_t, parent_t, toggle_t, scene: _Scene, objects: dict, wording: str) -> list[str]:
    receps = scene.receps
    everything = list(receps) + list(objects) + sorted({d["loc"] for d in receps.values()} | {scene.start})
    name = _Namer([pddl_name(i) for i in everything] + ["agent1"])
    put = "put %s in/on %s" if wording == "put" else "move %s to %s"
    plan: list[str] = []
    here, opened = scene.start, set()

    def go(r: str) -> None:
        nonlocal here
        if receps[r]["loc"] != here:
            plan.append("go to " + name(r))
            here = receps[r]["loc"]
        if receps[r]["type"] in C.OPENABLE_CLASS_SET and r not in opened:
            plan.append("open " + name(r))
            opened.add(r)

    targets = sorted(o for o, d in objects.items() if d["type"] == obj_t)
    for o in targets[: 2 if task_type == "pick_two_obj_and_place" else 1]:
        src = objects[o]["recep"]
        go(src)
        plan.append(f"take {name(o)} from {name(src)}")
        if task_type == "look_at_obj_in_light":
            lamp = sorted(x for x, d in objects.items() if d["type"] == toggle_t)[0]
            go(objects[lamp]["recep"])
            plan.append("use " + name(lamp))
            return plan
        if task_type in _APPLIANCE:
            _, appliance_t, verb = _APPLIANCE[task_type]
            appliance = sorted(r for r, d in receps.items() if d["type"] == appliance_t)[0]
            go(appliance)
            plan.append(f"{verb} {name(o)} with {name(appliance)}")
        dest = sorted(r for r, d in receps.items() if d["type"] == parent_t)[0]
        go(dest)
        plan.append(put % (name(o), name(dest)))
    return plan


# ------------------------------------------------------------------------------------------------------------------
# One game
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _GameFiles:
    rel_dir: str  # json_2.1.1/<split>/<task dir>/<task_id>
    game_json: str
    traj_json: str
    walkthrough: tuple[str, ...]
    task_type: str
    scene: int


def normalize_target_objects(names: Sequence[str] | None) -> tuple[str, ...] | None:
    """ALFRED pickupable object type names (case-insensitive: "book" -> "Book"), or None for any."""
    if names is None:
        return None
    by_lower = {t.lower(): t for t in _PICKUPABLE}
    unknown = [n for n in names if str(n).lower() not in by_lower]
    if unknown or not names:
        raise ValueError(
            f"Invalid value {unknown or list(names)!r} for `target_objects`: allowed values are ALFRED's pickupable "
            f"object types: {', '.join(sorted(_PICKUPABLE))}."
        )
    return tuple(sorted({by_lower[str(n).lower()] for n in names}))


def build_game(
    split: str,
    seed: int,
    index: int,
    task_type: str,
    attempt: int = 0,
    wording: str = "put",
    scenes: Sequence[int] | None = None,
    target_objects: Sequence[str] | None = None,
) -> _GameFiles:
    """Build (without verifying) candidate `attempt` of game `index` in one of `scenes` (default: all of the split's
    floor plans), its target one of `target_objects` (default: any); raises `_Reject` when it cannot be built."""
    if wording not in WORDINGS:
        raise ValueError(f"wording must be one of {WORDINGS}, got {wording!r}")
    rng = _game_rng(split, seed, index, attempt)
    allowed = SPLIT_SCENES[split] if scenes is None else scenes
    scenes = [s for s in allowed if room_type(s) in C.GOALS_VALID[task_type]]
    if not scenes:
        raise _Reject(f"no {split} scene allows {task_type}")
    scene_num = rng.choice(scenes)
    scene = _load_scene(scene_num, rng)
    obj_t, parent_t, toggle_t = _sample_task(task_type, scene, rng, target_objects)
    objects = _place_objects(task_type, obj_t, parent_t, toggle_t, scene, rng)
    goal_text = _goal_text(task_type, obj_t, parent_t, toggle_t, rng)

    task_id = f"trial_{split}_s{seed}_{index:06d}"
    problem = _problem(f"plan_{task_id}", scene, objects, task_type, obj_t, parent_t, toggle_t)
    walkthrough = _walkthrough(task_type, obj_t, parent_t, toggle_t, scene, objects, wording)
    game = {
        "pddl_domain": _static_text(_DOMAIN),
        "grammar": _grammar(goal_text, wording),
        "pddl_problem": problem,
        "solvable": True,
        "walkthrough": walkthrough,
    }
    traj = {
        "task_id": task_id,
        "task_type": task_type,
        "pddl_params": {
            "object_target": obj_t,
            "parent_target": parent_t,
            "toggle_target": toggle_t,
            "mrecep_target": "",
            "object_sliced": False,
        },
        "scene": {"floor_plan": f"FloorPlan{scene_num}", "scene_num": scene_num, "random_seed": seed},
        "turk_annotations": {"anns": [{"task_desc": goal_text}]},
        "generator": {
            "name": "trl_exreplay.envs.alfworld",  # the generator's name in every game file, as first released
            "alfworld_version": alfworld_version(),
            "split": split,
            "seed": seed,
            "index": index,
            "attempt": attempt,
            "wording": wording,
        },
    }
    task_dir = f"{task_type}-{obj_t}-None-{parent_t or toggle_t}-{scene_num}"
    return _GameFiles(
        rel_dir=os.path.join("json_2.1.1", split, task_dir, task_id),
        game_json=json.dumps(game, sort_keys=True),
        traj_json=json.dumps(traj, sort_keys=True, indent=2) + "\n",
        walkthrough=tuple(walkthrough),
        task_type=task_type,
        scene=scene_num,
    )


def _reason_key(error: str) -> str:
    return "engine: " + error.split(":")[0]


def _generate_one(job: tuple) -> tuple[_GameFiles | None, dict[str, int]]:
    split, seed, index, task_type, wording, verify, scenes, target_objects = job
    rejected: Counter = Counter()
    for attempt in range(_MAX_ATTEMPTS):
        try:
            files = build_game(split, seed, index, task_type, attempt, wording, scenes, target_objects)
        except _Reject as r:
            rejected[f"sample: {r}"] += 1
            continue
        if verify:
            result = play_walkthrough(json.loads(files.game_json), list(files.walkthrough))
            if not result.ok:
                rejected[_reason_key(result.error or "walkthrough did not win")] += 1
                continue
        return files, dict(rejected)
    rejected[f"gave up after {_MAX_ATTEMPTS} attempts"] += 1
    return None, dict(rejected)


# ------------------------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------------------------
@dataclass
class GenerationReport:
    """What `generate_games` did."""

    out_dir: str
    split: str
    seed: int
    requested: int
    game_files: list[str] = field(default_factory=list)  # written game.tw-pddl paths, in index order
    by_task_type: dict[str, int] = field(default_factory=dict)  # games written per task type
    rejected: dict[str, int] = field(default_factory=dict)  # candidates rejected, per reason
    failed: int = 0  # game indices for which no candidate succeeded
    verified: bool = True
    alfworld_version: str = ""

    @property
    def written(self) -> int:
        return len(self.game_files)

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def summary(self) -> str:
        lines = [
            f"wrote {self.written} of {self.requested} {self.split} games (seed {self.seed}) under {self.out_dir}"
        ]
        lines += [f"  {t}: {n}" for t, n in sorted(self.by_task_type.items())]
        lines.append(f"rejected {self.num_rejected} candidates" + (":" if self.rejected else ""))
        lines += [f"  {n} x {reason}" for reason, n in sorted(self.rejected.items())]
        if not self.verified:
            lines.append("walkthroughs were NOT verified on the engine")
        return "\n".join(lines)


def generate_games(
    out_dir: str | os.PathLike,
    split: str,
    num_games: int,
    seed: int,
    task_types=None,
    *,
    wording: str = "put",
    verify: bool = True,
    workers: int | None = 1,
    progress: bool = False,
    scenes: Sequence[int] | None = None,
    target_objects: Sequence[str] | None = None,
) -> GenerationReport:
    """Generate `num_games` ALFWorld games of `split` ("train", "valid_seen", "valid_unseen") under `out_dir`.

    Task types (names or ALFWorld ids 1-6; default all six) are used round-robin: game `i` has type
    `task_types[i % len(task_types)]` in canonical order. Each game's walkthrough is played on the real engine
    (`verify=True`) and candidates that fail are rejected, counted in the report and replaced by the next
    candidate of the same game index. `workers` processes verify games in parallel (None: one per CPU); the files
    do not depend on it. `scenes` restricts the floor plans (a subset of the split's; default all of them): fewer
    rooms make a smaller world, e.g. for a tiny model that must learn the rooms by heart. `target_objects` restricts
    what the tasks ask for (ALFRED object types such as "Book", case-insensitive; default any): a tiny model learns
    to spot a few object names long before it learns to match any name in the goal. Files are written to
    `<out_dir>/json_2.1.1/<split>/...` (existing files of the same games are overwritten, other files are left
    alone).
    """
    if split not in SPLIT_SCENES:
        raise ValueError(f"split must be one of {sorted(SPLIT_SCENES)}, got {split!r}")
    if wording not in WORDINGS:
        raise ValueError(f"wording must be one of {WORDINGS}, got {wording!r}")
    if int(num_games) < 0 or int(seed) < 0:
        raise ValueError("num_games and seed must be >= 0")
    num_games, seed = int(num_games), int(seed)
    types = normalize_task_types(task_types)
    assert set(types) <= set(ALL_TASK_TYPES)
    out_dir = os.fspath(out_dir)
    report = GenerationReport(
        out_dir=out_dir,
        split=split,
        seed=seed,
        requested=num_games,
        verified=verify,
        alfworld_version=alfworld_version(),
    )
    if scenes is not None:
        scenes = sorted({int(s) for s in scenes})
        foreign = [s for s in scenes if s not in SPLIT_SCENES[split]]
        if foreign or not scenes:
            raise ValueError(
                f"Invalid value {foreign or scenes!r} for `scenes`: allowed values are {split} floor plans "
                f"{list(SPLIT_SCENES[split])}."
            )
        hosts = {t: [s for s in scenes if room_type(s) in C.GOALS_VALID[t]] for t in types}
        if not all(hosts.values()):
            missing = [t for t, h in hosts.items() if not h]
            raise ValueError(f"`scenes` {scenes} have no room where these task types can happen: {missing}.")
    targets = normalize_target_objects(target_objects)
    jobs = [(split, seed, i, types[i % len(types)], wording, verify, scenes, targets) for i in range(num_games)]
    from ..pool.store import write_atomic  # the package's one atomic writer (imported here: it loads `datasets`)

    by_type: Counter = Counter()
    rejected: Counter = Counter()
    for files, rej in map_in_pool(_generate_one, jobs, workers, progress=progress, desc=f"generating {split}"):
        rejected.update(rej)
        if files is None:
            report.failed += 1
            continue
        game_dir = os.path.join(out_dir, files.rel_dir)
        os.makedirs(game_dir, exist_ok=True)
        for fname, text in (("traj_data.json", files.traj_json), ("game.tw-pddl", files.game_json)):
            write_atomic(os.path.join(game_dir, fname), functools.partial(_write_text, text=text))  # never half a game
        report.game_files.append(os.path.join(game_dir, "game.tw-pddl"))
        by_type[files.task_type] += 1
    report.by_task_type = {t: by_type[t] for t in types}
    report.rejected = dict(sorted(rejected.items()))
    return report


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
