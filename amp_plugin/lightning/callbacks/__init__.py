"""Lightning callbacks that make mixed precision visible.

- :class:`LossScaleMonitor`: the loss scale and skipped steps as metrics, every scale event
  (with the parameters that overflowed) in ``scale_events.csv``.
- :class:`GradientHealthMonitor`: per-parameter zero/underflow fractions and FP16 headroom
  every N steps, in ``grad_health.csv``.
- :class:`PreflightChecks`: known-bad half-precision setups reported at the start of ``fit``.
- :class:`FP8Monitor`: per FP8 layer and operand, amax, scale, saturated and flushed-to-zero
  fractions every N steps, in ``fp8_stats.csv``.
- :class:`FaultInjector`: inf/NaN gradients, NaN losses or NaN batches at chosen steps.
"""

from amp_plugin.lightning.callbacks.fault_injection import FaultInjector
from amp_plugin.lightning.callbacks.fp8 import FP8Monitor
from amp_plugin.lightning.callbacks.grad_health import GradientHealthMonitor, ParamGradHealth
from amp_plugin.lightning.callbacks.loss_scale import LossScaleMonitor, ScaleEvent
from amp_plugin.lightning.callbacks.preflight import PreflightChecks

__all__ = [
    "FP8Monitor",
    "FaultInjector",
    "GradientHealthMonitor",
    "LossScaleMonitor",
    "ParamGradHealth",
    "PreflightChecks",
    "ScaleEvent",
]
