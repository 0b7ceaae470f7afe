"""The metric names `docs/metrics.md` documents, for the tests that hold the page to the code (the names the code
spells, `tests/unit/test_metrics_reference.py`) and to a run (the names a trainer logs,
`tests/integration/test_logged_metrics.py`)."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
FAMILIES = ("replay", "env", "guide")
NAME = re.compile(r"`((?:replay|env|guide)/[a-z_<>]+)`")


def documented_metrics() -> set[str]:
    """The names in the first column of the page's tables (`replay/bucket_<k>` stands for every bucket)."""
    names = set()
    for line in PAGE.read_text().splitlines():
        if line.startswith("| `"):
            names |= set(NAME.findall(line.split("|")[1]))
    return names


def page_name(logged: str) -> str:
    """The page's name for a logged metric: a bucket's number becomes `<k>`."""
    return re.sub(r"^replay/bucket_\d+$", "replay/bucket_<k>", logged)
