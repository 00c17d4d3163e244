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
    on any inf/NaN, never cleared), one pass per tensor. The tensors must be dense,
    contiguous CPU tensors (:func:`unscale_fits`)."""
    ops.unscale_into_(half_grads, out, found_inf, inv_scale.float())


def has_step_hooks(optimizer: Optimizer) -> bool:
    """The optimizer's own step hooks, which the fused step would bypass."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)


def adam_ineligible(optimizer: Optimizer, masters_to_come: bool = False) -> str | None:
    """Why ``optimizer`` (its type, options and parameters) cannot take the fused
    master-weight step, or ``None`` if it can. Step hooks are checked apart
    (:func:`has_step_hooks`): they can come and go between steps.

    ``masters_to_come``: the optimizer is not wrapped yet; its FP16/BF16 parameters count as
    the contiguous FP32 masters that will replace them.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"the fused step implements Adam and AdamW only, not {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        for key in ("amsgrad", "capturable", "differentiable"):
            if group.get(key):
                return f"{key}=True is not supported by the fused step"
        for p in group["params"]:
            if p.device.type != "cpu":
                return "the fused step needs its parameters on the CPU"
            if masters_to_come and p.dtype in (torch.float16, torch.bfloat16):
                continue
            if p.dtype != torch.float32 or not p.is_contiguous():
                return "the fused step needs FP32 parameters (kept as their own master) to be contiguous"
    return None


@torch.no_grad()
def adam_step(
    ops: Any, optimizer: Optimizer, model_of: dict[int, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """One Adam/AdamW step of ``optimizer`` (over FP32 masters) that also writes each updated
    master, rounded, into its model parameter (``model_of[id(master)]``; masters that are
    their own parameter are absent).

    Returns ``None``, having changed nothing, when a gradient does not suit the kernel
    (sparse, not FP32, not contiguous: a hook may have replaced it); the caller then steps
    the stock way. Otherwise returns the ``(model_param, master)`` pairs it updated but did
    not write into the model (a model parameter that is not contiguous): the caller copies
    those. Initialises the state as ``torch.optim.Adam(fused=True)`` does, so state dicts
    move freely between this step and torch's.
    """
    float32 = torch.float32
    grouped = []  # one look at each parameter's gradient: (group, params, grads)
    for group in optimizer.param_groups:
        params, grads = [], []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse or g.dtype is not float32 or not g.is_contiguous():
                return None
            params.append(p)
            grads.append(g)
        if params:
            grouped.append((group, params, grads))
    unwritten = []
    adamw_default = isinstance(optimizer, torch.optim.AdamW)
    state_of = optimizer.state
    for group, params, grads in grouped:
        exp_avgs, exp_avg_sqs, steps, models = [], [], [], []
        for p in params:
            state = state_of[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            model = model_of.get(id(p))
            if model is not None and not model.is_contiguous():
                unwritten.append((model, p))
                model = None
            models.append(model)
        beta1, beta2 = (float(b) for b in group["betas"])
        ops.adam_step_(
            params, grads, exp_avgs, exp_avg_sqs, steps, models, float(group["lr"]), beta1, beta2,
            float(group["weight_decay"]), float(group["eps"]), bool(group.get("decoupled_weight_decay", adamw_default)),
            bool(group["maximize"]),
        )
    return unwritten
