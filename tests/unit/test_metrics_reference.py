"""docs/metrics.md names every metric the code logs under `replay/`, `env/` and `guide/`, and nothing else. The code's
names are read from its source: the literal names, and the families it logs by a variable part (the pool's
statistics, the counted totals, guided rollouts' running totals); a new kind of variable name fails here until the
page and this test learn it."""

from __future__ import annotations

import re
from pathlib import Path

from metrics_page import documented_metrics

from trl_exreplay.guidance.rollouts import _RUNNING_TOTALS
from trl_exreplay.pool import ExperiencePool

PACKAGE = Path(__file__).resolve().parents[2] / "trl_exreplay"
LITERAL = re.compile(r"""(?<![\w{])["']((?:replay|env|guide)/[a-z_]+)["']""")
TEMPLATE = re.compile(r"""f["']((?:replay|env|guide)/[^"']*\{[^"']*)["']""")
COUNTED = re.compile(r"""(?:\.count\(\s*|totals\[)["']([a-z_]+)["']""")  # FaultCounts kinds: logged as replay/<kind>


def source() -> str:
    return "\n".join(path.read_text() for path in sorted(PACKAGE.rglob("*.py")))


def logged_by_code(tmp_path) -> set[str]:
    text = source()
    # The names logged through a variable part, each family spelled out below.
    assert set(TEMPLATE.findall(text)) == {"replay/{name}", "guide/{kind}", "guide/success_{name}"}
    names = set(LITERAL.findall(text))
    names |= {f"replay/{kind}" for kind in COUNTED.findall(text)}  # metrics.log_generation: the counted totals
    pool_stats = ExperiencePool(work_dir=str(tmp_path)).stats()  # and the pool's statistics
    assert 'f"bucket_{difficulty}"' in (PACKAGE / "pool" / "experience_pool.py").read_text()
    names |= {f"replay/{key}" for key in pool_stats} | {"replay/bucket_<k>"}
    names |= {f"guide/{kind}" for kind in _RUNNING_TOTALS}  # GuidedRollouts.log
    names |= {"guide/success_guided", "guide/success_unguided"}
    return names


def test_the_metrics_page_names_exactly_what_the_code_logs(tmp_path):
    code, page = logged_by_code(tmp_path), documented_metrics()
    assert code - page == set(), "logged but not on docs/metrics.md"
    assert page - code == set(), "on docs/metrics.md but never logged"


def test_the_guided_success_metrics_are_the_two_the_code_names():
    text = (PACKAGE / "guidance" / "rollouts.py").read_text()
    assert '(("guided", True), ("unguided", False))' in text  # the names guide/success_{name} takes
