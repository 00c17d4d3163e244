"""BF16 masters kept as the BF16 weight plus a 16-bit remainder (``master="bf16_split"``).

The "param remainder" scheme of Apex's and Transformer Engine's fused Adam: the model's BF16
weight is the FP32 master *rounded to nearest*, and a signed 16-bit integer, the difference
between the master's bit pattern and the weight's (shifted up by 16 bits), makes the FP32
value exact. Together they are the master, bit for bit, at 2 bytes per parameter instead of 4.

The rounding is to nearest with ties away from zero (in magnitude), the only tie rule whose
remainder always fits 16 bits: a master exactly halfway between two BF16 numbers whose lower
one (in magnitude) is even gets the upper one, where ``master.to(torch.bfloat16)`` (ties to
even) gives the lower. Everywhere else the weight is ``master.to(torch.bfloat16)``. With Adam's
updates (random low bits) a tie is about one element in 2**17 per step; more often while masters are
still BF16 values and updates have few significant bits (SGD's first steps).

On the bits ``u`` of the master (as uint32): ``low = u & 0xFFFF``, ``weight = (u >> 16) +
(low >> 15)`` (the high half, plus one when the low half is at least half an ulp),
``remainder = low`` read as int16. Back: ``u = (weight << 16) + remainder`` (sign-extended).

These helpers do it with torch ops (any device); the CPU kernel ``adam_step_bf16_`` does the
same in its one pass.
"""

from __future__ import annotations

import torch

__all__ = ["join", "split_into"]


def join(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master: ``(weight_bits << 16) + remainder``, for a BF16 ``weight`` and an int16 ``remainder``."""
    high = (weight.detach().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) << 16
    return (high + remainder.to(torch.int32)).view(torch.float32)


@torch.no_grad()
def split_into(master: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write the FP32 ``master`` rounded to nearest (ties away from zero) into ``weight`` (BF16)
    and the signed difference into ``remainder`` (int16): :func:`join` gives ``master`` back."""
    bits = master.detach().contiguous().view(torch.int32)
    low = bits & 0xFFFF
    high = ((bits >> 16) & 0xFFFF) + (low >> 15)
    weight.view(torch.int16).copy_(high.to(torch.int16))  # int32 -> int16 keeps the low 16 bits
    remainder.copy_(low.to(torch.int16))
