"""The loss scalers, one module per idea (no Lightning import).

- :mod:`~amp_plugin.scaling.loss_scaler`: :class:`LossScaler`, the base: the
  ``torch.amp.GradScaler`` interface, per-optimizer stages, the one host read per step;
- :mod:`~amp_plugin.scaling.static_scaler` and :mod:`~amp_plugin.scaling.dynamic_scaler`: the
  two policies (backoff, growth, hysteresis, the floor, retries, early growth);
- :mod:`~amp_plugin.scaling.retries`: running an overflowing batch again (``attempts()``);
  :mod:`~amp_plugin.scaling.buffer_state`: the modules' buffers, put back before a retry;
- :mod:`~amp_plugin.scaling.headroom`: early growth from the gradients' amax;
- :mod:`~amp_plugin.scaling.scale_update`: what one ``update()`` did, float32 rounding;
- :mod:`~amp_plugin.scaling.settings` and :mod:`~amp_plugin.scaling.state`: the settings
  table and the state dicts;
- :mod:`~amp_plugin.scaling.stages`, :mod:`~amp_plugin.scaling.unscale`,
  :mod:`~amp_plugin.scaling.scaling_aware`: the per-optimizer flags and their host read, the
  fused unscale and amax kernels, torch's protocol for optimizers that unscale themselves;
- :mod:`~amp_plugin.scaling.collapse`: :class:`LossScaleCollapseError`.

Users import the scalers from :mod:`amp_plugin`, or from here. (``amp_plugin.scaler`` and
``amp_plugin.dynamic_scaler``, the paths of earlier releases, still work and warn.)
"""

from __future__ import annotations

from amp_plugin.scaling.collapse import LossScaleCollapseError
from amp_plugin.scaling.dynamic_scaler import DynamicLossScaler, HysteresisReset, OnMinScale
from amp_plugin.scaling.loss_scaler import HalfLossWarning, LossScaler
from amp_plugin.scaling.scale_update import ScaleUpdate, to_float32
from amp_plugin.scaling.static_scaler import StaticLossScaler

__all__ = [
    "DynamicLossScaler",
    "HalfLossWarning",
    "HysteresisReset",
    "LossScaleCollapseError",
    "LossScaler",
    "OnMinScale",
    "ScaleUpdate",
    "StaticLossScaler",
    "to_float32",
]
