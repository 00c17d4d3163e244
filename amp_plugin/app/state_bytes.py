"""Bytes of training state per parameter, counted from the tensors a run holds.

One accounting for ``amp-gate`` (:mod:`amp_plugin.app.gate`) and ``benchmarks/bench_memory.py``:
every tensor is counted once, by its untyped storage (a DTensor by its local shard), into one of

- ``weights``: the module's parameters and buffers;
- ``grads``: their ``.grad``;
- ``master``: optimizer parameters that are not module parameters (FP32 master copies), and
  whatever else ``MasterWeightOptimizer.master_tensors()`` names (e.g. ``bf16_split``'s
  16-bit remainders);
- ``master_grads``: the masters' ``.grad``;
- ``moments``: every tensor in the optimizer state (AdamW's two moments and its step counters).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["COMPONENTS", "gradient_bytes", "held_grad", "per_parameter", "tally"]

COMPONENTS = ("weights", "grads", "master", "master_grads", "moments")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tally(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes of the distinct storages of each component (see the module docstring).

    Args:
        module: the trained model.
        optimizers: its optimizers (``trainer.optimizers``).

    Returns:
        ``{component: bytes}`` for every name in :data:`COMPONENTS`.
    """
    seen: set[int] = set()
    out = dict.fromkeys(COMPONENTS, 0)

    def add(component: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        storage = _local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return
        seen.add(storage.data_ptr())
        out[component] += storage.nbytes()

    params = list(module.parameters())
    ids = {id(p) for p in params}
    for t in [*params, *module.buffers()]:
        add("weights", t)
    for p in params:
        add("grads", p.grad)
    for opt in optimizers:
        masters = [p for group in opt.param_groups for p in group["params"] if id(p) not in ids]
        for p in masters:
            add("master", p)
        for t in getattr(opt, "master_tensors", list)():  # MasterWeightOptimizer: e.g. bf16_split's remainders
            add("master", t)
        for p in masters:
            add("master_grads", held_grad(p))
        for state in opt.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    add("moments", value)
    return out


def held_grad(t: torch.Tensor) -> torch.Tensor | None:
    """The gradient ``t`` holds now: its own grad slot. A master's ``.grad`` property would make one
    from the model's gradient on reading (what the next step would use), which is not held memory."""
    return _GRAD_SLOT.__get__(t)


_GRAD_SLOT: Any = torch._C.TensorBase.grad


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of one gradient per trainable parameter in the parameter's dtype: what a step holds
    once its backward has run (Lightning frees the gradients between steps, so a finished run
    holds none to count)."""
    return sum(_local(p).numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def per_parameter(module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, Any]:
    """Bytes of training state per parameter of a trained run: ``{"params": N, component: bytes / N,
    ..., "total": ...}``. Gradients, which Lightning frees between steps, count as one per parameter
    in its dtype when none is held (:func:`gradient_bytes`). Under FSDP2, per rank (local shards)."""
    counted = tally(module, optimizers)
    if counted["grads"] == 0:
        counted["grads"] = gradient_bytes(module)
    params = sum(_local(p).numel() for p in module.parameters()) or 1
    per = {c: counted[c] / params for c in COMPONENTS}
    return {"params": params, **{c: round(v, 4) for c, v in per.items()}, "total": round(sum(per.values()), 4)}
