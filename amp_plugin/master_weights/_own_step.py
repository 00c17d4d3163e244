"""The wrapped optimizer's own ``step()`` over FP32 values, for every master kind and moments dtype.

This is the general path: any ``torch.optim.Optimizer`` (SGD with momentum or nesterov, RMSprop,
Adagrad, Adam(W) with ``foreach``, a user's subclass) steps the exact FP32 values of the masters,
so ``master="bf16_split"`` follows that optimizer on FP32 copies bit for bit. Around the step:

1. the kinds without an FP32 tensor put the FP32 value of each stepped parameter in its
   placeholder master's ``.data`` (the weight joined with its remainder, or the weight upcast),
   so the optimizer, whose state is keyed by the placeholder, updates it in place;
2. BF16 per-element state (Adam's moments, SGD's momentum buffer, RMSprop's ``square_avg``,
   Adagrad's ``sum``, ...: every floating tensor shaped like the parameter) is upcast to FP32;
3. after the step, each kind stores the stepped value its way (split, or rounded
   stochastically) and the placeholders get their (4-byte) data back; the per-element state is
   stored in BF16 again, rounded as the wrapper's ``moments_rounding`` says, each tensor with
   its own key (:func:`~amp_plugin.master_weights._stochastic.state_key`: Adam's moments get the
   fused kernels' keys, so the paths agree bit for bit where their arithmetic does).

The FP32 copies live for the step (4 bytes per stepped parameter, plus 4 per BF16 state tensor);
between steps the state is what the kind and ``moments_dtype`` say. The fused kernels stay the
fast path for Adam/AdamW (``_kernels.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from amp_plugin.master_weights._low_state import lift_state, lower_state

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = ["own_step"]


@torch.no_grad()
def own_step(
    opt: MasterWeightOptimizer, grads: list[torch.Tensor | None], keys: list[int], step: Callable[[], Any]
) -> Any:
    """Run ``step`` (the wrapped optimizer's ``step``) with the FP32 values and FP32 state of the
    half-precision parameters whose ``grads`` are not ``None`` in place, then store them as the
    master kind and ``opt.moments_dtype`` keep them (``keys``: this step's rounding keys by index).
    The masters' gradients must already be set. Returns what ``step`` returned."""
    kind, masters, models, records = opt._kind, opt._half_masters, opt._half_models, opt._records
    stepped = [i for i, g in enumerate(grads) if g is not None]
    lean = not kind.has_fp32_tensor
    low = opt.moments_dtype is not torch.float32
    placeholders: dict[int, torch.Tensor] = {}
    kept: dict[int, dict[str, torch.Tensor]] = {}  # the BF16 state tensors, written into again
    try:
        for i in stepped:
            if lean:
                placeholders[i] = masters[i].data
                masters[i].data = kind.step_value(models[i], records[i])
            if low:
                kept[i] = lift_state(opt.optimizer.state[masters[i]], masters[i], opt.moments_dtype)
        result = step()
        for i in placeholders:
            kind.store(models[i], records[i], masters[i].data, keys[i])
    finally:
        for i, placeholder in placeholders.items():
            masters[i].data = placeholder
        for i in kept:
            state = opt.optimizer.state[masters[i]]
            lower_state(state, masters[i], opt.moments_dtype, kept[i], keys[i] if opt.sr_moments else None)
    return result
