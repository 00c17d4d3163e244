"""Import paths that moved: a module kept at its old path forwards each name with a DeprecationWarning.

The warning names the module to import from instead; it is a ``DeprecationWarning``, so Python shows
it where a user's own script (``__main__``) or test run imports the old path, and nowhere else.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["forwarding"]


def forwarding(old: str, moved: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the deprecated module ``old`` whose names live on in the
    modules ``moved`` maps them to (name -> new module)."""

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        new = moved[name]
        warnings.warn(
            f"{old} is deprecated and will be removed in a later release: use `from {new} import {name}`",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    def __dir__() -> list[str]:
        return sorted(moved)

    return __getattr__, __dir__
