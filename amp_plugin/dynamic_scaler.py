"""Dynamic loss scaling: back off on overflow, grow after a run of clean steps.

With ``hysteresis=1`` the rule is exactly ``torch.amp.GradScaler``'s (same float32
arithmetic, same trajectory for the same overflow pattern), plus a floor (``min_scale``) and
a ceiling (``max_scale``). ``hysteresis=N`` is the DeepSpeed/Megatron rule: every overflowing
step is skipped, but the scale backs off only once N overflows have been seen; the counter
refills when the scale grows (``"growth"``) or after every clean step (``"finite"``).
"""

from __future__ import annotations

import math
from typing import Any

from amp_plugin._checks import check_choice, check_int, check_number
from amp_plugin.scaler import LossScaler, ScaleUpdate, to_float32

__all__ = ["DynamicLossScaler", "LossScaleCollapseError"]

_HYSTERESIS_RESETS = ("growth", "finite")
_ON_MIN_SCALE = ("raise", "skip")


class LossScaleCollapseError(FloatingPointError):
    """The loss scale is at ``min_scale`` and the gradients still overflow.

    Attributes:
        scale: the scale at which it happened.
        iteration: the 0-based update index.
        consecutive_skips: how many steps in a row were skipped, this one included.
        checkpoint_path: where the last good state was saved before stopping, if it was.
    """

    def __init__(self, scale: float, iteration: int, consecutive_skips: int, checkpoint_path: str | None = None) -> None:
        self.scale = scale
        self.iteration = iteration
        self.consecutive_skips = consecutive_skips
        self.checkpoint_path = checkpoint_path
        saved = (
            f" The last good state (skipped steps change nothing) was saved to {checkpoint_path}."
            if checkpoint_path else ""
        )
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

    Args:
        init_scale: starting scale, inside ``[min_scale, max_scale]``.
        growth_factor: multiplier (> 1) applied after ``growth_interval`` clean steps.
        backoff_factor: multiplier in (0, 1) applied on an overflow (once hysteresis is spent).
        growth_interval: clean steps in a row before a growth (>= 1).
        hysteresis: overflows tolerated before backing off (>= 1; 1 = back off at once).
        hysteresis_reset: when the hysteresis counter refills: ``"growth"`` (on each growth,
            DeepSpeed/Megatron default) or ``"finite"`` (after every clean step).
        min_scale: the scale never backs off below this.
        max_scale: the scale never grows above this (a capped growth still counts as one).
        on_min_scale: what an overflow due to back off at ``min_scale`` does: ``"raise"``
            :class:`LossScaleCollapseError` from ``update()``, or ``"skip"`` and carry on.
        enabled: ``False`` makes every method a pass-through.
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
        self.growth_factor = check_number("growth_factor", growth_factor, gt=1.0)
        self.backoff_factor = check_number("backoff_factor", backoff_factor, gt=0.0, lt=1.0)
        self.growth_interval = check_int("growth_interval", growth_interval, ge=1)
        self.hysteresis = check_int("hysteresis", hysteresis, ge=1)
        self.hysteresis_reset = check_choice("hysteresis_reset", hysteresis_reset, _HYSTERESIS_RESETS)
        self.min_scale = check_number("min_scale", min_scale, gt=0.0)
        self.max_scale = check_number("max_scale", max_scale, gt=0.0)
        self.on_min_scale = check_choice("on_min_scale", on_min_scale, _ON_MIN_SCALE)
        if self.min_scale > self.max_scale:
            raise ValueError(
                f"min_scale={min_scale!r} is above max_scale={max_scale!r}: min_scale must be <= max_scale."
            )
        init = check_number("init_scale", init_scale, gt=0.0)
        if not self.min_scale <= init <= self.max_scale:
            raise ValueError(
                f"init_scale={init_scale!r} is not allowed: init_scale must lie in "
                f"[min_scale, max_scale] = [{self.min_scale:g}, {self.max_scale:g}]."
            )
        super().__init__(init, enabled=enabled)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        scale = self._scale_value
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
            if self._hysteresis_tracker > 0:
                return scale, "hysteresis"
            if scale <= self.min_scale:
                return scale, "min_scale"  # _after_update raises when on_min_scale="raise"
            return max(to_float32(scale * self.backoff_factor), self.min_scale), "overflow"
        if self.hysteresis_reset == "finite":
            self._hysteresis_tracker = self.hysteresis
        self._growth_tracker += 1
        if self._growth_tracker < self.growth_interval:
            return scale, None
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        grown = to_float32(scale * self.growth_factor)
        # Like GradScaler, a growth that would overflow float32 keeps the scale.
        return (min(grown, self.max_scale) if math.isfinite(grown) else scale), "growth"

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
        state.update(self.settings(), _growth_tracker=self._growth_tracker, _hysteresis_tracker=self._hysteresis_tracker)
        return state

    def resume_from(self, state_dict: dict[str, Any]) -> list[str]:
        """See :meth:`LossScaler.resume_from`. A changed ``hysteresis`` refills the counter, so
        the new setting holds from the first overflow after the resume."""
        changed = super().resume_from(state_dict)
        if state_dict.get("hysteresis", self.hysteresis) != self.hysteresis:
            self._hysteresis_tracker = self.hysteresis
        return changed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every tracker. Accepts a ``torch.amp.GradScaler`` state dict too (its
        missing keys keep this scaler's settings, hysteresis starts full)."""
        if not self._enabled:
            return
        super().load_state_dict(state_dict)
        self.growth_factor = float(state_dict.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state_dict.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state_dict.get("growth_interval", self.growth_interval))
        self._growth_tracker = int(state_dict.get("_growth_tracker", 0))
        self.hysteresis = int(state_dict.get("hysteresis", self.hysteresis))
        self.hysteresis_reset = state_dict.get("hysteresis_reset", self.hysteresis_reset)
        self._hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self.hysteresis))
        self.min_scale = float(state_dict.get("min_scale", self.min_scale))
        self.max_scale = float(state_dict.get("max_scale", self.max_scale))
        self.on_min_scale = state_dict.get("on_min_scale", self.on_min_scale)

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale_value:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, hysteresis_reset={self.hysteresis_reset!r}, "
            f"min_scale={self.min_scale:g}, max_scale={self.max_scale:g}, "
            f"on_min_scale={self.on_min_scale!r}, enabled={self._enabled})"
        )
