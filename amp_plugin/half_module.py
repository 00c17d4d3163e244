"""Cast a model to half precision, keeping normalisation layers in FP32.

Normalisation layers compute means and variances over many elements, which FP16's 10-bit
mantissa and narrow range handle badly, and their parameters are a tiny share of the model.
:func:`cast_module` keeps them (``LayerNorm``, ``GroupNorm``, ``RMSNorm``, all batch and
instance norms, and any module type passed in ``keep_fp32``) in FP32: their inputs are upcast
on the way in and their outputs cast back to the half dtype on the way out, so the rest of the
model sees half-precision activations only.

Modules that manage their own dtypes through an ``_apply`` of their own without the
``recurse`` argument of ``nn.Module._apply`` (torchmetrics' ``Metric``, whose states stay as
``Metric.set_dtype`` leaves them) are left untouched, with everything inside them.

The casts live in the kept module's own ``forward`` (an instance attribute wrapping the class's
``forward``), not in forward hooks: a module with hooks takes ``nn.Module``'s slow call path,
which on a host-bound GPU step costs more than the casts themselves.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["NORM_TYPES", "cast_floating", "cast_module"]

NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


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
        if id(sub) in kept:
            continue
        if _manages_own_dtypes(sub):
            kept.update(id(m) for m in sub.modules())
            continue
        wrapper = sub.__dict__.get("forward")
        if isinstance(wrapper, KeepFP32Forward):
            wrapper.out_dtype = dtype  # cast again: outputs follow the new dtype
        if keep and isinstance(sub, keep):
            kept.update(id(m) for m in sub.modules())
            sub.float()
            if not isinstance(wrapper, KeepFP32Forward):
                sub.forward = KeepFP32Forward(sub, dtype)
        elif id(sub) not in kept:
            # Only this module's own tensors: kept modules are never rounded through half.
            sub._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
    return module


def _manages_own_dtypes(module: nn.Module) -> bool:
    """An ``_apply`` override that cannot take ``recurse`` (torchmetrics' ``Metric``)."""
    apply = type(module)._apply
    if apply is nn.Module._apply:
        return False
    try:
        params = inspect.signature(apply).parameters
    except (TypeError, ValueError):
        return True
    return "recurse" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values())


class KeepFP32Forward:
    """The ``forward`` of a module kept in FP32: floating inputs are upcast to FP32, the
    module's own forward runs, floating outputs are cast to ``out_dtype``.

    Installed by :func:`cast_module` as the module's instance attribute ``forward``; the
    module's class ``forward`` (or a ``forward`` the instance already had) is what it wraps.
    """

    def __init__(self, module: nn.Module, out_dtype: torch.dtype) -> None:
        self.module = module
        self.inner = module.__dict__.get("forward")  # an instance-level forward set before ours
        self.out_dtype = out_dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and type(args[0]) is torch.Tensor:  # the common case, kept lean
            x = args[0]
            args = (x.float(),) if x.is_floating_point() and x.dtype != torch.float32 else args
        else:
            args, kwargs = cast_floating(args, torch.float32), cast_floating(kwargs, torch.float32)
        if self.inner is not None:
            out = self.inner(*args, **kwargs)
        else:
            out = type(self.module).forward(self.module, *args, **kwargs)
        if type(out) is torch.Tensor:
            return out.to(self.out_dtype) if out.is_floating_point() and out.dtype != self.out_dtype else out
        return cast_floating(out, self.out_dtype)

    def __repr__(self) -> str:
        return f"KeepFP32Forward({type(self.module).__name__}, out_dtype={self.out_dtype})"
