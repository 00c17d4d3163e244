"""The probe of ``fused="compiled"`` (:func:`amp_plugin.master_weights._compiled.available`): the compiled
stores, join and gradients' upcast run once on small tensors, before a step changes anything, and are checked
against the torch ops of ``_split.py``, ``_stochastic.py`` and ``_grads.py``."""

from __future__ import annotations

import torch

from amp_plugin.master_weights import _split
from amp_plugin.master_weights._grads import eager_unscale
from amp_plugin.master_weights._stochastic import round_stochastic

__all__ = ["probe"]

L = list[torch.Tensor]


def probe(device: torch.device) -> None:
    """Compile the stores, the join and the gradients' upcast on a tensor of 80 elements (in pairs, on the CPU)
    and one of 81 (one element per lane), past two of the widest vectors (32 BF16 values with AVX-512) with a
    tail, and check them against the torch ops."""
    from amp_plugin.master_weights._compiled import join, keys_tensor, prepare, store  # which imports this module

    gen = torch.Generator().manual_seed(0)
    sizes = (80, 81)
    value = [torch.randn(n, generator=gen).to(device) for n in sizes]
    weight, m16, v16 = ([torch.empty(n, dtype=torch.bfloat16, device=device) for n in sizes] for _ in range(3))
    remainder = [torch.empty(n, dtype=torch.int16, device=device) for n in sizes]
    abs_value = [v.abs() for v in value]
    keys = keys_tensor([(1, 2), (3, 4)], device)
    for rem in (remainder, None):
        store(value, weight, rem, (value, abs_value, m16, v16), keys, True)
    for i, moments_key in enumerate((2, 4)):
        expected = torch.empty_like(weight[i])
        round_stochastic(abs_value[i], expected, moments_key, low=True)
        if not torch.equal(v16[i].view(torch.int16), expected.view(torch.int16)):
            raise RuntimeError("the compiled store rounds otherwise than the torch ops")
        _split.split_into(value[i], weight[i], remainder[i])
        if not torch.equal(join(weight[i], remainder[i]), value[i]):
            raise RuntimeError("the compiled join does not give the master back")
    grads = [v.to(torch.bfloat16) for v in value]
    for inv in (None, torch.full((1,), 2.0**-7 * 3, device=device)):
        made: L = prepare(None, None, (m16, v16), grads, inv)[3] or []
        expected_grads = eager_unscale(grads, inv, None)
        if len(made) != len(grads) or not all(torch.equal(a, b) for a, b in zip(made, expected_grads)):
            raise RuntimeError("the compiled upcast of the gradients differs from torch's")
