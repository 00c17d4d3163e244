"""How a run's half-precision compute runs: CPU emulation or native kernels, and why.

:func:`wants_emulation` reads the plugin's ``emulate`` setting against the device and dtype;
:func:`compute_path` is the line ``MixedPrecisionPlugin.describe()`` prints about it;
:func:`default_dtype` sets the dtype tensors are created in (the pure half presets' init
contexts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch

from amp_plugin.emulation import cpu_half_path, should_emulate
from amp_plugin.settings import PrecisionSettings

__all__ = ["compute_path", "default_dtype", "wants_emulation"]


def wants_emulation(emulate: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``emulate`` (``"auto"``, ``"on"``, ``"off"``) asks for CPU half emulation here."""
    return emulate == "on" or (emulate == "auto" and should_emulate(device_type, dtype))


def compute_path(settings: PrecisionSettings, device_type: str, emulating: bool) -> str:
    """``"<dtype>: native|emulated (why)"`` for this run's device and settings."""
    dtype = settings.precision
    if dtype == "fp32":
        return "fp32"
    if device_type != "cpu":
        return f"{dtype}: native ({device_type})"
    if settings.emulate != "auto":
        how = "emulated (FP32 matmuls rounded once)" if emulating else "native CPU kernels"
        reason = cpu_half_path(settings.compute_dtype).reason
        return f"{dtype}: {how}, forced by emulate={settings.emulate!r} (auto: {reason})"
    return f"{dtype}: {cpu_half_path(settings.compute_dtype).reason}"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    """``torch.set_default_dtype(dtype)`` inside the block, the previous default after it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
