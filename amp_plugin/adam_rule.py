"""The pieces of torch's fused Adam/AdamW rule that every step running it shares.

amp_plugin runs that rule in three places: its own fused CPU kernels (:mod:`amp_plugin.fused.adam`),
torch's multi-tensor kernels under :class:`~amp_plugin.MasterWeightOptimizer`
(``master_weights/_multi_tensor.py``), and :class:`~amp_plugin.fsdp_moments.Bf16MomentsAdam`. They
initialise the optimizer state as ``torch.optim.Adam(fused=True)`` does (:func:`init_state`), hand the
kernels plain floats (:func:`as_float`), and refuse an optimizer built with ``foreach=True``, whose
update rounds differently (:func:`foreach_refusal`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["as_float", "foreach_refusal", "init_state"]


def init_state(optimizer: Optimizer, p: torch.Tensor, moments_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """``optimizer.state[p]``, initialised as ``torch.optim.Adam(fused=True)`` does (zero
    moments shaped like ``p``, contiguous, FP32 unless ``moments_dtype`` says otherwise), so
    state dicts move freely between the fused steps and torch's."""
    state = optimizer.state[p]
    if len(state) == 0:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros(p.shape, dtype=moments_dtype, device=p.device)
        state["exp_avg_sq"] = torch.zeros(p.shape, dtype=moments_dtype, device=p.device)
    return state


def as_float(value: Any) -> float:
    """A hyperparameter (``beta1``, ``beta2``, ...) as the Python float torch's fused kernels take:
    a tensor's value (a host read), or ``float(value)``."""
    return value.item() if isinstance(value, torch.Tensor) else float(value)


def foreach_refusal(optimizer: Optimizer) -> str | None:
    """Why the fused update rule would silently replace the one the optimizer was built for."""
    for group in optimizer.param_groups:
        if group.get("foreach") and not group.get("fused"):
            return (
                f"{type(optimizer).__name__} was built with foreach=True, but this step runs torch's fused "
                "Adam update, whose roundings differ from the foreach one (the masters would differ in some "
                "elements every step). Build it with fused=True (the same update everywhere), or leave "
                "foreach unset"
            )
    return None
