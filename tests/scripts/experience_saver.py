"""Child process of `tests/unit/test_guidance_store.py`'s killed-save tests.

Saves experience (records and a backlog that change with every save) to FOLDER in a loop until killed. Prints
``saving <i> <digest>`` before each save and ``saved <i> <digest> <seconds the save took>`` after it, where the
digest is `digest` of what save `i` writes.

With ``--sweep``, kills instead a forked copy of itself before the 1st, 2nd, ... filesystem operation (mkdir,
rename, replace, remove, rmdir, fsync, rmtree) of each of a few saves, in turn, checks after each kill that the
folder loads as the last committed save (or the new one, after the commit; or holds nothing before the first
commit), then saves for real and goes on; prints one JSON line with what it checked.

Usage: python experience_saver.py FOLDER SEED [--sweep]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import traceback

from trl_exreplay.guidance import ExperienceRecord, SummaryInput
from trl_exreplay.guidance.store import load_experience, save_experience


def digest(records: list[ExperienceRecord], backlog: list[SummaryInput]) -> str:
    text = json.dumps([[r.as_dict() for r in records], [b.as_dict() for b in backlog]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def experience(seed: int, save: int, size: int) -> tuple[list[ExperienceRecord], list[SummaryInput]]:
    """What save `save` writes: `size` records and `size // 4` backlog items, all of them naming the save."""
    pad = "é" * 40 + " x" * 60  # some bytes per row, unicode included
    records = [
        ExperienceRecord(f"t{j}", f"task {j} of seed {seed}", f"save {save} record {j} {pad}", f"t{j}:{save}", save)
        for j in range(size)
    ]
    backlog = [
        SummaryInput(f"t{j}:{save}", f"t{j}", f"task {j}", [f"act {save}", pad], float(j), save, [f"obs {j}"])
        for j in range(size // 4)
    ]
    return records, backlog


def loaded_digest(folder: str) -> str | None:
    try:
        loaded = load_experience(folder)
    except FileNotFoundError:  # before the first commit: no experience saved there
        return None
    return digest(loaded.records, loaded.backlog)


def leftovers(folder: str) -> list[str]:
    """What the committed manifest does not name in the folder: a killed save's version folder or temporary manifest."""
    if not os.path.isdir(folder):
        return []
    names = set(os.listdir(folder))
    if "manifest.json" in names:
        with open(os.path.join(folder, "manifest.json")) as f:
            names -= {"manifest.json", *(name.split("/")[0] for name in json.load(f)["files"])}
    return sorted(names)


def sweep(folder: str, seed: int) -> None:
    report = {"kills": 0, "loaded_old": 0, "loaded_new": 0, "loaded_none": 0, "left_something": 0}
    report.update(bad=[], leftovers_after_save=[])
    committed = None
    warm = folder + "-warm"  # the first save of a process pays for `datasets`' first use: not in every fork
    save_experience(warm, *experience(seed, 0, 1))
    shutil.rmtree(warm)
    for save in range(1, 4):
        records, backlog = experience(seed, save, 50)
        new = digest(records, backlog)
        for number in range(10_000):
            child = os.fork()
            if child == 0:  # the writer: killed before operation `number` of this save, if it has that many
                code = 0
                try:
                    from kill_points import die_before_operation  # beside this script, run as one

                    die_before_operation(number)
                    save_experience(folder, records, backlog)
                except BaseException:  # noqa: BLE001 - reported by the exit status; never back into the loop
                    traceback.print_exc()
                    code = 1
                os._exit(code)
            _, status = os.waitpid(child, 0)
            if os.WIFEXITED(status):  # the save has fewer operations: all its instants were visited
                if os.WEXITSTATUS(status) != 0:
                    report["bad"].append([save, number, f"the save failed (exit status {os.WEXITSTATUS(status)})"])
                break
            report["kills"] += 1
            try:
                found = loaded_digest(folder)
            except Exception as e:  # noqa: BLE001 - reported, the test fails on it
                report["bad"].append([save, number, repr(e)])
                continue
            if found not in (committed, new):
                report["bad"].append([save, number, found])
            key = "loaded_new" if found == new else "loaded_none" if found is None else "loaded_old"
            report[key] += 1
            report["left_something"] += bool(leftovers(folder))
        save_experience(folder, records, backlog)
        committed = new
        if leftovers(folder):
            report["leftovers_after_save"].append([save, leftovers(folder)])
    print(json.dumps(report), flush=True)


def main(folder: str, seed: int) -> None:
    save = 0
    while True:
        save += 1
        records, backlog = experience(seed, save, 4000)
        print("saving", save, digest(records, backlog), flush=True)
        start = time.perf_counter()
        save_experience(folder, records, backlog)
        print("saved", save, digest(records, backlog), time.perf_counter() - start, flush=True)


if __name__ == "__main__":
    (sweep if sys.argv[3:] == ["--sweep"] else main)(sys.argv[1], int(sys.argv[2]))
