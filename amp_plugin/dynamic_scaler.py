"""``DynamicLossScaler`` and its choices, at the import path of earlier releases.

The code lives in :mod:`amp_plugin.scaling.dynamic_scaler`; ``from amp_plugin import
DynamicLossScaler`` is the usual import.
"""

from __future__ import annotations

from amp_plugin.scaling.dynamic_scaler import DynamicLossScaler, HysteresisReset, LossScaleCollapseError, OnMinScale

__all__ = ["DynamicLossScaler", "HysteresisReset", "LossScaleCollapseError", "OnMinScale"]
