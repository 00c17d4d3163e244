"""Deprecated: the loss scalers' old import path. Import them from :mod:`amp_plugin` (or
:mod:`amp_plugin.scaling`, the package that holds them, one module per idea).

``from amp_plugin.scaler import LossScaler`` still works and warns (``DeprecationWarning``), naming
the path to use instead.
"""

from __future__ import annotations

from amp_plugin._moved import forwarding

MOVED = {
    "HalfLossWarning": "amp_plugin",
    "LossScaler": "amp_plugin",
    "ScaleUpdate": "amp_plugin",
    "StaticLossScaler": "amp_plugin",
    "to_float32": "amp_plugin.scaling",
    "unscale_grouped": "amp_plugin.scaling.unscale",
}
__all__ = sorted(MOVED)
__getattr__, __dir__ = forwarding(__name__, MOVED)
