"""Checks and small helpers of :class:`~amp_plugin.MasterWeightOptimizer`: what it refuses
(and the messages that say why), and the state and found-inf bookkeeping it shares."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin import fused as _fused
from amp_plugin.adam_rule import foreach_refusal
from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.fused import adam as _adam
from amp_plugin.master_weights._kinds import KINDS
from amp_plugin.master_weights._parameter import MASTER_TENSORS, WRAPPED
from amp_plugin.master_weights._stochastic import FREEZE_THRESHOLD

__all__ = [
    "FrozenMomentWarning",
    "already_wrapped",
    "by_device_dtype",
    "check_fused_possible",
    "check_kind_possible",
    "check_moments_dtype",
    "check_moments_rounding",
    "check_wrappable",
    "flag",
    "refuse_dtensors",
    "upcast_state",
]


def check_fused_possible(optimizer: Optimizer, fused: bool | str) -> None:
    if fused in ("torch", "compiled", "triton"):
        reason = _adam.adam_ineligible(optimizer, masters_to_come=True, device_type=None)
        if reason is None:
            reason = foreach_refusal(optimizer)
    else:
        reason = _adam.adam_ineligible(optimizer, masters_to_come=True)
        if reason is None:
            reason = foreach_refusal(optimizer)
        if reason is None and _adam.has_step_hooks(optimizer):
            reason = "the wrapped optimizer has step hooks, which the fused step would bypass"
        if reason is None and _fused.kernels() is None:
            reason = f"the kernels are unavailable ({_fused.unavailable_reason()})"
    if reason is not None:
        raise ValueError(f"fused={fused!r} is not possible here: {reason}. Use fused=None or False.")


def check_kind_possible(optimizer: Optimizer, kind: Any) -> None:
    """``master=kind.name``: what the kind itself refuses (an FP16 parameter for the BF16-only kinds).
    Every optimizer can take every kind and moments dtype: without a fitting kernel the wrapped
    optimizer's own step runs over the FP32 values (``_own_step.py``)."""
    reason = kind.refusal(optimizer)
    if reason is not None:
        raise ValueError(f"master={kind.name!r} is not possible here: {reason}. Use master='fp32'.")


class FrozenMomentWarning(UserWarning):
    """BF16 moments rounded to nearest with a beta at which they cannot shrink."""


def check_moments_rounding(optimizer: Optimizer, rounding: Any, moments_dtype: torch.dtype) -> None:
    """``moments_rounding``: ``"stochastic"`` or ``"nearest"``; the latter warns where a beta
    freezes a BF16 moment rounded to nearest (:data:`~amp_plugin.master_weights._stochastic.FREEZE_THRESHOLD`)."""
    if not isinstance(rounding, str) or rounding not in ("stochastic", "nearest"):
        raise ValueError(
            f"moments_rounding={rounding!r} is not allowed: moments_rounding must be 'stochastic' (the default) "
            "or 'nearest'."
        )
    if rounding != "nearest" or moments_dtype is not torch.bfloat16:
        return
    for group in optimizer.param_groups:
        betas = group.get("betas")
        if betas is None:
            continue
        for name, beta in zip(("beta1", "beta2"), betas):
            if float(beta) > FREEZE_THRESHOLD:
                warnings.warn(
                    f"moments_rounding='nearest' with {name}={float(beta):g}: a BF16 moment rounded to nearest "
                    f"cannot shrink when its beta is above 1 - 2**-9 = {FREEZE_THRESHOLD:.9g} (beta * v rounds back "
                    f"to v), so {'exp_avg_sq' if name == 'beta2' else 'exp_avg'} only grows and Adam's updates "
                    "shrink as training goes on. Use moments_rounding='stochastic' (the default) or FP32 moments "
                    "(moments_dtype=None).",
                    FrozenMomentWarning,
                    stacklevel=3,  # the caller of the optimizer's constructor
                )
                return


def check_moments_dtype(moments_dtype: Any) -> torch.dtype:
    """``None`` or FP32 -> ``torch.float32``; BF16 -> ``torch.bfloat16``; anything else: an error."""
    if moments_dtype is None or moments_dtype is torch.float32:
        return torch.float32
    if moments_dtype is torch.bfloat16:
        return torch.bfloat16
    raise ValueError(
        f"moments_dtype={moments_dtype!r} is not allowed: moments_dtype must be None (FP32, the default), "
        "torch.float32 or torch.bfloat16."
    )


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


def upcast_state(value: Any, param: torch.Tensor, moments_dtype: torch.dtype = torch.float32) -> Any:
    """Existing optimizer state moved onto a master: per-element floating state in
    ``moments_dtype`` (contiguous), other half-precision state in FP32."""
    if not torch.is_tensor(value):
        return value
    if value.shape == param.shape and value.dim() > 0:  # per-element state: laid out like the master
        dtype = moments_dtype if value.is_floating_point() else value.dtype
        return value.to(dtype, memory_format=torch.contiguous_format)
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


def check_wrappable(
    optimizer: Optimizer, fused: bool | str | None, master: str, moments_dtype: torch.dtype | None
) -> tuple[Any, torch.dtype]:
    """Refuse what ``MasterWeightOptimizer(optimizer, fused, master, moments_dtype)`` cannot wrap
    (``TypeError``/``ValueError`` that say why); returns the master kind and the moments dtype."""
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

    if not isinstance(master, str) or master not in KINDS:
        allowed = ", ".join(repr(k) for k in KINDS)
        raise ValueError(f"master={master!r} is not allowed: master must be one of {allowed}.")
    moments = check_moments_dtype(moments_dtype)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is not allowed: MasterWeightOptimizer wraps a torch.optim.Optimizer."
        )
    if isinstance(optimizer, MasterWeightOptimizer):
        raise TypeError("optimizer is already a MasterWeightOptimizer: wrap the inner optimizer once.")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "optimizer=LBFGS is not allowed: LBFGS evaluates its closure several times inside one "
            "step() and updates the parameters between evaluations, but MasterWeightOptimizer copies "
            "the FP32 masters into the model once per step, so every evaluation would see stale "
            "weights. Run LBFGS on an FP32 model without MasterWeightOptimizer, or use a first-order "
            "optimizer (SGD, Adam, AdamW) with master weights."
        )
    refuse_dtensors(optimizer)
    if optimizer in WRAPPED or any(p in MASTER_TENSORS for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(already_wrapped(type(optimizer).__name__))
    kind = KINDS[master]
    if fused is True or fused in (
        "torch",
        "compiled",
        "triton",
    ):  # checked before the optimizer's parameters are swapped for masters
        check_fused_possible(optimizer, fused)
    check_kind_possible(optimizer, kind)
    return kind, moments
