"""A fixed loss scale: :class:`StaticLossScaler`."""

from __future__ import annotations

from typing import Any

from amp_plugin.checks import check_scale
from amp_plugin.scaling.loss_scaler import LossScaler
from amp_plugin.scaling.settings import Setting, check_settings

__all__ = ["StaticLossScaler"]


class StaticLossScaler(LossScaler):
    """A fixed loss scale. Steps with inf/NaN gradients are still skipped; the scale never moves.

    It has no ``torch.amp.GradScaler`` counterpart, so no growth/backoff getters and setters
    (:class:`~amp_plugin.DynamicLossScaler` has them). ``load_state_dict`` takes the
    ``"scale"`` and the counters of any scaler's state dict and ignores a dynamic scaler's
    settings: the loaded scale stays fixed from then on. Its own state dict loads into
    ``torch.amp.GradScaler`` as one whose scale never moves (growth and backoff factors 1.0),
    and into :class:`~amp_plugin.DynamicLossScaler` with that scaler's own settings.

    Args:
        scale: the constant scale: finite, > 0, inside float32's normal range.
        enabled: ``False`` makes it a pass-through.
    """

    _SETTINGS = (Setting("scale", check_scale, "g", attr="_scale_value", in_state=False),)

    def __init__(self, scale: float = 2.0**16, enabled: bool = True) -> None:
        checked = check_settings(self._SETTINGS, {"scale": scale})
        super().__init__(checked["scale"], enabled=enabled)

    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        return self._scale_value, None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            # What torch.amp.GradScaler.load_state_dict reads, for a scale that never moves;
            # "static" tells a DynamicLossScaler that these are no settings of its own.
            state.update(growth_factor=1.0, backoff_factor=1.0, growth_interval=_INT32_MAX, _growth_tracker=0)
            state["static"] = True
        return state


_INT32_MAX = 2**31 - 1
