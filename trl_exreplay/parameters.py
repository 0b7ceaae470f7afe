"""The fields of a settings dataclass, documented once: in its TRL-style grouped `Parameters:` docstring.

TRL documents `GRPOConfig`'s fields in its docstring, grouped under `> Parameters that control ...` lines, and again
in each field's `metadata["help"]` (what `HfArgumentParser` prints). Here the docstring is the one text:
`document_fields` parses it and gives every field its `help` from it (a field without an entry, or an entry without a
field, is an error at import), and `tools/config_reference.py` writes `docs/config.md` from the same parse.
"""

from __future__ import annotations

import re
from dataclasses import fields
from types import MappingProxyType
from typing import Any, NamedTuple

# `name (`type`, *optional*, defaults to `value`):` at the entries' indentation
_ENTRY = re.compile(r"^(?P<name>\w+) \((?P<spec>.*)\):$")


class Parameter(NamedTuple):
    group: str  # the `> ...` line above it
    name: str
    spec: str  # what the parentheses hold: type and default, as written
    help: str  # its text, one line


def parameters(doc: str) -> list[Parameter]:
    """The entries of the `Parameters:` section of `doc`, in order."""
    lines = doc.expandtabs().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Parameters:"), None)
    if start is None:
        return []
    found: list[Parameter] = []
    group, indent = "", None
    name = spec = None
    text: list[str] = []

    def close():
        if name is not None:
            found.append(Parameter(group, name, spec, " ".join(text)))

    for line in lines[start + 1 :]:
        stripped = line.strip()
        if not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:  # the section ended
            break
        if depth == indent and stripped.startswith(">"):
            close()
            name, group = None, stripped.lstrip("> ").strip()
            continue
        entry = _ENTRY.match(stripped) if depth == indent else None
        if entry:
            close()
            name, spec, text = entry["name"], entry["spec"], []
        elif name is not None:
            text.append(stripped)
    close()
    return found


def document_fields(cls: type, skip: frozenset[str] = frozenset()) -> type:
    """Give each of `cls`'s own dataclass fields (those not in `skip`) its `help` from `cls`'s docstring. Raises
    `TypeError` when the docstring and the fields disagree (one missing, one extra, one twice)."""
    documented = parameters(cls.__doc__ or "")
    names = [p.name for p in documented]
    own = [f for f in fields(cls) if f.name not in skip]
    missing = sorted({f.name for f in own} - set(names))
    extra = sorted(set(names) - {f.name for f in own})
    twice = sorted({n for n in names if names.count(n) > 1})
    if missing or extra or twice:
        raise TypeError(
            f"{cls.__name__}'s `Parameters:` docstring must document each field once: undocumented {missing}, "
            f"not fields {extra}, twice {twice}"
        )
    text = {p.name: p.help for p in documented}
    for f in own:
        f.metadata = MappingProxyType({**f.metadata, "help": text[f.name]})
    return cls


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not to a config


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(condition: bool, name: str, value: Any, allowed: str) -> None:
    """Raise `ValueError` naming the field, its value and its allowed values unless `condition`."""
    if not condition:
        raise ValueError(f"Invalid value {value!r} for `{name}`: allowed values are {allowed}.")


def names(values: tuple) -> str:
    return ", ".join(repr(v) for v in values)
