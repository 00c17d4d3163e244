"""Early growth from the gradients' amax: the rule of ``DynamicLossScaler(early_growth_interval=N)``.

The headroom of a step is ``log2(65504 / amax)``: how many bits the scaled gradients' largest
magnitude lies below FP16's largest value. A :class:`HeadroomRun` counts the clean steps in a
row that each leave room for at least one growth above the margin, and keeps their largest
amax; once the run is long enough, the scale grows as many times as that amax allows
(:func:`growths_below_margin`).
"""

from __future__ import annotations

import math
import sys
from typing import Any

from amp_plugin.checks import check_number
from amp_plugin.dtypes import FP16_MAX
from amp_plugin.scaling.state import state_int

__all__ = ["HeadroomRun", "growths_below_margin", "headroom_bits"]


def headroom_bits(amax: float) -> float:
    """``log2(65504 / amax)``: the bits between a scaled gradient amax and FP16's largest value."""
    return math.inf if amax == 0.0 else math.log2(FP16_MAX / amax)


def growths_below_margin(amax: float, margin: float, growth_factor: float) -> int:
    """The growths by ``growth_factor`` that keep ``amax`` at least ``margin`` bits below FP16's
    largest value: ``floor((headroom - margin) / log2(growth_factor))``, at least 0
    (``sys.maxsize`` for all-zero gradients: as far as the scaler's ceiling)."""
    if amax == 0.0:
        return sys.maxsize
    return max(0, math.floor((headroom_bits(amax) - margin) / math.log2(growth_factor)))


class HeadroomRun:
    """Clean steps in a row with room for an early growth, and their largest scaled amax.

    Attributes:
        steps: the length of the run (0: none).
        amax: the largest amax of the run (meaningful while ``steps > 0``).
    """

    __slots__ = ("amax", "steps")

    def __init__(self, steps: int = 0, amax: float = 0.0) -> None:
        self.steps = steps
        self.amax = amax

    def observe(self, amax: float | None, margin: float, growth_factor: float) -> None:
        """Add a clean step's amax to the run, or end the run: no amax measured, or no room for
        one growth above the margin."""
        if amax is None or not math.isfinite(amax) or growths_below_margin(amax, margin, growth_factor) < 1:
            self.steps = 0
            return
        self.amax = amax if self.steps == 0 else max(self.amax, amax)
        self.steps += 1

    def growths(self, margin: float, growth_factor: float) -> int:
        """The growths the run's largest amax allows."""
        return growths_below_margin(self.amax, margin, growth_factor)

    def state(self) -> dict[str, Any]:
        """The state-dict entries of the run."""
        return {"_headroom_run": self.steps, "_headroom_amax": self.amax}

    @classmethod
    def from_state(cls, state_dict: dict[str, Any]) -> HeadroomRun:
        """The run a state dict holds (none when it holds no entries); ``ValueError`` names a bad one."""
        amax = state_dict.get("_headroom_amax", 0.0)
        try:
            amax = check_number("_headroom_amax", amax, ge=0.0)
        except TypeError as err:
            raise ValueError(str(err)) from None
        return cls(state_int(state_dict, "_headroom_run", 0), amax)
