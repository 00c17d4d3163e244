"""BF16 masters split in two halves (``MasterWeightOptimizer(..., master="bf16_split")``).

An FP32 number's high 16 bits are a BF16 number: the FP32 value truncated toward zero to
BF16's 8 mantissa bits. So an FP32 master can live as the model's BF16 weight (its high
half) plus a 16-bit extension (its low half): together they are the FP32 master, bit for
bit, and the master costs 2 bytes per parameter instead of 4. The update reads both halves,
computes the FP32 step, and writes both halves back.

What differs from an FP32 master: the model's weight is the master *truncated*, not rounded
to the nearest BF16 as the FP32-master path writes it. Truncation moves every weight toward
zero by less than one BF16 ulp (on average half an ulp, about 0.2% of its magnitude), a
bias that rounding does not have (rounding errs by at most half an ulp, either way). The
masters themselves, and so the optimizer's trajectory given the same gradients, are those of
an FP32 master; the forward pass sees slightly different (smaller-magnitude) weights.

Measured on this project's recipes (``benchmarks/bench_split_master.py``: the ``bf16``
preset with and without ``master="bf16_split"``, 300 steps, 6 seeds, paired by seed) the
effect is within seed noise: ``char_gpt`` validation loss +0.013 +- 0.023 (about 0.6%),
``digits`` validation accuracy -0.001 +- 0.003.

These helpers do it with torch ops (any device); the CPU kernel ``adam_step_split_`` does
the same in one pass.
"""

from __future__ import annotations

import torch

__all__ = ["join", "split_into", "step_with_torch_ops"]


def join(weight: torch.Tensor, low_bits: torch.Tensor) -> torch.Tensor:
    """The FP32 master: ``weight`` (BF16) as the high 16 bits, ``low_bits`` (int16) as the low."""
    high = weight.view(torch.int16).to(torch.int32) << 16
    return (high | (low_bits.to(torch.int32) & 0xFFFF)).view(torch.float32)


@torch.no_grad()
def split_into(master: torch.Tensor, weight: torch.Tensor, low_bits: torch.Tensor) -> None:
    """Write the FP32 ``master``'s high 16 bits into ``weight`` (BF16: the master truncated)
    and its low 16 bits into ``low_bits`` (int16)."""
    bits = master.detach().contiguous().view(torch.int32)
    weight.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    low_bits.copy_(bits.to(torch.int16))  # the low 16 bits, two's complement


@torch.no_grad()
def step_with_torch_ops(optimizer: torch.optim.Optimizer, low_bits_of: dict[int, torch.Tensor]) -> None:
    """One step of ``optimizer`` (Adam/AdamW; BF16 parameters split with ``low_bits_of``)
    with torch's fused Adam kernel on FP32 masters joined for the step, then split back:
    the reference for the CPU kernel, and the path for tensors it cannot take."""
    from amp_plugin.fused.adam import (  # the same state layout and hyperparameters
        _hyper,
        _state,
    )

    adamw_default = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        lr, beta1, beta2, weight_decay, eps, decoupled, maximize = _hyper(group, adamw_default)
        entries = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("master='bf16_split' steps Adam/AdamW, which does not take sparse gradients")
            low = low_bits_of.get(id(p))
            master = join(p, low) if low is not None else p
            entries.append((p, low, master, g.float() if g.dtype is not torch.float32 else g, _state(optimizer, p)))
        by_device: dict[torch.device, list] = {}
        for entry in entries:
            by_device.setdefault(entry[2].device, []).append(entry)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        for items in by_device.values():
            steps = [state["step"] for *_, state in items]
            torch._foreach_add_(steps, 1)
            kernel(
                [m for _, _, m, _, _ in items],
                [g for _, _, _, g, _ in items],
                [state["exp_avg"] for *_, state in items],
                [state["exp_avg_sq"] for *_, state in items],
                [],
                steps,
                amsgrad=False,
                lr=lr,
                beta1=beta1,
                beta2=beta2,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
                grad_scale=None,
                found_inf=None,
            )
        for p, low, master, _, _ in entries:
            if low is not None:
                split_into(master, p, low)
