"""Derive the (object, receptacle) pair counts the offline ALFWorld generator weights its tasks with.

Reads ALFRED's split file `data/splits/oct21.json` (github.com/askforalfred/alfred, MIT license) and writes
`trl_exreplay/alfworld/alfred_pairs.json`::

    {"source": "...", "counts": {task_type: {"Object|Parent": number of trials}}}

What is counted: the "train" split only; each trial once (the split lists a trial once per annotation,
`repeat_idx` 0, 1, 2...: entries are deduplicated by their task path); the six ALFWorld task types
(`pick_and_place_with_movable_recep` is dropped). A task path is
`<task_type>-<Object>-<MRecep>-<Parent>-<scene>/trial_...`; sliced objects ("AppleSliced") are counted as their
base object ("Apple"), since the generator has no sliced objects. For `look_at_obj_in_light` the Parent slot is
the lamp (DeskLamp or FloorLamp), so its pairs are "Object|Lamp".

Usage (the split file is a git object in a clone of askforalfred/alfred)::

    git -C alfred show HEAD:data/splits/oct21.json > /tmp/oct21.json
    python tools/alfred_pair_counts.py /tmp/oct21.json [--out trl_exreplay/alfworld/alfred_pairs.json]

The output has sorted keys and a fixed layout, so the same split file always gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

from trl_exreplay.alfworld.splits import ALL_TASK_TYPES

TASK_TYPES = ALL_TASK_TYPES
SOURCE = (
    "ALFRED data/splits/oct21.json (askforalfred/alfred, MIT), train split, unique trials; "
    "sliced objects counted as their base object"
)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "trl_exreplay", "envs", "alfworld", "alfred_pairs.json")


def base_object(obj: str) -> str:
    """The base object of a sliced one ("AppleSliced" -> "Apple"); other names unchanged."""
    return obj[: -len("Sliced")] if obj.endswith("Sliced") else obj


def pair_counts(splits: dict) -> dict[str, dict[str, int]]:
    """{task_type: {"Object|Parent": unique train trials}} for the six ALFWorld task types."""
    counts: dict[str, Counter] = {t: Counter() for t in TASK_TYPES}
    for path in sorted({entry["task"] for entry in splits["train"]}):
        task_dir = path.split("/")[0]
        fields = task_dir.split("-")
        if len(fields) != 5:
            raise ValueError(f"unexpected ALFRED task path {path!r}")
        task_type, obj, _mrecep, parent, _scene = fields
        if task_type in counts:
            counts[task_type][f"{base_object(obj)}|{parent}"] += 1
    return {t: dict(sorted(c.items())) for t, c in sorted(counts.items())}


def render(splits: dict) -> str:
    """The JSON text of the table (sorted keys, one pair per line, trailing newline)."""
    return json.dumps({"source": SOURCE, "counts": pair_counts(splits)}, sort_keys=True, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("split_file", help="path to ALFRED's data/splits/oct21.json")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output JSON (default: the package data file)")
    args = parser.parse_args(argv)
    with open(args.split_file, encoding="utf-8") as f:
        text = render(json.load(f))
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    counts = json.loads(text)["counts"]
    for task_type in TASK_TYPES:
        c = counts[task_type]
        print(f"{task_type}: {sum(c.values())} trials, {len(c)} pairs", file=sys.stderr)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
