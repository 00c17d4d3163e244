"""What one ``update()`` of a loss scaler did, and the float32 a scale is stored in."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

__all__ = ["ScaleUpdate", "float32_at_least", "float32_at_most", "to_float32"]


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, as torch's scale kernels store it (ties to
    even; beyond float32's range, inf). Host arithmetic only: no tensor, no device."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # rounds to inf in float32 (struct refuses instead)
        return math.copysign(math.inf, value)


def float32_at_least(value: float) -> float:
    """The smallest float32 >= ``value`` (a floor that rounding never lowers)."""
    rounded = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if float(rounded) < value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf))
    return float(rounded)


def float32_at_most(value: float) -> float:
    """The largest float32 <= ``value`` (a ceiling that rounding never raises)."""
    rounded = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if float(rounded) > value:
        rounded = torch.nextafter(rounded, torch.tensor(-math.inf))
    return float(rounded)


@dataclass(frozen=True)
class ScaleUpdate:
    """What one ``update()`` did.

    Attributes:
        iteration: 0-based index of the update (iteration) this describes.
        old_scale: the scale before the update.
        new_scale: the scale after it.
        found_inf: whether the iteration had a non-finite gradient (its step was skipped).
        reason: ``None`` for a clean step that left the scale alone, otherwise one of
            ``"growth"`` (grew after ``growth_interval`` clean steps, or earlier from the
            gradients' headroom with ``DynamicLossScaler(early_growth_interval=N)``; a growth
            capped at ``max_scale`` still counts), ``"overflow"`` (backed off), ``"hysteresis"``
            (overflow absorbed by hysteresis, scale kept), ``"min_scale"`` (overflow at
            ``min_scale`` with ``on_min_scale="skip"``, scale kept), ``"manual"``
            (``update(new_scale)``), ``"retry"`` (backed off to run the same batch again,
            see ``DynamicLossScaler(retries=N)``; the batch is not skipped yet).
    """

    iteration: int
    old_scale: float
    new_scale: float
    found_inf: bool
    reason: str | None

    @property
    def changed(self) -> bool:
        """True when the scale value changed."""
        return self.old_scale != self.new_scale
