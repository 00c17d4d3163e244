"""What a fused implementation of the lean step's bit handling provides (:mod:`._compiled`, :mod:`._triton`).

The multi-tensor step (``_multi_tensor.py``) runs torch's fused Adam on FP32 values: ``prepare``
builds them from the lean kinds' BF16 weights (joined with their remainders) and BF16 moments
(and, in the Triton kernels, the FP32 gradients from the model's half ones),
``store`` writes the stepped values back (split, or rounded stochastically) and rounds the
moments into their BF16 tensors, both with the bits of the torch ops in ``_split.py`` and
``_stochastic.py``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Passes", "half_grads_dtype"]

L = list[torch.Tensor]


def half_grads_dtype(grads: L | None, inv: torch.Tensor | None) -> torch.dtype | None:
    """The dtype of ``grads`` (dense, of one device) when a prepare can make their FP32 copies times ``inv``:
    FP16 or BF16, one dtype for all, and ``inv`` ``None`` or one FP32 value on their device; else ``None``
    (the caller makes them with torch's ops)."""
    if not grads or len({g.dtype for g in grads}) != 1 or grads[0].dtype not in (torch.float16, torch.bfloat16):
        return None
    if inv is not None and (inv.dtype is not torch.float32 or inv.numel() != 1 or inv.device != grads[0].device):
        return None
    return grads[0].dtype


class Passes(Protocol):
    def prepare(
        self,
        weights: L | None,
        remainders: L | None,
        moments: tuple[L, L] | None,
        grads: L | None = None,
        inv: torch.Tensor | None = None,
    ) -> tuple[L | None, L | None, L | None, L | None]:
        """The FP32 values of ``weights`` (joined with ``remainders``; ``None``: FP32 masters) and of
        the BF16 ``moments`` ``(m16s, v16s)`` (``None``: FP32 moments), tensors of one device; and
        the FP32 copies of the half ``grads`` times ``inv`` (``None``: not scaled), the bits of
        ``_grads.eager_unscale``, where the passes make them (``None``: the caller does)."""
        ...

    def keys_tensor(self, keys: list[tuple[int, int]], device: torch.device) -> Any:
        """The (weight, moments) rounding keys of each tensor, as ``store`` takes them."""
        ...

    def store(
        self,
        values: L,
        weights: L | None,
        remainders: L | None,
        moments: tuple[L, L, L, L] | None,
        keys: Any,
        stochastic_moments: bool,
    ) -> None:
        """Write the stepped FP32 ``values`` into ``weights`` (split with ``remainders``, or rounded
        stochastically) and ``moments`` ``(m32s, v32s, m16s, v16s)`` into their BF16 tensors."""
        ...

    def available(self, device: torch.device, strict: bool) -> bool:
        """Whether they run on ``device`` (a failure warns once; ``strict``: raises)."""
        ...
