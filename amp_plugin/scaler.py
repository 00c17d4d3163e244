"""Loss scalers with the ``torch.amp.GradScaler`` interface: the public import path.

The code lives in :mod:`amp_plugin.scaling`, one module per idea; this module gathers the
names users import from here.
"""

from __future__ import annotations

from amp_plugin.scaling.loss_scaler import HalfLossWarning, LossScaler
from amp_plugin.scaling.scale_update import ScaleUpdate, to_float32
from amp_plugin.scaling.static_scaler import StaticLossScaler
from amp_plugin.scaling.unscale import unscale_grouped

__all__ = ["HalfLossWarning", "LossScaler", "ScaleUpdate", "StaticLossScaler", "to_float32", "unscale_grouped"]
