"""Loss scalers with the ``torch.amp.GradScaler`` interface: the public import path.

The pieces live in one module per idea; this module gathers the names users import:

- :mod:`amp_plugin.loss_scaler`: :class:`LossScaler`, the base (the GradScaler interface,
  per-optimizer stages, the one host sync per step) and :class:`HalfLossWarning`;
- :mod:`amp_plugin.static_scaler`: :class:`StaticLossScaler`;
- :mod:`amp_plugin.dynamic_scaler`: ``DynamicLossScaler`` (backoff, growth, hysteresis,
  retries, early growth);
- :mod:`amp_plugin.scale_update`: :class:`ScaleUpdate` (what one ``update()`` did) and
  :func:`to_float32`;
- :mod:`amp_plugin.scaler_retries`: running an overflowing batch again;
- :mod:`amp_plugin.scaler_state`, :mod:`amp_plugin.scaler_settings`: state dicts and the
  settings table;
- :mod:`amp_plugin.scaler_stages`, :mod:`amp_plugin.unscale`,
  :mod:`amp_plugin.scaling_aware`: the per-optimizer flags and their host read, the fused
  unscale and amax kernels, torch's protocol for optimizers that unscale themselves.
"""

from __future__ import annotations

from amp_plugin.loss_scaler import HalfLossWarning, LossScaler
from amp_plugin.scale_update import ScaleUpdate, to_float32
from amp_plugin.static_scaler import StaticLossScaler
from amp_plugin.unscale import unscale_grouped

__all__ = ["HalfLossWarning", "LossScaler", "ScaleUpdate", "StaticLossScaler", "to_float32", "unscale_grouped"]
