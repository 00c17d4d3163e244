"""The pieces of torch's fused Adam/AdamW rule that every step running it shares.

amp_plugin runs that rule in three places: its own fused CPU kernels (:mod:`amp_plugin.fused.adam`),
torch's multi-tensor kernels under :class:`~amp_plugin.MasterWeightOptimizer`
(``master_weights/_multi_tensor.py``), and :class:`~amp_plugin.fsdp_moments.Bf16MomentsAdam`. They
initialise the optimizer state as ``torch.optim.Adam(fused=True)`` does (:func:`init_state`), hand the
kernels plain floats (:func:`as_float`), and refuse an optimizer built with ``foreach=True``, whose
update rounds differently (:func:`foreach_refusal`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.optim import Optimizer

__all__ = ["as_float", "foreach_refusal", "fused_adam_update", "init_state"]


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


def fused_adam_update(group: dict[str, Any], optimizer: Optimizer, lists: list[list[Any]], increment: bool) -> None:
    """torch's fused Adam/AdamW (``decoupled_weight_decay``, else AdamW for an ``optimizer`` of that class) with
    ``group``'s hyperparameters over ``lists`` (values, gradients, exp_avgs, exp_avg_sqs, step counters; FP32,
    any devices: one call per device, as ``torch.optim.Adam(fused=True)``), the counters first increased by one
    if ``increment``."""
    if not lists[0]:
        return
    grouped = cast(  # its lists hold no None: every list given has a tensor at every index
        "dict[tuple[torch.device, torch.dtype], tuple[list[list[torch.Tensor]], list[int]]]",
        Optimizer._group_tensors_by_device_and_dtype(lists),  # one C++ call, as torch's fused Adam
    )
    beta1, beta2 = group["betas"]
    decoupled = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    lr = group["lr"]
    for (device, _), ((d_params, d_grads, d_exp_avgs, d_exp_avg_sqs, d_steps), _) in grouped.items():
        if increment:
            torch._foreach_add_(d_steps, 1)
        # as torch's fused Adam: a tensor lr moves to a CUDA device, a CPU one stays
        d_lr: Any = (
            lr.to(device) if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != device else lr
        )
        kernel(
            d_params,
            d_grads,
            d_exp_avgs,
            d_exp_avg_sqs,
            [],
            d_steps,
            amsgrad=False,
            lr=d_lr,
            beta1=as_float(beta1),
            beta2=as_float(beta2),
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=None,
            found_inf=None,
        )
