"""amp_plugin: mixed precision training for PyTorch Lightning.

The numerics core (this package's top level) has no Lightning import: loss scalers, FP32
master weights and CPU half-precision emulation work in a plain PyTorch loop.

The Lightning layer lives in :mod:`amp_plugin.lightning` (``MixedPrecisionPlugin`` and the
callbacks, also importable as :mod:`amp_plugin.callbacks`, the path the design documents).
``amp_plugin.MixedPrecisionPlugin`` is resolved on first access, so importing the core never
imports Lightning.

Each idea is a package (:mod:`amp_plugin.scaling`, :mod:`amp_plugin.master_weights`,
:mod:`amp_plugin.emulation`, :mod:`amp_plugin.fp8`, :mod:`amp_plugin.fused`, :mod:`amp_plugin.lightning`,
:mod:`amp_plugin.app`) or a module of this package; a leading underscore is private to its package.
``amp_plugin.scaler`` and ``amp_plugin.dynamic_scaler``, the scalers' paths of earlier releases,
still work and warn, naming the path to use.
"""

from amp_plugin.emulation import CpuHalfEmulation, should_emulate
from amp_plugin.half_module import cast_module
from amp_plugin.master_weights import MasterGradWarning, MasterWeightOptimizer
from amp_plugin.scaling import (
    DynamicLossScaler,
    HalfLossWarning,
    LossScaleCollapseError,
    LossScaler,
    ScaleUpdate,
    StaticLossScaler,
)


def __getattr__(name: str):
    # The Lightning layer is imported on first use, so the numerics core stays Lightning-free.
    if name == "MixedPrecisionPlugin":
        from amp_plugin.lightning import MixedPrecisionPlugin

        return MixedPrecisionPlugin
    raise AttributeError(f"module 'amp_plugin' has no attribute {name!r}")


__all__ = [
    "CpuHalfEmulation",
    "DynamicLossScaler",
    "HalfLossWarning",
    "LossScaleCollapseError",
    "LossScaler",
    "MasterGradWarning",
    "MasterWeightOptimizer",
    "MixedPrecisionPlugin",
    "ScaleUpdate",
    "StaticLossScaler",
    "cast_module",
    "should_emulate",
]

__version__ = "0.1.0"
