"""``amp_plugin.callbacks``: the Lightning callbacks, under the name the design documents.

They live in :mod:`amp_plugin.lightning.callbacks`; importing this module imports Lightning. This
path is public and stays (no deprecation): the design names ``amp_plugin.callbacks.LossScaleMonitor``
and ``amp_plugin.callbacks.GradientHealthMonitor``, and configs name it in ``_target_``.
"""

from amp_plugin.lightning.callbacks import (
    FaultInjector,
    FP8Monitor,
    GradientHealthMonitor,
    LossScaleMonitor,
    ParamGradHealth,
    PreflightChecks,
    ScaleEvent,
)

__all__ = [
    "FP8Monitor",
    "FaultInjector",
    "GradientHealthMonitor",
    "LossScaleMonitor",
    "ParamGradHealth",
    "PreflightChecks",
    "ScaleEvent",
]
