"""The documentation site (`mkdocs.yml`, MkDocs with the Material theme and mkdocstrings): it builds with
`--strict`, so a broken link, a missing page in the nav or a docstring mkdocstrings cannot read fails here."""

import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    site = tmp_path / "site"
    assert (site / "config" / "index.html").exists() and (site / "api" / "index.html").exists()
    api = (site / "api" / "index.html").read_text()
    assert "ExReplayGRPOConfig" in api and "off_policy_loss" in api  # rendered from the docstrings
