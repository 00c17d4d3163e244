"""The master-weight Adam/AdamW step with torch's multi-tensor kernels, on any device.

This is the path for CUDA (and any non-CPU) tensors, and, forced with ``fused="torch"``,
on the CPU. Per device, whatever the number of parameters:

1. unscale (``scaler.unscale_``): ``torch._foreach_copy_`` of the half gradients into FP32
   views of one new flat buffer, then ``torch._amp_foreach_non_finite_check_and_unscale_``
   on them (the unscale and the inf check);
2. the skip decision: the scaler reads the found-inf flag (the one host sync);
3. ``torch._foreach_add_`` on the step counters and ``torch._fused_adam_``/``_fused_adamw_``
   on the FP32 masters (what ``torch.optim.Adam(fused=True).step()`` runs, so the masters get
   the same bits), with the hyperparameters as the group holds them (a tensor ``lr`` stays
   on its device);
4. ``torch._foreach_copy_`` of the masters into the half-precision model parameters.

The flat gradient buffer is dropped when the step ends. Python only gathers references
(the gradients, the state tensors) into lists: no per-parameter tensor op, no host sync.

torch's fused Adam takes a ``grad_scale`` to unscale on the fly, but only for gradients of
the parameters' own dtype (FP32 here), and it divides by the scale where the unscale
multiplies by its reciprocal (different bits unless the scale is a power of two): the copy
into FP32 is needed anyway, so the unscale happens there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin.fused.adam import _state

__all__ = ["torch_adam_step"]


@torch.no_grad()
def torch_adam_step(optimizer: Optimizer, grad_of: dict[int, torch.Tensor], model_of: dict[int, torch.Tensor]) -> list[
        tuple[torch.Tensor, torch.Tensor]]:
    """One Adam/AdamW step of ``optimizer`` over FP32 masters with torch's fused kernel.

    ``grad_of[id(master)]``: the FP32 gradient of each half-precision parameter's master to
    step (absent: not stepped); parameters that are their own master use their ``.grad``.
    Returns the ``(model_param, master)`` pairs stepped, for the caller's multi-tensor copy
    into the model. State is initialised as ``torch.optim.Adam(fused=True)`` does.
    """
    adamw_default = isinstance(optimizer, torch.optim.AdamW)
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    for group in optimizer.param_groups:
        params = [p for p in group["params"] if (grad_of.get(id(p)) if id(p) in model_of else p.grad) is not None]
        if not params:
            continue
        grads = [grad_of[id(p)] if id(p) in model_of else p.grad for p in params]
        states = [_state(optimizer, p) for p in params]
        grouped = Optimizer._group_tensors_by_device_and_dtype([  # one C++ call, as torch's fused Adam
            params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states]])
        beta1, beta2 = group["betas"]
        decoupled = bool(group.get("decoupled_weight_decay", adamw_default))
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        lr = group["lr"]
        for (device, _), ((d_params, d_grads, d_exp_avgs, d_exp_avg_sqs, d_steps), _) in grouped.items():
            torch._foreach_add_(d_steps, 1)
            # as torch's fused Adam: a tensor lr moves to a CUDA device, a CPU one stays
            d_lr: Any = lr.to(device) if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" \
                and lr.device != device else lr
            kernel(d_params, d_grads, d_exp_avgs, d_exp_avg_sqs, [], d_steps, amsgrad=False, lr=d_lr,
                   beta1=_scalar(beta1), beta2=_scalar(beta2), weight_decay=group["weight_decay"], eps=group["eps"],
                   maximize=group["maximize"], grad_scale=None, found_inf=None)
        written += [(model_of[id(p)], p) for p in params if id(p) in model_of]
    return written


def _scalar(value: Any) -> float:
    return value.item() if isinstance(value, torch.Tensor) else float(value)
