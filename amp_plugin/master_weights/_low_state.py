"""Optimizer state kept in BF16 between steps and in FP32 during one: what an optimizer's own
``step()`` needs when its per-element state is stored in two bytes.

Per-element state is every floating tensor shaped like its parameter (Adam's moments, SGD's
momentum buffer, RMSprop's ``square_avg``, Adagrad's ``sum``, ...); scalars (``step``,
NAdam's ``mu_product``) stay as the optimizer keeps them. :func:`lift_state` upcasts it before
the step, :func:`lower_state` stores it again after, rounded to nearest or stochastically with a
key per tensor and state name (:func:`~amp_plugin.master_weights._stochastic.state_key`; Adam's two
moments share one hash, ``exp_avg_sq`` taking its low bits). DTensor
state (FSDP2's shards) is rounded on its local shard, with the bits of each element's index in
the whole tensor (``offset``).
"""

from __future__ import annotations

from typing import Any

import torch

from amp_plugin._dtensor import is_dtensor
from amp_plugin.master_weights._stochastic import offset_key, round_stochastic, state_key, state_low_bits

__all__ = ["is_per_element", "lift_state", "lower_state"]


def is_per_element(value: Any, param: torch.Tensor) -> bool:
    """Whether ``value`` is per-element floating state of ``param`` (a tensor shaped like it)."""
    return torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0 and value.shape == param.shape


def lift_state(state: dict[str, Any], param: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Replace ``param``'s per-element ``dtype`` state in ``state`` by FP32 copies; returns the
    stored tensors by name (:func:`lower_state` writes into them again)."""
    kept = {}
    for name, value in list(state.items()):
        if is_per_element(value, param) and value.dtype is dtype:
            kept[name] = value
            state[name] = value.float()
    return kept


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


@torch.no_grad()
def lower_state(
    state: dict[str, Any],
    param: torch.Tensor,
    dtype: torch.dtype,
    kept: dict[str, torch.Tensor],
    key: int | None,
    offset: int = 0,
) -> None:
    """Store ``param``'s per-element FP32 state in ``dtype`` again: into the tensors ``kept`` by
    :func:`lift_state` (new ones for state the step created), rounded stochastically with the key
    of each name under ``key`` (``None``: to nearest); ``offset``: where a shard starts in its
    whole tensor (flat index)."""
    for name, value in list(state.items()):
        if not is_per_element(value, param) or value.dtype is dtype:
            continue
        out = kept.get(name)
        if out is None:
            out = value.to(dtype)  # a DTensor stays one; its local shard is overwritten below when rounding
        elif key is None:
            _local(out).copy_(_local(value))
        if key is not None:
            local_key = offset_key(state_key(key, name), offset)
            round_stochastic(_local(value).float(), _local(out), local_key, low=state_low_bits(name))
        state[name] = out
