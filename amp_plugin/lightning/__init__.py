"""The Lightning layer: ``MixedPrecisionPlugin`` and the callbacks that make it visible.

Every class here works with both Lightning packages, ``lightning`` (``lightning.pytorch``)
and ``pytorch_lightning``, whichever is installed (see :mod:`amp_plugin.lightning.namespace`)::

    import lightning as L
    from amp_plugin.lightning import LossScaleMonitor, MixedPrecisionPlugin

    trainer = L.Trainer(plugins=[MixedPrecisionPlugin("fp16")], callbacks=[LossScaleMonitor()])

The numerics core (:mod:`amp_plugin`) never imports this package.
"""

from amp_plugin.lightning.callbacks import (
    FaultInjector,
    GradientHealthMonitor,
    LossScaleMonitor,
    ParamGradHealth,
    PreflightChecks,
    ScaleEvent,
)
from amp_plugin.lightning.checkpoint_io import AtomicCheckpointIO
from amp_plugin.lightning.namespace import NAMESPACES, pl
from amp_plugin.lightning.plugin import CHECKPOINT_KEY, MixedPrecisionPlugin

__all__ = [
    "CHECKPOINT_KEY",
    "NAMESPACES",
    "AtomicCheckpointIO",
    "FaultInjector",
    "GradientHealthMonitor",
    "LossScaleMonitor",
    "MixedPrecisionPlugin",
    "ParamGradHealth",
    "PreflightChecks",
    "ScaleEvent",
    "pl",
]
