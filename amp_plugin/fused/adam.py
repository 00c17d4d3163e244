"""The fused passes of the master-weight step, driven from Python.

:func:`nonfinite_check` is the inf/NaN check of the step decision: it only reads the
half-precision gradients (2 bytes per element). :func:`adam_step` replaces "copy the half
gradients to FP32, unscale them, ``Adam(fused=True).step()``, copy the masters back into the
model" with one pass per tensor: it reads the half gradient and multiplies it by the unscale
factor as it goes (or reads an FP32 gradient where one was materialized), updates the
master and its moments, and writes the rounded weight into the model.
:func:`bf16_adam_step` is the same update for a BF16 model without FP32 master tensors: the
weight plus a 16-bit remainder (``master="bf16_split"``), or the weight alone, written back
with stochastic rounding (``master="stochastic"``). Adam's moments may be stored in BF16
(computed in FP32, rounded once when stored: stochastically by default, see
:mod:`amp_plugin.master_weights._stochastic`, or to nearest) on every path. :func:`unscale_into`
writes ``half * inv_scale`` into FP32 buffers (for gradients that must be materialized).
:func:`adam_ineligible` says why an optimizer cannot take the fused step (``None`` when it can).

Exactness. ``adam_step`` computes torch's fused CPU Adam/AdamW update bit for bit on every
element: torch runs that kernel 8 floats at a time (``Vectorized<float>`` of its AVX2 build,
which an AVX512 CPU runs too) with fused multiply-adds, and finishes the last ``numel % 8``
elements of each tensor with a scalar loop that fuses one product of the ``exp_avg_sq``
update differently (``fma(exp_avg_sq, beta2, ((1 - beta2) * g) * g)`` instead of
``fma((1 - beta2) * g, g, exp_avg_sq * beta2)``); ``adam_step`` reproduces both, at any
vector width. A half gradient read with the factor ``s`` gives the bits of the FP32 gradient
``half.float() * s`` (what copy-then-unscale stores). Checked against torch 2.13's x86-64
build for numels 1 to 40 and large ones, Adam and AdamW, with and without weight decay,
``maximize``, and both branches of the ``exp_avg`` lerp. A torch build compiled with other
contractions (another compiler, ``-ffp-contract``, a non-x86 CPU) may differ from it in the
last bit on some elements.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin.adam_rule import init_state
from amp_plugin.dtypes import HALF_DTYPES

__all__ = [
    "adam_ineligible",
    "adam_step",
    "bf16_adam_step",
    "has_step_hooks",
    "nonfinite_check",
    "unscale_fits",
    "unscale_into",
]


def unscale_fits(half_grads: list[torch.Tensor], out: list[torch.Tensor]) -> bool:
    """Whether :func:`unscale_into` can take these tensors (dense, contiguous, on the CPU)."""
    return all(t.device.type == "cpu" and t.is_contiguous() and not t.is_sparse for t in (*half_grads, *out))


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernel_grad(grad: torch.Tensor) -> bool:
    """Whether the kernels read this gradient directly: dense, contiguous, on the CPU, FP16/BF16/FP32."""
    return grad.is_cpu and not grad.is_sparse and grad.dtype in _KERNEL_DTYPES and grad.is_contiguous()


def unscale_into(
    ops: Any, half_grads: list[torch.Tensor], out: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``out[i] = half_grads[i].float() * inv_scale`` and the inf check (``found_inf`` set to 1
    on any inf/NaN, never cleared), one pass per tensor. The tensors must be dense,
    contiguous CPU tensors (:func:`unscale_fits`)."""
    ops.unscale_into_(half_grads, out, found_inf, inv_scale.float())


def nonfinite_check(ops: Any, half_grads: list[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Set ``found_inf`` to 1 if any element of the (dense, contiguous, CPU, FP16/BF16)
    ``half_grads`` is inf or NaN; never clears it. Reads the gradients only.

    Checking the half gradient is the check torch's unscale makes: it tests each value
    before multiplying it by the unscale factor."""
    ops.nonfinite_check_(half_grads, found_inf)


def has_step_hooks(optimizer: Optimizer) -> bool:
    """The optimizer's own step hooks, which the fused step would bypass."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks)


def adam_ineligible(optimizer: Optimizer, masters_to_come: bool = False, device_type: str | None = "cpu") -> str | None:
    """Why ``optimizer`` (its type, options and parameters) cannot take a fused
    master-weight Adam step, or ``None`` if it can. Step hooks are checked apart
    (:func:`has_step_hooks`): they can come and go between steps.

    ``masters_to_come``: the optimizer is not wrapped yet; its FP16/BF16 parameters count as
    the contiguous FP32 masters that will replace them. ``device_type``: the device the
    parameters must be on (``"cpu"`` for amp_plugin's kernels; ``None``: any, for torch's).
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"the fused step implements Adam and AdamW only, not {type(optimizer).__name__}"
    for group in optimizer.param_groups:
        for key in ("amsgrad", "capturable", "differentiable"):
            if group.get(key):
                return f"{key}=True is not supported by the fused step"
        for p in group["params"]:
            if device_type is not None and p.device.type != device_type:
                return f"the fused step needs its parameters on the {device_type.upper()}"
            if (masters_to_come and p.dtype in HALF_DTYPES) or hasattr(p, "_amp_model"):
                continue  # a master to come, or one made by MasterWeightOptimizer (its kind's layout)
            if p.dtype != torch.float32 or not p.is_contiguous():
                return "the fused step needs FP32 parameters (kept as their own master) to be contiguous"
    return None


def _hyper(group: dict[str, Any], adamw_default: bool) -> tuple:
    beta1, beta2 = (float(b) for b in group["betas"])
    return (
        float(group["lr"]),
        beta1,
        beta2,
        float(group["weight_decay"]),
        float(group["eps"]),
        bool(group.get("decoupled_weight_decay", adamw_default)),
        bool(group["maximize"]),
    )


@torch.no_grad()
def adam_step(
    ops: Any,
    optimizer: Optimizer,
    grads: list[torch.Tensor | None],
    index_of: dict[int, int],
    models: list[torch.Tensor],
    inv_scale: float = 1.0,
    moments_dtype: torch.dtype = torch.float32,
    moment_keys: list[int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """One Adam/AdamW step of ``optimizer`` (over FP32 masters) that also writes each updated
    master, rounded, into its model parameter.

    ``index_of[id(master)]`` is a half-precision parameter's position in ``grads`` and
    ``models`` (masters that are their own parameter are absent: they use their ``.grad``).
    ``grads[i]`` is an FP32 gradient (used as it is) or the model's FP16/BF16 gradient
    (multiplied by ``inv_scale`` as it is read); ``None``: not stepped. Returns ``None``,
    having stepped nothing, when a gradient does not suit the kernel (sparse, not contiguous,
    another dtype: a hook may have replaced it); the caller then steps the stock way.
    Otherwise returns the ``(model_param, master)`` pairs it updated but did not write into
    the model (a model parameter that is not contiguous): the caller copies those.
    Initialises the state as ``torch.optim.Adam(fused=True)`` does. ``moment_keys`` (by index):
    BF16 moments rounded stochastically with these keys (``None``: to nearest).
    """
    calls = []  # one look at each parameter's gradient and state, then the kernel per group
    adamw_default = isinstance(optimizer, torch.optim.AdamW)
    state_of = optimizer.state
    unwritten = []
    float32 = torch.float32
    for group in optimizer.param_groups:
        params, group_grads, exp_avgs, exp_avg_sqs, steps, group_models = [], [], [], [], [], []
        keys: list[int] = []
        for p in group["params"]:
            i = index_of.get(id(p))
            g = p.grad if i is None else grads[i]
            if g is None:
                continue
            if not kernel_grad(g) or (i is None and g.dtype is not float32):
                return None
            state = state_of[p]
            if not state:
                state = init_state(optimizer, p, moments_dtype if i is not None else torch.float32)
            params.append(p)
            group_grads.append(g)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            if moment_keys is not None:
                keys.append(0 if i is None else moment_keys[i])  # FP32 parameters: FP32 moments, no rounding
            model = None if i is None else models[i]
            if model is not None and not model.is_contiguous():
                unwritten.append((model, p))
                model = None
            group_models.append(model)
        if params:
            calls.append(
                (params, group_grads, exp_avgs, exp_avg_sqs, steps, group_models, _hyper(group, adamw_default), keys)
            )
    for params, group_grads, exp_avgs, exp_avg_sqs, steps, group_models, hyper, keys in calls:
        ops.adam_step_(params, group_grads, exp_avgs, exp_avg_sqs, steps, group_models, *hyper, float(inv_scale), keys)
    return unwritten


@torch.no_grad()
def bf16_adam_step(
    ops: Any,
    optimizer: Optimizer,
    grads: list[torch.Tensor | None],
    index_of: dict[int, int],
    models: list[torch.Tensor],
    remainders: list[torch.Tensor | None],
    keys: list[int],
    inv_scale: float = 1.0,
    moments_dtype: torch.dtype = torch.float32,
    sr_moments: bool = False,
) -> bool:
    """One Adam/AdamW step of ``optimizer`` whose half-precision parameters have no FP32 master
    tensor: ``models[i]`` (BF16) with ``remainders[i]`` (int16: ``master="bf16_split"``) or
    without (``None``: stochastic rounding keyed by ``keys[i]``). ``index_of``, ``grads`` and
    ``inv_scale`` as for :func:`adam_step`; FP32 parameters (their own master) take the plain
    fused step with FP32 moments. ``sr_moments``: BF16 moments rounded stochastically, with the
    moment keys derived from ``keys[i]`` (otherwise to nearest).

    Returns ``False``, having changed nothing, when a parameter or gradient does not suit the
    kernel (not contiguous, not on the CPU, sparse); the caller then takes the torch-ops step.
    """
    grouped = []
    for group in optimizer.param_groups:
        lean: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        plain: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in group["params"]:
            i = index_of.get(id(p))
            g = p.grad if i is None else grads[i]
            if g is None:
                continue
            if not kernel_grad(g):
                return False
            if i is None:
                if g.dtype is not torch.float32 or not p.is_contiguous() or not p.is_cpu:
                    return False
                plain.append((p, g))
            else:
                model = models[i]
                if not model.is_contiguous() or not model.is_cpu:
                    return False
                lean.append((p, g, i))
        if lean or plain:
            grouped.append((group, lean, plain))
    adamw_default = isinstance(optimizer, torch.optim.AdamW)
    for group, lean, plain in grouped:
        hyper = _hyper(group, adamw_default)
        if lean:
            states = [init_state(optimizer, p, moments_dtype) for p, _, _ in lean]
            ops.adam_step_bf16_(
                [models[i] for _, _, i in lean],
                [remainders[i] for _, _, i in lean],
                [g for _, g, _ in lean],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states],
                [keys[i] for _, _, i in lean],
                *hyper,
                float(inv_scale),
                [keys[i] for _, _, i in lean] if sr_moments else [],
            )
        if plain:
            states = [init_state(optimizer, p) for p, _ in plain]
            ops.adam_step_(
                [p for p, _ in plain],
                [g for _, g in plain],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states],
                [None] * len(plain),
                *hyper,
                float(inv_scale),
            )
    return True
