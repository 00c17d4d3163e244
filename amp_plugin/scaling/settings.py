"""A loss scaler's settings, each declared once.

A scaler class lists its settings (the constructor arguments that shape its policy) in one
table of :class:`Setting` rows. The constructor checks, ``settings()``, ``state_dict()``,
``load_state_dict()`` and ``__repr__`` all read that table, so a new setting is one row and
cannot be checked in one place and forgotten in another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Setting", "check_bool", "check_settings"]


@dataclass(frozen=True)
class Setting:
    """One setting of a scaler.

    Attributes:
        name: the constructor argument, the ``settings()`` and state-dict key.
        check: ``check(name, value) -> value``: the checked value, or ``ValueError`` /
            ``TypeError`` naming ``name``, the value and what is allowed.
        fmt: how ``__repr__`` shows the value (a format spec: ``"g"``, ``"d"``, ``"!r"``).
        attr: the attribute that holds it (default: ``name``).
        in_state: whether ``state_dict()`` saves it and ``load_state_dict()`` restores it.
    """

    name: str
    check: Callable[[str, Any], Any]
    fmt: str = "!r"
    attr: str | None = None
    in_state: bool = True

    def get(self, scaler: object) -> Any:
        """The value ``scaler`` holds."""
        return getattr(scaler, self.attr or self.name)

    def shown(self, scaler: object) -> str:
        """``name=value`` as ``__repr__`` writes it."""
        value = self.get(scaler)
        text = repr(value) if self.fmt == "!r" else format(value, self.fmt)
        return f"{self.name}={text}"


def check_settings(table: Iterable[Setting], values: Mapping[str, Any], *, loading: bool = False) -> dict[str, Any]:
    """Check every setting of ``table`` in ``values`` (which must hold them all).

    Args:
        table: the scaler's settings.
        values: the value of each setting, by name.
        loading: the values come from a state dict: a one-element integer tensor is read
            as an int, and a wrong type is a ``ValueError`` too (a bad checkpoint entry, not
            a programming error).

    Returns:
        The checked values, by name, in table order.
    """
    checked = {}
    for setting in table:
        value = values[setting.name]
        if loading and isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value.item())
        try:
            checked[setting.name] = setting.check(setting.name, value)
        except TypeError as err:
            if not loading:
                raise
            raise ValueError(str(err)) from None
    return checked


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not ``1``, not ``"no"``)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} is not allowed: {name} must be True or False.")
    return value
