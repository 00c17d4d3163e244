"""amp_plugin: mixed precision training for PyTorch Lightning.

The numerics core (this package's top level) has no Lightning import: loss scalers, FP32
master weights and CPU half-precision emulation work in a plain PyTorch loop.
"""

from amp_plugin.dynamic_scaler import DynamicLossScaler, LossScaleCollapseError
from amp_plugin.master_weights import MasterWeightOptimizer
from amp_plugin.scaler import LossScaler, ScaleUpdate, StaticLossScaler

__all__ = [
    "DynamicLossScaler",
    "LossScaleCollapseError",
    "LossScaler",
    "MasterWeightOptimizer",
    "ScaleUpdate",
    "StaticLossScaler",
]

__version__ = "0.1.0"
