"""The two fused passes of the master-weight step, driven from Python.

:func:`unscale_into` replaces "copy the half grads to FP32, then unscale them with the inf
check"; :func:`adam_step` replaces "``Adam(fused=True).step()``, then copy the masters back
into the model". :func:`adam_ineligible` says why an optimizer cannot take the fused step
(``None`` when it can).

Exactness. ``adam_step`` computes torch's fused CPU Adam/AdamW update bit for bit on every
element: torch runs that kernel 8 floats at a time (``Vectorized<float>`` of its AVX2 build,
which an AVX512 CPU runs too) with fused multiply-adds, and finishes the last ``numel % 8``
elements of each tensor with a scalar loop that fuses one product of the ``exp_avg_sq``
update differently (``fma(exp_avg_sq, beta2, ((1 - beta2) * g) * g)`` instead of
``fma((1 - beta2) * g, g, exp_avg_sq * beta2)``); ``adam_step`` reproduces both. Checked
against torch 2.13's x86-64 build for numels 1 to 40 and large ones, Adam and AdamW, with
and without weight decay, ``maximize``, and both branches of the ``exp_avg`` lerp. A torch
build compiled with other contractions (another compiler, ``-ffp-contract``, a non-x86 CPU)
may differ from it in the last bit on some elements.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["adam_ineligible", "adam_step", "has_step_hooks", "unscale_fits", "unscale_into"]


def unscale_fits(half_grads: list[torch.Tensor], out: list[torch.Tensor]) -> bool:
    """Whether :func:`unscale_into` can take these tensors (dense, contiguous, on the CPU)."""
    return all(t.device.type == "cpu" and t.is_contiguous() and not t.is_sparse for t in (*half_grads, *out))


def unscale_into(ops: Any, half_grads: list[torch.Tensor], out: list[torch.Tensor], found_inf: torch.Tensor,
                 inv_scale: torch.Tensor) -> None:
    """``out[i] = half_grads[i].float() * inv_scale`` and the inf check (``found_inf`` set to 1
    on any inf/NaN, never cleared), one pass per tensor. Check :func:`unscale_fits` first."""
    ops.unscale_into_(half_grads, out, found_inf, inv_scale.float())


def has_step_hooks(optimizer: Optimizer) -> bool:
    """The optimizer's own step hooks, which the fused step would bypass."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)


def adam_ineligible(optimizer: Optimizer) -> str | None:
    """Why ``optimizer`` (its type, options and parameters) cannot take the fused
    master-weight step, or ``None`` if it can. Step hooks are checked apart
    (:func:`has_step_hooks`): they can come and go between steps."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"the fused step implements Adam and AdamW only, not {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        for key in ("amsgrad", "capturable", "differentiable"):
            if group.get(key):
                return f"{key}=True is not supported by the fused step"
        for p in group["params"]:
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                return "the fused step needs contiguous FP32 masters on the CPU"
    return None


@torch.no_grad()
def adam_step(ops: Any, optimizer: Optimizer, model_of: dict[int, torch.Tensor]) -> bool:
    """One Adam/AdamW step of ``optimizer`` (over FP32 masters) that also writes each updated
    master, rounded, into its model parameter (``model_of[id(master)]``; masters that are
    their own parameter are absent).

    Returns False, having changed nothing, when a gradient does not suit the kernel (sparse,
    not FP32, not contiguous: a hook may have replaced it); the caller then steps the stock
    way. Initialises the state as ``torch.optim.Adam(fused=True)`` does, so state dicts move
    freely between this step and torch's.
    """
    grouped = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if p.grad is not None]
        if not all(not p.grad.is_sparse and p.grad.dtype == torch.float32 and p.grad.is_contiguous() for p in params):
            return False
        grouped.append((group, params))
    adamw_default = isinstance(optimizer, torch.optim.AdamW)
    for group, params in grouped:
        if not params:
            continue
        for p in params:
            state = optimizer.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [optimizer.state[p] for p in params]
        beta1, beta2 = (float(b) for b in group["betas"])
        ops.adam_step_(
            params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states], [model_of.get(id(p)) for p in params], float(group["lr"]), beta1, beta2,
            float(group["weight_decay"]), float(group["eps"]), bool(group.get("decoupled_weight_decay", adamw_default)),
            bool(group["maximize"]),
        )
    return True
