"""The documentation's Markdown as MkDocs (Python-Markdown) renders it, and as a user reads it:

* a block nested in a list item (a sub-list, a second paragraph, a code block) is indented 4 spaces: with 1-3, Python-
  Markdown ends the list there (a list of 7 steps with 3-space sub-bullets rendered as 13);
* no Mermaid diagram: the theme fetches Mermaid's script from a CDN, so offline the diagram shows as its source;
* no word of the project's own process on a user page (issue numbers; the internal design documents, or "the seed"
  for one of them).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
PAGES = sorted((REPOSITORY / "docs").rglob("*.md")) + [REPOSITORY / "README.md"]
MARKER = re.compile(r"([-*+]|\d+\.)\s")


def misindented(text: str) -> list[tuple[int, str]]:
    """Lines outside code blocks that Python-Markdown would not render as written: a list marker, a code fence or
    (after a blank line) a paragraph indented by 1 to 3 spaces; and a list item right under a nested paragraph (no
    blank line between), which that paragraph swallows."""
    found, in_code, after_blank, nested_paragraph = [], False, True, None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if stripped.startswith("```"):
            if not in_code and 1 <= indent <= 3:
                found.append((number, line))
            in_code, after_blank, nested_paragraph = not in_code, False, None
            continue
        if in_code:
            continue
        if not stripped:
            after_blank, nested_paragraph = True, None
            continue
        marker = MARKER.match(stripped)
        if 1 <= indent <= 3 and (marker or (after_blank and not stripped.startswith("|"))):
            found.append((number, line))
        elif marker and nested_paragraph is not None and indent < nested_paragraph:
            found.append((number, line))
        if after_blank and indent >= 4 and not marker:
            nested_paragraph = indent  # a paragraph inside a list item, until the next blank line
        after_blank = False
    return found


def test_the_rule_finds_the_ways_a_nested_block_breaks_a_list():
    text = "1. step\n   - sub-bullet\n2. step\n\n   a second paragraph\n3. step\n   ```python\n   x\n   ```\n"
    assert [number for number, _ in misindented(text)] == [2, 5, 7]
    swallowed = "1. step\n\n    a second paragraph\n2. the next step, swallowed\n"
    assert [number for number, _ in misindented(swallowed)] == [4]
    fixed = "1. step\n    - sub-bullet\n      continued\n2. step\n   lazily continued\n\n    a second paragraph\n"
    assert misindented(fixed) == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPOSITORY)) for p in PAGES])
def test_nested_blocks_are_indented_four_spaces(page):
    assert misindented(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPOSITORY)) for p in PAGES])
def test_no_page_needs_a_cdn_or_speaks_of_the_projects_process(page):
    text = page.read_text()
    assert "```mermaid" not in text
    internal = r"\b[Ii]ssues? \d+|\bthe issue's\b|\bseeds? 00\d\b|\bthe seed(?:'s|s'| gives)|design documents?"
    assert re.findall(internal, text) == []
