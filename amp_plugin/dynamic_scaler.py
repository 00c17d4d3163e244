"""Dynamic loss scaling: back off on overflow, grow after a run of clean steps.

With ``hysteresis=1`` the rule is ``torch.amp.GradScaler``'s (same float32 arithmetic), plus
a floor (``min_scale``) and a ceiling (``max_scale``); :class:`DynamicLossScaler` says exactly
when the trajectories agree. ``hysteresis=N`` is the DeepSpeed/Megatron rule: every
overflowing step is skipped, but the scale backs off only once N overflows have been seen;
the counter refills when the scale grows (``"growth"``) or after every clean step
(``"finite"``).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import torch

from amp_plugin.checks import check_choice, check_int, check_number, check_scale
from amp_plugin.scaler import LossScaler, ScaleUpdate, _state_int, to_float32

__all__ = ["DynamicLossScaler", "HysteresisReset", "LossScaleCollapseError", "OnMinScale"]


class HysteresisReset(str, Enum):
    """``hysteresis_reset=``: when the hysteresis counter refills."""

    growth = "growth"  # on each growth (DeepSpeed/Megatron default)
    finite = "finite"  # after every clean step (DeepSpeed's consecutive mode)


class OnMinScale(str, Enum):
    """``on_min_scale=``: what an overflow due to back off at ``min_scale`` does."""

    raise_ = "raise"  # LossScaleCollapseError from update()
    skip = "skip"  # keep skipping


_HYSTERESIS_RESETS = tuple(m.value for m in HysteresisReset)
_ON_MIN_SCALE = tuple(m.value for m in OnMinScale)


class LossScaleCollapseError(FloatingPointError):
    """The loss scale is at ``min_scale`` and the gradients still overflow.

    Attributes:
        scale: the scale at which it happened.
        iteration: the 0-based update index.
        consecutive_skips: how many steps in a row were skipped, this one included.
        checkpoint_path: where the last good state was saved before stopping, if it was.
    """

    def __init__(
        self, scale: float, iteration: int, consecutive_skips: int, checkpoint_path: str | None = None
    ) -> None:
        self.scale = scale
        self.iteration = iteration
        self.consecutive_skips = consecutive_skips
        self.checkpoint_path = checkpoint_path
        saved = f" The last healthy state is in {checkpoint_path}." if checkpoint_path else ""
        super().__init__(
            f"Loss scale collapsed: gradients are still inf/NaN at the minimum scale {scale:g} "
            f"(step {iteration}, {consecutive_skips} steps skipped in a row). Training cannot make "
            "progress. Try: a lower learning rate or gradient clipping; checking the data and the "
            "loss for NaN/inf; bf16 instead of fp16 (same range as fp32, common for weights "
            "pretrained in bf16); or on_min_scale='skip' to keep skipping instead of stopping." + saved
        )


class DynamicLossScaler(LossScaler):
    """Loss scaler whose scale follows the overflow pattern.

    Drop-in for ``torch.amp.GradScaler`` in a plain loop::

        scaler = DynamicLossScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)      # returns None when the step was skipped
        scaler.update()

    It has GradScaler's public methods (``scale``, ``unscale_``, ``step``, ``update``,
    ``get_scale``, ``is_enabled``, ``get_/set_growth_factor``, ``get_/set_backoff_factor``,
    ``get_/set_growth_interval``, ``state_dict``, ``load_state_dict``); the setters check
    their value as the constructor does. ``get_scale()`` never waits for the device.

    When the trajectory equals GradScaler's. Take a GradScaler and this scaler with
    ``hysteresis=1`` and the same ``init_scale``, ``growth_factor``, ``backoff_factor`` and
    ``growth_interval``, and the same overflow pattern (found-inf per iteration, any number of
    optimizers). Both compute each new scale as the float32 rounding of ``scale * factor``
    (computed in double) and skip the same steps, so their scales are equal after every
    ``update()`` for as long as every scale GradScaler reaches lies in ``[min_scale,
    max_scale]``: every backed-off value is ``>= min_scale`` and no overflow happens at
    ``min_scale`` (below it this scaler clamps, or raises or keeps the scale there), and every
    grown value is ``<= max_scale`` (above it this scaler caps; both keep the scale when a
    growth would overflow float32). With the defaults (``min_scale=1``, ``max_scale=2**24``)
    that means: equal while GradScaler's scale stays within ``[1, 2**24]``. Other
    differences: ``update(new_scale)`` must lie in ``[min_scale, max_scale]`` here (GradScaler
    takes any float); after ``set_growth_interval`` lowers the interval below the current run
    of clean steps, this scaler grows at the next clean step while GradScaler (which waits for
    the run to *equal* the interval) never grows again; and scales outside float32's normal
    range, which GradScaler can reach by backing off, are refused here.

    Args:
        init_scale: starting scale, inside ``[min_scale, max_scale]``.
        growth_factor: multiplier (> 1) applied after ``growth_interval`` clean steps.
        backoff_factor: multiplier in (0, 1) applied on an overflow (once hysteresis is spent).
        growth_interval: clean steps in a row before a growth (>= 1).
        hysteresis: overflows tolerated before backing off (>= 1; 1 = back off at once).
        hysteresis_reset: when the hysteresis counter refills: ``"growth"`` (on each growth,
            DeepSpeed/Megatron default) or ``"finite"`` (after every clean step).
        min_scale: the scale never backs off below this (rounded up to a float32).
        max_scale: the scale never grows above this (rounded down to a float32; a capped
            growth still counts as one).
        on_min_scale: what an overflow due to back off at ``min_scale`` does: ``"raise"``
            :class:`LossScaleCollapseError` from ``update()``, or ``"skip"`` and carry on.
        enabled: ``False`` makes every method a pass-through.

    Every scale (``init_scale``, ``min_scale``, ``max_scale``, ``update(new_scale)``, a loaded
    ``"scale"``) must be finite, > 0 and inside float32's normal range ``[2**-126,
    3.4028e38]``, so that the scale and its reciprocal are finite float32 tensors.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        hysteresis_reset: str = "growth",
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        on_min_scale: str = "raise",
        enabled: bool = True,
    ) -> None:
        self.growth_factor = _check_growth_factor(growth_factor)
        self.backoff_factor = _check_backoff_factor(backoff_factor)
        self.growth_interval = check_int("growth_interval", growth_interval, ge=1)
        self.hysteresis = check_int("hysteresis", hysteresis, ge=1)
        self.hysteresis_reset = check_choice("hysteresis_reset", hysteresis_reset, _HYSTERESIS_RESETS)
        self.min_scale, self.max_scale = _check_limits(min_scale, max_scale)
        self.on_min_scale = check_choice("on_min_scale", on_min_scale, _ON_MIN_SCALE)
        init = _check_in_limits("init_scale", init_scale, self.min_scale, self.max_scale)
        super().__init__(init, enabled=enabled)
        self._scale_value = self._clamp(self._scale_value)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    # ------------------------------------------------------------------ GradScaler's getters/setters
    def get_growth_factor(self) -> float:
        """The scale's growth factor."""
        return self.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (a finite number > 1, as in the constructor)."""
        self.growth_factor = _check_growth_factor(new_factor, "new_factor")

    def get_backoff_factor(self) -> float:
        """The scale's backoff factor."""
        return self.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (a finite number in (0, 1), as in the constructor)."""
        self.backoff_factor = _check_backoff_factor(new_factor, "new_factor")

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an integer >= 1, as in the constructor). The current run of
        clean steps is kept: if it already reaches the new interval, the next clean step grows."""
        self.growth_interval = check_int("new_interval", new_interval, ge=1)

    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        scale = self._scale_value
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
            if self._hysteresis_tracker > 0:
                return scale, "hysteresis"
            if scale <= self.min_scale:
                return scale, "min_scale"  # _after_update raises when on_min_scale="raise"
            return max(to_float32(scale * self.backoff_factor), self._min32), "overflow"
        if self.hysteresis_reset == "finite":
            self._hysteresis_tracker = self.hysteresis
        self._growth_tracker += 1
        if self._growth_tracker < self.growth_interval:
            return scale, None
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        grown = to_float32(scale * self.growth_factor)
        # Like GradScaler, a growth that would overflow float32 keeps the scale.
        return (min(grown, self._max32) if math.isfinite(grown) else scale), "growth"

    def _after_update(self, update: ScaleUpdate) -> None:
        if update.reason == "min_scale" and self.on_min_scale == "raise":
            raise LossScaleCollapseError(update.old_scale, update.iteration, self.consecutive_skips)

    def settings(self) -> dict[str, Any]:
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "hysteresis_reset": self.hysteresis_reset,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "on_min_scale": self.on_min_scale,
        }

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if not state:
            return state
        state.update(
            self.settings(), _growth_tracker=self._growth_tracker, _hysteresis_tracker=self._hysteresis_tracker
        )
        return state

    def resume_from(self, state_dict: dict[str, Any]) -> list[str]:
        """See :meth:`LossScaler.resume_from`. A changed ``hysteresis`` refills the counter, so
        the new setting holds from the first overflow after the resume."""
        changed = super().resume_from(state_dict)
        if state_dict.get("hysteresis", self.hysteresis) != self.hysteresis:
            self._hysteresis_tracker = self.hysteresis
        return changed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every tracker.

        Accepts a ``torch.amp.GradScaler`` state dict, or a :class:`StaticLossScaler` one:
        their missing keys keep this scaler's settings, the growth tracker starts at 0 and
        the hysteresis full. Each value is checked as the constructor checks it (the scale
        must also lie in ``[min_scale, max_scale]``, the loaded limits if any) before
        anything changes; ``ValueError`` names the bad key.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            super().load_state_dict(state_dict)  # the empty-dict error
        get = state_dict.get
        growth_factor = _check_growth_factor(get("growth_factor", self.growth_factor))
        backoff_factor = _check_backoff_factor(get("backoff_factor", self.backoff_factor))
        growth_interval = _state_int(state_dict, "growth_interval", self.growth_interval)
        hysteresis = _state_int(state_dict, "hysteresis", self.hysteresis)
        for key, value, low in (("growth_interval", growth_interval, 1), ("hysteresis", hysteresis, 1)):
            check_int(key, value, ge=low)
        hysteresis_reset = check_choice(
            "hysteresis_reset", get("hysteresis_reset", self.hysteresis_reset), _HYSTERESIS_RESETS
        )
        on_min_scale = check_choice("on_min_scale", get("on_min_scale", self.on_min_scale), _ON_MIN_SCALE)
        min_scale, max_scale = _check_limits(get("min_scale", self.min_scale), get("max_scale", self.max_scale))
        values = self._checked_state(state_dict)
        _check_in_limits("scale", values["scale"], min_scale, max_scale)
        growth_tracker = _state_int(state_dict, "_growth_tracker", 0)
        # A hysteresis lowered since the save (settings changed on resume) caps the tracker.
        hysteresis_tracker = min(_state_int(state_dict, "_hysteresis_tracker", hysteresis), hysteresis)
        # All checked: apply.
        super().load_state_dict(state_dict)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self._growth_tracker = growth_interval, growth_tracker
        self.hysteresis, self.hysteresis_reset = hysteresis, hysteresis_reset
        self._hysteresis_tracker = hysteresis_tracker
        self.min_scale, self.max_scale = min_scale, max_scale
        self.on_min_scale = on_min_scale
        self._set_scale(self._clamp(self._scale_value))

    def _check_manual_scale(self, value: Any) -> float:
        return self._clamp(to_float32(_check_in_limits("new_scale", value, self.min_scale, self.max_scale)))

    def _clamp(self, scale32: float) -> float:
        """A float32 scale from inside [min_scale, max_scale] kept inside it after rounding."""
        return min(max(scale32, self._min32), self._max32)

    @property
    def min_scale(self) -> float:
        """The floor of the scale."""
        return self._min_scale

    @min_scale.setter
    def min_scale(self, value: float) -> None:
        self._min_scale = value
        self._min32 = _float32_at_least(value)

    @property
    def max_scale(self) -> float:
        """The ceiling of the scale."""
        return self._max_scale

    @max_scale.setter
    def max_scale(self, value: float) -> None:
        self._max_scale = value
        self._max32 = _float32_at_most(value)

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale_value:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, hysteresis_reset={self.hysteresis_reset!r}, "
            f"min_scale={self.min_scale:g}, max_scale={self.max_scale:g}, "
            f"on_min_scale={self.on_min_scale!r}, enabled={self._enabled})"
        )


def _check_growth_factor(value: Any, name: str = "growth_factor") -> float:
    return check_number(name, value, gt=1.0)


def _check_backoff_factor(value: Any, name: str = "backoff_factor") -> float:
    return check_number(name, value, gt=0.0, lt=1.0)


def _check_limits(min_scale: Any, max_scale: Any) -> tuple[float, float]:
    low, high = check_scale("min_scale", min_scale), check_scale("max_scale", max_scale)
    if low > high:
        raise ValueError(f"min_scale={min_scale!r} is above max_scale={max_scale!r}: min_scale must be <= max_scale.")
    return low, high


def _check_in_limits(name: str, value: Any, min_scale: float, max_scale: float) -> float:
    value = check_scale(name, value)
    if not min_scale <= value <= max_scale:
        raise ValueError(
            f"{name}={value!r} is not allowed: {name} must lie in [min_scale, max_scale] = "
            f"[{min_scale:g}, {max_scale:g}]; widen min_scale/max_scale to use it."
        )
    return value


def _float32_at_least(value: float) -> float:
    """The smallest float32 >= ``value``."""
    rounded = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if float(rounded) < value:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf))
    return float(rounded)


def _float32_at_most(value: float) -> float:
    """The largest float32 <= ``value``."""
    rounded = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if float(rounded) > value:
        rounded = torch.nextafter(rounded, torch.tensor(-math.inf))
    return float(rounded)
