"""The TRL versions whose `GRPOTrainer` this library's overrides were checked against, enforced at import.

`ExReplayGRPOTrainer` overrides private methods of TRL's `GRPOTrainer` (`tests/integration/test_trl_contract.py` pins their
signatures). A TRL outside this range may have changed them silently, so importing the trainer or its config with
one is an `ImportError` that names the supported range (the same as ``pyproject.toml``'s pin).

Example:

```python
from trl_exreplay.compat import TRL_SUPPORTED, check_trl_version

check_trl_version("1.16.0")
try:
    check_trl_version("1.17.0")
except ImportError as e:
    assert TRL_SUPPORTED in str(e)
```
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

TRL_MIN, TRL_BELOW = "1.16.0", "1.17"
TRL_SUPPORTED = f"trl>={TRL_MIN},<{TRL_BELOW}"


def check_trl_version(found: str | None = None) -> None:
    """Raise `ImportError` unless TRL's version (installed, or `found`) is in `TRL_SUPPORTED`."""
    from packaging.version import Version

    if found is None:
        try:
            found = version("trl")
        except PackageNotFoundError:
            raise ImportError(f"trl_exreplay needs TRL ({TRL_SUPPORTED}); it is not installed.") from None
    if not Version(TRL_MIN) <= Version(found) < Version(TRL_BELOW):
        raise ImportError(
            f"trl_exreplay supports {TRL_SUPPORTED} (its trainer overrides private methods of that GRPOTrainer); "
            f"found trl {found}. Install a supported one: pip install '{TRL_SUPPORTED}'."
        )


check_trl_version()
