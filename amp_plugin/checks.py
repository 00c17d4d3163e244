"""Argument checks shared by the public constructors, and public for recipe authors.

Every check raises ``ValueError`` (or ``TypeError`` for a wrong type) whose message names the
argument, repeats the value it got and says what is allowed, so a typo in a config file is
fixed in one read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import Enum
from typing import Any

__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "check_choice", "check_int", "check_number", "check_scale", "check_type"]

FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32 (2**-126): its reciprocal, 2**126, is still finite in float32."""


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: {name} must be {allowed}.")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return ``value`` if it is one of ``choices``."""
    if isinstance(value, Enum):  # a str Enum member from a structured config: its value
        value = value.value
    choices = tuple(choices)
    if value not in choices:
        raise _bad(name, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def check_number(
    name: str,
    value: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> float:
    """Return ``value`` as a finite float inside the given open/closed bounds."""
    bounds = []
    if gt is not None:
        bounds.append(f"> {gt:g}")
    if ge is not None:
        bounds.append(f">= {ge:g}")
    if lt is not None:
        bounds.append(f"< {lt:g}")
    if le is not None:
        bounds.append(f"<= {le:g}")
    allowed = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} is not allowed: {name} must be {allowed}.")
    value = float(value)
    ok = math.isfinite(value)
    ok = ok and (gt is None or value > gt) and (ge is None or value >= ge)
    ok = ok and (lt is None or value < lt) and (le is None or value <= le)
    if not ok:
        raise _bad(name, value, allowed)
    return value


def check_scale(name: str, value: Any) -> float:
    """Return ``value`` as a float if it is a loss scale float32 can hold: finite, > 0, and
    inside float32's normal range, so that the scale and its reciprocal are both finite
    (``1e39`` would become inf, ``1e-50`` would become 0, and 1/``1e-40`` would be inf)."""
    allowed = (
        f"a finite number > 0 inside float32's normal range [{FLOAT32_TINY:g}, {FLOAT32_MAX:g}] "
        "(the scale and 1/scale are float32 tensors and must both be finite)"
    )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} is not allowed: {name} must be {allowed}.")
    value = float(value)
    if not (math.isfinite(value) and FLOAT32_TINY <= value <= FLOAT32_MAX):
        raise _bad(name, value, allowed)
    return value


def check_int(name: str, value: Any, *, ge: int) -> int:
    """Return ``value`` if it is an integer ``>= ge``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} is not allowed: {name} must be an integer >= {ge}.")
    if value < ge:
        raise _bad(name, value, f"an integer >= {ge}")
    return value


def check_type(name: str, value: Any, types: type | tuple[type, ...], allowed: str) -> Any:
    """Return ``value`` if it is an instance of ``types``; otherwise a ``TypeError`` naming ``name``,
    the value (its repr cut to 60 characters), its type and ``allowed``."""
    if not isinstance(value, types):
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        raise TypeError(f"{name}={text} ({type(value).__name__}) is not allowed: {name} must be {allowed}.")
    return value
