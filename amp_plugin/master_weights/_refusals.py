"""Checks and small helpers of :class:`~amp_plugin.MasterWeightOptimizer`: what it refuses
(and the messages that say why), and the state and found-inf bookkeeping it shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin import fused as _fused
from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.fused import adam as _adam

__all__ = [
    "already_wrapped",
    "by_device_dtype",
    "check_fused_possible",
    "check_split_possible",
    "flag",
    "refuse_dtensors",
    "unscale_in_place",
    "upcast_state",
]


def check_fused_possible(optimizer: Optimizer, fused: bool | str) -> None:
    if fused == "torch":
        reason = _adam.adam_ineligible(optimizer, masters_to_come=True, device_type=None)
    else:
        reason = _adam.adam_ineligible(optimizer, masters_to_come=True)
        if reason is None and _adam.has_step_hooks(optimizer):
            reason = "the wrapped optimizer has step hooks, which the fused step would bypass"
        if reason is None and _fused.kernels() is None:
            reason = f"the kernels are unavailable ({_fused.unavailable_reason()})"
    if reason is not None:
        raise ValueError(f"fused={fused!r} is not possible here: {reason}. Use fused=None or False.")


def check_split_possible(optimizer: Optimizer) -> None:
    reason = _adam.adam_ineligible(optimizer, masters_to_come=True, device_type=None)
    if reason is None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.dtype is torch.float16:
                    reason = (
                        "it needs a BF16 model (the high half of an FP32 number is a BF16 number, not an "
                        f"FP16 one), but a parameter of shape {tuple(p.shape)} is float16"
                    )
                    break
    if reason is not None:
        raise ValueError(f"master='bf16_split' is not possible here: {reason}. Use master='fp32'.")


def refuse_dtensors(optimizer: Optimizer) -> None:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:
        return
    if any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        raise TypeError(
            "optimizer has DTensor parameters (FSDP2's fully_shard, or tensor parallelism): MasterWeightOptimizer "
            "is not allowed there, and not needed: under FSDP2 the sharded FP32 parameters are the masters and "
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16 or torch.float16) runs the forward and backward in "
            "half precision. Build the optimizer over the FP32 sharded parameters and use it as it is."
        )


def already_wrapped(what: str) -> str:
    return (
        f"{what} is already wrapped: its parameters are the FP32 masters of a MasterWeightOptimizer (or "
        "it was wrapped before), so a second wrapper would update masters that never reach the model. Use "
        "the MasterWeightOptimizer you already built (it is a torch.optim.Optimizer: give it to the LR "
        "scheduler, return it from configure_optimizers) instead of its .optimizer, or build a new "
        "optimizer over the model's parameters and wrap it once."
    )


def upcast_state(value: Any, param: torch.Tensor) -> Any:
    if not torch.is_tensor(value):
        return value
    if value.shape == param.shape and value.dim() > 0:  # per-element state: laid out like the master
        return value.to(
            torch.float32 if value.dtype in HALF_DTYPES else value.dtype, memory_format=torch.contiguous_format
        )
    return value.float() if value.dtype in HALF_DTYPES else value


def flag(found: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
    flag = found.get(device)
    if flag is None:
        flag = found[device] = torch.zeros((), dtype=torch.float32, device=device)
    return flag


def by_device_dtype(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups


def unscale_in_place(
    optimizer: Optimizer, inv_scale_on: Callable[[torch.device], torch.Tensor]
) -> dict[torch.device, torch.Tensor]:
    from amp_plugin.scaler import _unscale_in_place as unscale

    return unscale(optimizer, inv_scale_on)
