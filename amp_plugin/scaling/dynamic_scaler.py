"""Dynamic loss scaling: back off on overflow, grow after a run of clean steps.

With ``hysteresis=1`` the rule is ``torch.amp.GradScaler``'s (same float32 arithmetic), plus
a floor (``min_scale``) and a ceiling (``max_scale``); :class:`DynamicLossScaler` says exactly
when the trajectories agree. ``hysteresis=N`` is the DeepSpeed/Megatron rule: every
overflowing step is skipped, but the scale backs off only once N overflows have been seen;
the counter refills when the scale grows (``"growth"``) or after every clean step
(``"finite"``). Two options, off by default: ``retries=N`` runs an overflowing batch again at
a lower scale, and ``early_growth_interval=N`` grows the scale before ``growth_interval``
when the gradients' amax shows headroom below FP16's largest value.
"""

from __future__ import annotations

import math
from enum import Enum
from functools import partial
from typing import Any

from amp_plugin.checks import check_choice, check_int, check_number, check_scale
from amp_plugin.scaling.collapse import LossScaleCollapseError
from amp_plugin.scaling.headroom import HeadroomRun
from amp_plugin.scaling.loss_scaler import LossScaler
from amp_plugin.scaling.scale_update import ScaleUpdate, float32_at_least, float32_at_most, to_float32
from amp_plugin.scaling.settings import Setting, check_settings
from amp_plugin.scaling.state import state_int

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
        retries: how often an overflowing batch runs again before it is skipped (>= 0). Inside
            :meth:`~amp_plugin.LossScaler.attempts` (the plugin uses it in Lightning's
            automatic optimization), an overflow with retries left backs the scale off by
            ``backoff_factor`` (whatever the hysteresis; ``reason="retry"``, counted in
            ``retried_steps``, not in ``skipped_steps``) and the same batch runs again, with the
            random streams and the modules' buffers put back; the overflow that spends the last
            retry is a skip under the rules above. No retry at
            ``min_scale``, where it would overflow again. The scale stays where the batch fitted.
            With ``retries >= retries_to_floor`` (24 with the defaults) a batch runs until it
            fits or the scale reaches ``min_scale``: no batch is lost unless it overflows there.
        early_growth_interval: ``0`` (default: off) or N >= 1: grow early, from the gradients'
            telemetry. Each step's scaled gradients' amax (measured in ``unscale_``, read with
            the found-inf flag: no extra host sync) gives the headroom ``log2(65504 / amax)``,
            in bits below FP16's largest value. After N clean steps in a row whose headroom is
            at least ``early_growth_margin + log2(growth_factor)``, the scale grows by
            ``growth_factor`` as many times as the run's smallest headroom allows while keeping
            ``early_growth_margin`` bits (``floor((headroom - margin) / log2(growth_factor))``
            times, capped at ``max_scale``), without waiting for ``growth_interval``. It is a
            growth (``reason="growth"``): every tracker resets. Off, the rule is unchanged.
        early_growth_margin: the headroom in bits (> 0) an early growth keeps below FP16's
            largest value; gradients inside the backward pass can be larger than the
            parameters' gradients it measures.
        enabled: ``False`` makes every method a pass-through (a bool).

    Every scale (``init_scale``, ``min_scale``, ``max_scale``, ``update(new_scale)``, a loaded
    ``"scale"``) must be finite, > 0 and inside float32's normal range ``[2**-126,
    3.4028e38]``, so that the scale and its reciprocal are finite float32 tensors.
    """

    # The settings, each declared once: checked, saved, loaded and shown from this table.
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    hysteresis_reset: str
    on_min_scale: str
    retries: int
    early_growth_interval: int
    early_growth_margin: float
    _SETTINGS = (
        Setting("growth_factor", lambda name, value: check_number(name, value, gt=1.0), "g"),
        Setting("backoff_factor", lambda name, value: check_number(name, value, gt=0.0, lt=1.0), "g"),
        Setting("growth_interval", partial(check_int, ge=1), "d"),
        Setting("hysteresis", partial(check_int, ge=1), "d"),
        Setting("hysteresis_reset", partial(check_choice, choices=_HYSTERESIS_RESETS)),
        Setting("min_scale", check_scale, "g"),
        Setting("max_scale", check_scale, "g"),
        Setting("on_min_scale", partial(check_choice, choices=_ON_MIN_SCALE)),
        Setting("retries", partial(check_int, ge=0), "d"),
        Setting("early_growth_interval", partial(check_int, ge=0), "d"),
        Setting("early_growth_margin", lambda name, value: check_number(name, value, gt=0.0), "g"),
    )

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
        retries: int = 0,
        early_growth_interval: int = 0,
        early_growth_margin: float = 4.0,
        enabled: bool = True,
    ) -> None:
        given = dict(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            hysteresis_reset=hysteresis_reset,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
            retries=retries,
            early_growth_interval=early_growth_interval,
            early_growth_margin=early_growth_margin,
        )
        settings = check_settings(self._SETTINGS, given)
        self._check_together(settings)
        init = _check_in_limits("init_scale", init_scale, settings["min_scale"], settings["max_scale"])
        for name, value in settings.items():
            setattr(self, name, value)
        super().__init__(init, enabled=enabled)
        self._scale_value = self._clamp(self._scale_value)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._headroom = HeadroomRun()  # clean steps in a row with room for an early growth

    # ------------------------------------------------------------------ GradScaler's getters/setters
    def get_growth_factor(self) -> float:
        """The scale's growth factor."""
        return self.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (a finite number > 1, as in the constructor)."""
        self.growth_factor = self._check("growth_factor", "new_factor", new_factor)

    def get_backoff_factor(self) -> float:
        """The scale's backoff factor."""
        return self.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (a finite number in (0, 1), as in the constructor)."""
        self.backoff_factor = self._check("backoff_factor", "new_factor", new_factor)

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an integer >= 1, as in the constructor). The current run of
        clean steps is kept: if it already reaches the new interval, the next clean step grows."""
        self.growth_interval = self._check("growth_interval", "new_interval", new_interval)

    def _check(self, setting: str, name: str, value: Any) -> Any:
        """``value`` checked as the constructor checks ``setting``, errors naming ``name``."""
        return next(s for s in self._SETTINGS if s.name == setting).check(name, value)

    @property
    def retries_to_floor(self) -> int:
        """Backoffs from ``max_scale`` down to ``min_scale``:
        ``ceil(log(max_scale / min_scale) / log(1 / backoff_factor))``, 24 with the defaults.
        With ``retries`` at least this, every batch runs until it fits or reaches ``min_scale``."""
        ratio = math.log(self._max32 / self._min32) / math.log(1.0 / self.backoff_factor)
        return math.ceil(round(ratio, 9))

    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        scale = self._scale_value
        if found_inf:
            self._growth_tracker = 0
            self._headroom.steps = 0
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
            if self._hysteresis_tracker > 0:
                return scale, "hysteresis"
            if scale <= self.min_scale:
                return scale, "min_scale"  # _after_update raises when on_min_scale="raise"
            return max(to_float32(scale * self.backoff_factor), self._min32), "overflow"
        if self.hysteresis_reset == "finite":
            self._hysteresis_tracker = self.hysteresis
        self._growth_tracker += 1
        if self._growth_tracker >= self.growth_interval:
            return self._grow(1), "growth"
        early = self._early_growths()
        if early:
            return self._grow(early), "growth"
        return scale, None

    def _grow(self, times: int) -> float:
        """The scale after ``times`` growths (a growth: every tracker resets)."""
        self._growth_tracker = 0
        self._headroom.steps = 0
        self._hysteresis_tracker = self.hysteresis
        scale = self._scale_value
        if times > 1:  # no more than the ceiling needs
            times = min(times, 1 + math.ceil(math.log(self._max32 / scale) / math.log(self.growth_factor)))
        for _ in range(times):
            grown = to_float32(scale * self.growth_factor)
            if not math.isfinite(grown):
                break  # like GradScaler, a growth that would overflow float32 keeps the scale
            scale = min(grown, self._max32)
            if scale >= self._max32:
                break
        return scale

    def _early_growths(self) -> int:
        """Add the clean step to the headroom run; the growths an early growth makes now (0: none)."""
        if self.early_growth_interval == 0:
            return 0
        self._headroom.observe(self.last_grad_amax, self.early_growth_margin, self.growth_factor)
        if self._headroom.steps < self.early_growth_interval:
            return 0
        return self._headroom.growths(self.early_growth_margin, self.growth_factor)

    def _after_update(self, update: ScaleUpdate) -> None:
        if update.reason == "manual":
            self._headroom.steps = 0  # the run's amax was measured at another scale
        if update.reason == "min_scale" and self.on_min_scale == "raise":
            raise LossScaleCollapseError(update.old_scale, update.iteration, self.consecutive_skips)

    def _wants_amax(self) -> bool:
        return self.early_growth_interval > 0

    def _retry_scale(self) -> float | None:
        if self.retries == 0 or self._scale_value <= self.min_scale:
            return None  # at the floor a retry would overflow the same way: skip as usual
        self._growth_tracker = 0
        self._headroom.steps = 0
        return max(to_float32(self._scale_value * self.backoff_factor), self._min32)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if not state:
            return state
        state.update(_growth_tracker=self._growth_tracker, _hysteresis_tracker=self._hysteresis_tracker)
        state.update(self._headroom.state())
        return state

    def resume_from(self, state_dict: dict[str, Any]) -> list[str]:
        """See :meth:`LossScaler.resume_from`. A changed ``hysteresis`` refills the counter, so
        the new setting holds from the first overflow after the resume."""
        changed = super().resume_from(state_dict)
        if state_dict.get("hysteresis", self.hysteresis) != self.hysteresis:
            self._hysteresis_tracker = self.hysteresis
        return changed

    def restarted(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """See :meth:`LossScaler.restarted`: also no clean steps counted (for a growth or an
        early growth) and a full hysteresis."""
        return {
            **super().restarted(state_dict),
            "_growth_tracker": 0,
            "_hysteresis_tracker": self.hysteresis,
            **HeadroomRun().state(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every tracker.

        Accepts a ``torch.amp.GradScaler`` state dict, or a :class:`StaticLossScaler` one:
        their missing keys keep this scaler's settings, the growth tracker starts at 0 and
        the hysteresis full. Each value is checked as the constructor checks it (the scale
        must also lie in ``[min_scale, max_scale]``, the loaded limits if any) before
        anything changes; ``ValueError`` names the bad key.
        """
        super().load_state_dict(state_dict)
        self._set_scale(self._clamp(self._scale_value))

    def _check_together(self, settings: dict[str, Any]) -> None:
        if settings["min_scale"] > settings["max_scale"]:
            raise ValueError(
                f"min_scale={settings['min_scale']!r} is above max_scale={settings['max_scale']!r}: min_scale "
                "must be <= max_scale."
            )

    def _checked_state(self, state_dict: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
        values = super()._checked_state(state_dict, settings)
        _check_in_limits("scale", values["scale"], settings["min_scale"], settings["max_scale"])
        values["_growth_tracker"] = state_int(state_dict, "_growth_tracker", 0)
        # A hysteresis lowered since the save (settings changed on resume) caps the tracker.
        hysteresis = settings["hysteresis"]
        values["_hysteresis_tracker"] = min(state_int(state_dict, "_hysteresis_tracker", hysteresis), hysteresis)
        values["_headroom"] = HeadroomRun.from_state(state_dict)
        return values

    def _load_trackers(self, values: dict[str, Any]) -> None:
        self._growth_tracker = values["_growth_tracker"]
        self._hysteresis_tracker = values["_hysteresis_tracker"]
        self._headroom = values["_headroom"]

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
        self._min32 = float32_at_least(value)

    @property
    def max_scale(self) -> float:
        """The ceiling of the scale."""
        return self._max_scale

    @max_scale.setter
    def max_scale(self, value: float) -> None:
        self._max_scale = value
        self._max32 = float32_at_most(value)


def _check_in_limits(name: str, value: Any, min_scale: float, max_scale: float) -> float:
    value = check_scale(name, value)
    if not min_scale <= value <= max_scale:
        raise ValueError(
            f"{name}={value!r} is not allowed: {name} must lie in [min_scale, max_scale] = "
            f"[{min_scale:g}, {max_scale:g}]; widen min_scale/max_scale to use it."
        )
    return value
