"""``amp_plugin.callbacks``: the Lightning callbacks, under the name the design documents.

They live in :mod:`amp_plugin.lightning.callbacks`; importing this module imports Lightning.
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
