"""Loading optimizer state across master kinds and moment dtypes, and saying what was rounded.

A :meth:`~amp_plugin.MasterWeightOptimizer.state_dict` holds the FP32 values of the masters
whatever the kind, and the moments in the dtype they were stored in. Loading keeps every value
the receiving optimizer can hold exactly (FP32 masters into ``bf16_split``, which holds any FP32
value; BF16 moments into FP32 ones) and rounds to nearest what it cannot (FP32 moments into
BF16 ones; FP32 masters into ``stochastic``, which keeps only the BF16 weight), with one
:class:`MasterRoundingWarning` naming what was rounded.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["MasterRoundingWarning", "restore_moments", "warn_rounded"]


class MasterRoundingWarning(UserWarning):
    """A loaded state dict held values this optimizer stores in fewer bits: they were rounded."""


def restore_moments(
    optimizer: Optimizer, state_dict: dict[str, Any], half_masters: set[int], moments_dtype: torch.dtype
) -> set[str]:
    """torch's ``load_state_dict`` casts floating state to each parameter's dtype (FP32 for a
    master): take the per-element state of the half-precision parameters' masters (``id``s in
    ``half_masters``) again from ``state_dict``, in ``moments_dtype``. Returns ``{"moments"}``
    when some value was not representable there (rounded to nearest), else an empty set."""
    rounded: set[str] = set()
    saved_state = state_dict.get("state", {})
    for group, saved_group in zip(optimizer.param_groups, state_dict.get("param_groups", [])):
        for p, index in zip(group["params"], saved_group["params"]):
            if id(p) not in half_masters or index not in saved_state:
                continue
            state = optimizer.state[p]
            for key, value in saved_state[index].items():
                if key == "step" or not torch.is_tensor(value) or not value.is_floating_point():
                    continue
                if value.shape != p.shape or value.dim() == 0:
                    continue
                stored = value.to(device=p.device, dtype=moments_dtype, copy=True).contiguous()
                if value.dtype != moments_dtype and not torch.equal(stored.to(value.dtype), value.to(p.device)):
                    rounded.add("moments")
                state[key] = stored
    return rounded


def warn_rounded(rounded: set[str], master: str, moments_dtype: torch.dtype) -> None:
    """One warning naming what :meth:`load_state_dict` rounded (nothing when ``rounded`` is empty)."""
    parts = []
    if "moments" in rounded:
        parts.append(f"Adam's FP32 moments were rounded to {str(moments_dtype).replace('torch.', '')}")
    if "master values" in rounded:
        parts.append(
            f"the FP32 master values were rounded to the BF16 weights (master={master!r} keeps no FP32 master)"
        )
    if parts:
        warnings.warn(
            "Loading the optimizer state: " + "; ".join(parts) + ". Training continues from the rounded values.",
            MasterRoundingWarning,
            stacklevel=3,
        )
