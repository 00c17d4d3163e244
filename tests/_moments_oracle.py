"""The oracle of BF16 moment storage, shared by the master-weight and FSDP2-moment tests: FP32 moments
computed by torch's fused kernel, then stored in BF16 by an independent rule."""

from __future__ import annotations

import torch

from amp_plugin.master_weights import SRGenerator, moments_key, round_stochastic

BF16 = torch.bfloat16


class MomentStore:
    """Rounds FP32 moments into BF16 per step: to nearest (``seed=None``), or stochastically with
    the keys a wrapper seeded with ``seed`` draws (one key per step and BF16-moment tensor; one hash
    per element for both moments: ``exp_avg`` takes its high 16 bits, ``exp_avg_sq`` its low 16)."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = None if seed is None else SRGenerator(seed)
        self.keys: list[int] = []

    def next_step(self, count: int) -> None:
        if self.generator is not None:
            self.keys = self.generator.keys(list(range(count)))

    def store(self, m: torch.Tensor, v: torch.Tensor, index: int) -> None:
        """Replace FP32 ``m`` and ``v`` (tensor ``index`` among the BF16-moment ones) by their stored values."""
        if self.generator is None:
            m.copy_(m.to(BF16))
            v.copy_(v.to(BF16))
            return
        key = moments_key(self.keys[index])
        for value, low in ((m, False), (v, True)):
            out = torch.empty(value.shape, dtype=BF16)
            round_stochastic(value, out, key, low=low)
            value.copy_(out)


def on_a_bf16_neighbour(rounded: torch.Tensor, exact: torch.Tensor) -> bool:
    """Whether each element of ``rounded`` is one of the two BF16 numbers around the FP32 ``exact``
    (toward zero, or one ulp away from it): what a stochastic rounding may give."""
    toward_zero = (exact.float().view(torch.int32) & -65536).view(torch.float32)
    away = (toward_zero.view(torch.int32) + 65536).view(torch.float32)
    return bool(((rounded.float() == toward_zero) | (rounded.float() == away)).all())
