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
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from amp_plugin.master_weights._grads import end_session
from amp_plugin.master_weights._stochastic import SRGenerator

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = [
    "MasterRoundingWarning",
    "check_loadable",
    "load_state_dict",
    "restore_moments",
    "state_dict",
    "warn_rounded",
]


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
        parts.append(f"the FP32 masters were rounded to the BF16 weights (master={master!r} keeps no FP32 master)")
    if parts:
        warnings.warn(
            "Loading the optimizer state: " + "; ".join(parts) + ". Training continues from the rounded values.",
            MasterRoundingWarning,
            stacklevel=4,  # the caller of MasterWeightOptimizer.load_state_dict
        )


def state_dict(opt: MasterWeightOptimizer) -> dict[str, Any]:
    """What :meth:`~amp_plugin.MasterWeightOptimizer.state_dict` returns."""
    opt._refresh_masters()
    state = opt.optimizer.state_dict()
    state["master_params"] = opt.fp32_masters()
    state["master_kind"] = opt.master
    if opt._sr is not None:
        state["sr_generator"] = opt._sr.state_dict()
    return state


def load_state_dict(opt: MasterWeightOptimizer, state_dict: dict[str, Any]) -> None:
    """What :meth:`~amp_plugin.MasterWeightOptimizer.load_state_dict` does. What this module checks
    (the masters, the kind, the rounding's generator) and what the wrapped optimizer's
    ``load_state_dict`` checks (the groups and their sizes) is checked before anything changes."""
    state_dict = dict(state_dict)
    masters = state_dict.pop("master_params", None)
    kind = state_dict.pop("master_kind", None)
    generator = state_dict.pop("sr_generator", None)
    check_loadable(opt, masters, kind)
    if generator is not None and opt._sr is not None:
        SRGenerator.values_of(generator)
    end_session(opt)
    opt.optimizer.load_state_dict(state_dict)
    rounded = restore_moments(opt.optimizer, state_dict, set(opt._index_of), opt.moments_dtype)
    if masters is None:
        opt.sync_masters()
    else:
        with torch.no_grad():
            for model_p, record, saved in zip(opt._half_models, opt._records, masters):
                if opt._kind.load(model_p, record, saved):
                    rounded.add("master values")
                record.version, record.ptr = model_p._version, model_p.data_ptr()
    if generator is not None and opt._sr is not None:
        opt._sr.load_state_dict(generator)
    warn_rounded(rounded, opt.master, opt.moments_dtype)


def check_loadable(opt: MasterWeightOptimizer, masters: Any, kind: Any) -> None:
    """A ``ValueError`` naming the key, the value and what fits, for a ``master_params`` that is not one
    floating-point tensor per half-precision parameter, shaped like it, or a ``master_kind`` no kind has."""
    from amp_plugin.master_weights._kinds import KINDS

    if kind is not None and kind not in KINDS:
        raise ValueError(f"master_kind={kind!r} is not allowed: it must be one of {sorted(KINDS)}.")
    if masters is None:
        return
    if not isinstance(masters, (list, tuple)) or len(masters) != len(opt._half_models):
        count = f"{len(masters)} tensors" if isinstance(masters, (list, tuple)) else f"a {type(masters).__name__}"
        raise ValueError(
            f"master_params has {count} but this optimizer has {len(opt._half_models)} half-precision "
            "parameters: the checkpoint belongs to another model."
        )
    for i, (saved, model_p) in enumerate(zip(masters, opt._half_models)):
        if not torch.is_tensor(saved) or not saved.is_floating_point() or saved.shape != model_p.shape:
            got = f"shape {tuple(saved.shape)} {saved.dtype}" if torch.is_tensor(saved) else type(saved).__name__
            raise ValueError(
                f"master_params[{i}] is {got} but the half-precision parameter it belongs to (number {i} in "
                f"model order) has shape {tuple(model_p.shape)}: the checkpoint belongs to another model. "
                "Nothing was loaded."
            )
