"""Cast a model to half precision, keeping normalisation layers in FP32.

Normalisation layers compute means and variances over many elements, which FP16's 10-bit
mantissa and narrow range handle badly, and their parameters are a tiny share of the model.
:func:`cast_module` keeps them (``LayerNorm``, ``GroupNorm``, ``RMSNorm``, all batch and
instance norms, and any module type passed in ``keep_fp32``) in FP32: their inputs are upcast
on the way in and their outputs cast back to the half dtype on the way out, so the rest of the
model sees half-precision activations only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["NORM_TYPES", "cast_module", "cast_floating"]

NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())

_HOOKED = "_amp_plugin_fp32_hooks"


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a (nested) list/tuple/dict to ``dtype``."""
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() and data.dtype != dtype else data
    if isinstance(data, (list, tuple)):
        items = [cast_floating(d, dtype) for d in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, dict):
        return type(data)((k, cast_floating(v, dtype)) for k, v in data.items())
    return data


def cast_module(
    module: nn.Module,
    dtype: torch.dtype,
    keep_norm_fp32: bool = True,
    keep_fp32: tuple[type[nn.Module], ...] = (),
) -> nn.Module:
    """Cast ``module``'s floating parameters and buffers to ``dtype`` in place.

    Args:
        module: the model.
        dtype: ``torch.float16`` or ``torch.bfloat16`` (``torch.float32`` casts back).
        keep_norm_fp32: keep normalisation layers (:data:`NORM_TYPES`) in FP32.
        keep_fp32: more module types to keep in FP32 the same way.

    Returns the same module.
    """
    keep = (NORM_TYPES if keep_norm_fp32 else ()) + tuple(keep_fp32)
    if dtype == torch.float32:
        keep = ()
    kept: set[int] = set()
    for sub in module.modules():
        if hasattr(sub, _HOOKED):
            object.__setattr__(sub, "_amp_plugin_out_dtype", dtype)
        if keep and isinstance(sub, keep):
            kept.update(id(m) for m in sub.modules())
            sub.float()
            if not hasattr(sub, _HOOKED):
                pre = sub.register_forward_pre_hook(_upcast_inputs)
                post = sub.register_forward_hook(_downcast_output)
                object.__setattr__(sub, _HOOKED, (pre, post))
            object.__setattr__(sub, "_amp_plugin_out_dtype", dtype)
        elif id(sub) not in kept:
            # Only this module's own tensors: kept modules are never rounded through half.
            sub._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    return module


def _upcast_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return cast_floating(args, torch.float32)


def _downcast_output(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return cast_floating(output, module._amp_plugin_out_dtype)
