"""Unscaling gradients with torch's fused inf check, and measuring their amax on the way.

Everything here stays on the device: the found-inf flags and the amax are 0-dim float32
tensors, one per device, which a loss scaler reads on the host once per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from amp_plugin._dtensor import is_dtensor

__all__ = ["InvScaleOn", "ones", "record_amax", "unscale_grouped", "unscale_in_place"]

InvScaleOn = Callable[[torch.device], torch.Tensor]
"""Returns the factor (``1 / scale``, a 0-dim float32 tensor) to unscale with on a device."""


def ones(device: torch.device) -> torch.Tensor:
    """An ``InvScaleOn`` of 1: the inf check without unscaling."""
    return torch.ones((), dtype=torch.float32, device=device)


def unscale_in_place(
    optimizer: torch.optim.Optimizer, inv_scale_on: InvScaleOn, amax: dict[torch.device, torch.Tensor] | None = None
) -> dict[torch.device, torch.Tensor]:
    """Unscale every gradient of ``optimizer`` in place with torch's fused inf check.

    A sparse float16 gradient is coalesced first (duplicates summed, in float16, as
    ``torch.amp.GradScaler`` does) and its values unscaled. A DTensor gradient (FSDP2) is
    unscaled on this rank's shard, with no collective: the scaler max-reduces the found-inf
    flag across ranks once. With ``amax`` given, the gradients' largest magnitude before
    unscaling is folded into it (see :func:`record_amax`).

    Returns:
        One found-inf flag per device.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if is_dtensor(g):
                g = g.to_local()
                if g.numel() == 0:  # this rank holds no shard of a small parameter
                    continue
            if g.is_sparse:
                if g.dtype is torch.float16:
                    p.grad = g = g.coalesce()
                g = g._values()
            groups.setdefault((g.device, g.dtype), []).append(g)
    return unscale_grouped(groups, inv_scale_on, amax=amax)


def unscale_grouped(
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]],
    inv_scale_on: InvScaleOn,
    found: dict[torch.device, torch.Tensor] | None = None,
    amax: dict[torch.device, torch.Tensor] | None = None,
) -> dict[torch.device, torch.Tensor]:
    """Run ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group,
    adding to ``found`` (one flag per device, made as needed) and returning it. With ``amax``
    given, each group's largest magnitude is folded into it first (still scaled)."""
    if found is None:
        found = {}
    for (device, _), grads in groups.items():
        if amax is not None:
            _fold_amax(amax, device, grads)
        if device not in found:
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv_scale_on(device))
    return found


def record_amax(tensors: Iterable[torch.Tensor], amax: dict[torch.device, torch.Tensor]) -> None:
    """Fold the largest magnitude of ``tensors`` into ``amax`` (a 0-dim float32 tensor per
    device, made as needed), with torch's multi-tensor norm (``ord=inf``); no host sync.

    A sparse tensor counts its values, a DTensor this rank's shard. An inf or NaN anywhere
    makes the device's amax inf or NaN (the step overflowed anyway).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if is_dtensor(t):
            t = t.to_local()
        if t.is_sparse:
            t = t._values()
        if t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), grads in groups.items():
        _fold_amax(amax, device, grads)


def _fold_amax(amax: dict[torch.device, torch.Tensor], device: torch.device, grads: list[torch.Tensor]) -> None:
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return
    norms = torch._foreach_norm(grads, math.inf)
    largest = (norms[0] if len(norms) == 1 else torch.stack(norms).max()).float()
    previous = amax.get(device)
    amax[device] = largest if previous is None else torch.maximum(previous, largest)
