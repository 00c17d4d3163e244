"""Deprecated: ``DynamicLossScaler``'s import path of earlier releases. Import it from
:mod:`amp_plugin` (its choices ``HysteresisReset`` and ``OnMinScale`` from :mod:`amp_plugin.scaling`).

``from amp_plugin.dynamic_scaler import DynamicLossScaler`` still works and warns
(``DeprecationWarning``), naming the path to use instead.
"""

from __future__ import annotations

from amp_plugin._moved import forwarding

MOVED = {
    "DynamicLossScaler": "amp_plugin",
    "LossScaleCollapseError": "amp_plugin",
    "HysteresisReset": "amp_plugin.scaling",
    "OnMinScale": "amp_plugin.scaling",
}
__all__ = sorted(MOVED)
__getattr__, __dir__ = forwarding(__name__, MOVED)
