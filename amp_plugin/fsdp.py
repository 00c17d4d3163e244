"""FSDP2 (``torch.distributed.fsdp.fully_shard``): each preset as a ``MixedPrecisionPolicy``.

Under FSDP2 the sharded FP32 parameters are the master weights, so the master-weight presets
need no :class:`~amp_plugin.MasterWeightOptimizer` (:func:`policy_for`):

- ``fp16``/``bf16``: the parameters stay FP32 and sharded: those shards are the masters.
  ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)`` all-gathers them in the half
  dtype for forward and backward and reduce-scatters the gradients in FP32. Per rank that is
  16/N bytes per parameter with AdamW (FP32 shard, FP32 gradient shard, two FP32 moments) plus
  the unsharded half-precision parameters of the unit in flight. With BF16 moments (``bf16_lean``,
  ``bf16_sr``: the master kind does not apply, the moments do) the plugin wraps Adam/AdamW in
  :class:`~amp_plugin.fsdp_moments.Bf16MomentsAdam`: 12/N bytes (:func:`half_gathered_params`
  are the parameters whose moments are BF16).
- ``fp16_autocast``/``bf16_autocast`` and ``fp32``: the default policy (FP32 all-gathers;
  autocast casts per op).
- ``fp16_pure``/``bf16_pure``: the shards themselves are cast to the half dtype.

:func:`fully_shard_mixed` shards a model bottom-up with the right policy (normalisation layers
as their own FP32 units, like :func:`~amp_plugin.half_module.cast_module` keeps them).
:func:`check_or_set_policies` lets a user call ``fully_shard`` without ``mp_policy``: a unit left
at the default policy gets the preset's one before its first forward, and a unit whose policy
contradicts the preset is an error naming the unit. FSDP2 has no public setter for a unit's
policy; this writes the three private attributes that hold it, which only works before the
root's lazy initialisation (the first forward).

Gradients are DTensors. The loss scaler unscales each rank's local shard (:func:`local_grad`,
no collective) and max-reduces the found-inf flag once across all ranks, so every rank skips
together, as torch's ``ShardedGradScaler`` does. Per-parameter statistics over whole tensors
(:func:`reduce_stats`) are computed on the shards and reduced (two collectives).

No Lightning import.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from amp_plugin._dtensor import is_dtensor
from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.half_module import NORM_TYPES
from amp_plugin.settings import PrecisionSettings

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "check_or_set_policies",
    "fsdp2_units",
    "fully_shard_mixed",
    "half_gathered_params",
    "is_dtensor",
    "local_grad",
    "policy_for",
    "reduce_stats",
    "shard_for_model_parallel",
]


def _fsdp() -> tuple[Any, Any, Any]:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return FSDPModule, MixedPrecisionPolicy, fully_shard


def local_grad(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its storage), or the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


# ---------------------------------------------------------------------------------- policies
def policy_for(settings: PrecisionSettings) -> Any:
    """The ``MixedPrecisionPolicy`` that gives a preset's numerics under FSDP2 (module docstring)."""
    _, MixedPrecisionPolicy, _ = _fsdp()
    if settings.precision == "fp32" or settings.autocast:
        return MixedPrecisionPolicy()
    half = settings.compute_dtype
    if settings.master_weights:
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=half)


def _norm_policy(half: torch.dtype) -> Any:
    """Norm layers kept in FP32: FP32 gather and compute, the output back in the half dtype."""
    _, MixedPrecisionPolicy, _ = _fsdp()
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=half)


def fully_shard_mixed(
    module: nn.Module,
    mesh: Any,
    precision: Any,
    *,
    units: Iterable[nn.Module] | tuple[type[nn.Module], ...] = (),
    keep_norm_fp32: bool | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply ``fully_shard`` bottom-up with the policy of a precision setup.

    Args:
        module: the root to shard (its parameters not in ``units`` form the root unit).
        mesh: the data-parallel ``DeviceMesh`` (``self.device_mesh["data_parallel"]`` in a
            ``LightningModule.configure_model``).
        precision: a :class:`~amp_plugin.settings.PrecisionSettings`, anything with a
            ``settings`` attribute holding one (the Lightning plugin:
            ``self.trainer.precision_plugin``), or a ``MixedPrecisionPolicy``.
        units: submodules, or module types, that each become their own FSDP unit, so that
            only one of them is unsharded at a time (transformer blocks, typically).
        keep_norm_fp32: normalisation layers become their own units gathered and computed in
            FP32, their outputs cast back to the half dtype. Default: the setup's
            ``master_weights`` (False for a bare policy).
        fully_shard_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``, ...).

    Returns ``module`` (now an ``FSDPModule``).
    """
    _, MixedPrecisionPolicy, fully_shard = _fsdp()
    settings = getattr(precision, "settings", precision)
    if isinstance(settings, PrecisionSettings):
        policy = policy_for(settings)
        if keep_norm_fp32 is None:
            keep_norm_fp32 = settings.master_weights
    elif isinstance(precision, MixedPrecisionPolicy):
        policy = precision
    else:
        raise TypeError(
            f"precision={precision!r} is not allowed: pass the MixedPrecisionPlugin, its PrecisionSettings "
            "or a MixedPrecisionPolicy."
        )
    half = policy.param_dtype if policy.param_dtype in HALF_DTYPES else None
    keep_norm_fp32 = bool(keep_norm_fp32) and half is not None
    if isinstance(units, tuple) and all(isinstance(u, type) for u in units):
        chosen = [m for m in module.modules() if m is not module and isinstance(m, units)]
    else:
        chosen = list(units)  # type: ignore[arg-type]
    if keep_norm_fp32:
        for norm in [m for m in module.modules() if isinstance(m, NORM_TYPES) and any(True for _ in m.parameters())]:
            fully_shard(norm, mesh=mesh, mp_policy=_norm_policy(half), **fully_shard_kwargs)  # type: ignore[arg-type]
    for unit in reversed(chosen):  # innermost first, as fully_shard requires
        fully_shard(unit, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    fully_shard(module, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    return module


def shard_for_model_parallel(lightning_module: Any, root: nn.Module, units: Any = ()) -> None:
    """A recipe's ``configure_model``: under Lightning's ``ModelParallelStrategy`` (the module has
    a ``device_mesh``), shard ``root`` with :func:`fully_shard_mixed` and the trainer's precision
    plugin; otherwise do nothing. Idempotent, as ``configure_model`` must be (Lightning calls it
    again for ``validate`` after ``fit``)."""
    mesh = getattr(lightning_module, "device_mesh", None)
    if mesh is None or fsdp2_units(root):
        return
    fully_shard_mixed(root, mesh["data_parallel"], lightning_module.trainer.precision_plugin, units=units)


def fsdp2_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` of every FSDP2 unit in ``module`` (``module`` itself included)."""
    try:
        FSDPModule, _, _ = _fsdp()
    except ImportError:  # torch without FSDP2
        return []
    return [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def half_gathered_params(module: nn.Module) -> list[torch.Tensor]:
    """The parameters of ``module`` whose FSDP2 unit all-gathers them in FP16/BF16 (the ones a
    single process holds in the half dtype; the FP32 norm units' are not among them)."""
    FSDPModule, _, _ = _fsdp()
    chosen: list[torch.Tensor] = []
    for _, unit in fsdp2_units(module):
        if _unit_policy(unit).param_dtype not in HALF_DTYPES:
            continue
        stack = [unit]
        while stack:
            m = stack.pop()
            chosen += list(m.parameters(recurse=False))
            stack += [c for c in m.children() if not isinstance(c, FSDPModule)]
    return chosen


def _unit_policy(unit: nn.Module) -> Any:
    # private: FSDP2 has no public getter for a unit's policy
    return cast("FSDPModule", unit)._get_fsdp_state()._mp_policy


def _unit_is_norm_only(unit: nn.Module) -> bool:
    """Every parameter the unit itself manages (not its sub-units') is in a norm layer."""
    FSDPModule, _, _ = _fsdp()
    own: list[tuple[nn.Module, torch.Tensor]] = []
    stack = [unit]
    while stack:
        m = stack.pop()
        own += [(m, p) for p in m.parameters(recurse=False)]
        stack += [c for c in m.children() if not isinstance(c, FSDPModule)]
    return bool(own) and all(isinstance(m, NORM_TYPES) for m, _ in own)


def _set_unit_policy(unit: nn.Module, policy: Any) -> None:
    """Give a unit built with the default policy another one, before its first forward.

    FSDP2 reads the policy in three places, all private: the state (input/output casts), each
    param group and each parameter (dtypes fixed at the root's lazy init).
    """
    state = cast("FSDPModule", unit)._get_fsdp_state()
    if getattr(state, "_is_root", None) is not None:
        raise RuntimeError("the unit has already run a forward; its dtypes are fixed")
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch kept one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    state._mp_policy = policy
    for group in groups:
        group.mp_policy = policy
        for fsdp_param in group.fsdp_params:
            fsdp_param.mp_policy = policy


def check_or_set_policies(units: list[tuple[str, nn.Module]], settings: PrecisionSettings) -> None:
    """Give units left at the default policy the preset's one; reject contradicting policies.

    Raises:
        ValueError: a unit's policy contradicts the preset; the message names the units, what
            they have, and what to pass.
    """
    _, MixedPrecisionPolicy, _ = _fsdp()
    default, wanted = MixedPrecisionPolicy(), policy_for(settings)
    half = settings.compute_dtype if settings.precision != "fp32" else None
    problems = []
    for name, unit in units:
        have = _unit_policy(unit)
        if have == wanted:
            continue
        norm_only = settings.master_weights and half is not None and _unit_is_norm_only(unit)
        if have == default:  # the user left the policy to us
            _set_unit_policy(unit, _norm_policy(half) if norm_only else wanted)  # type: ignore[arg-type]
            continue
        if norm_only and have.param_dtype in (None, torch.float32):
            continue  # a norm layer kept in FP32 (fully_shard_mixed does this)
        if settings.master_weights and half is not None:
            if have.param_dtype == half:
                if have.reduce_dtype != torch.float32:
                    warnings.warn(
                        f"FSDP2 unit {name!r} reduces gradients in {have.reduce_dtype or half} "
                        f"(mp_policy.reduce_dtype={have.reduce_dtype}): the loss-scaled gradients are summed "
                        "across ranks in half precision, where they overflow (FP16) or lose digits sooner "
                        "than in FP32. reduce_dtype=torch.float32 is what the preset uses.",
                        stacklevel=3,
                    )
                continue
            problems.append(
                f"{name!r} has param_dtype={have.param_dtype} (precision={settings.preset!r} with master "
                f"weights computes in {half}: the FP32 shards are the master weights and FSDP2 all-gathers "
                f"them in {half})"
            )
        elif settings.autocast or half is None:
            if have.param_dtype not in (None, torch.float32):
                why = (
                    "autocast presets keep FP32 parameters and let torch.autocast cast per op"
                    if settings.autocast
                    else "precision='fp32' computes in FP32"
                )
                problems.append(f"{name!r} has param_dtype={have.param_dtype} ({why})")
        elif have.param_dtype not in (None, half):  # pure
            problems.append(f"{name!r} has param_dtype={have.param_dtype} (pure {half} computes in {half})")
    if problems:
        raise ValueError(
            f"The FSDP2 MixedPrecisionPolicy of these units contradicts precision={settings.preset!r}: "
            + "; ".join(problems)
            + f". Build the units with fully_shard(..., mp_policy={wanted}), with "
            "amp_plugin.fsdp.fully_shard_mixed(module, mesh, plugin, units=...), or without mp_policy (the "
            "plugin then sets it); or choose the preset that matches your policy."
        )


# ---------------------------------------------------------------------------------- statistics
def _shard_group(tensors: list[Any]) -> Any:
    """The process group over which the DTensors in ``tensors`` are sharded when they all live
    on one 1-D mesh (FSDP2 alone): its group if every one is sharded, ``None`` if every one is
    replicated, ``False`` otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = tensors[0].device_mesh
    if len({id(t.device_mesh) for t in tensors}) != 1 or mesh.ndim != 1:
        return False
    placements = [t.placements[0] for t in tensors]
    if all(isinstance(p, Shard) for p in placements):
        return mesh.get_group()
    if all(isinstance(p, Replicate) for p in placements):
        return None
    return False


def reduce_stats(grads: list[torch.Tensor], local: torch.Tensor, sum_cols: int) -> torch.Tensor:
    """Per-gradient statistics of local shards made whole-tensor statistics.

    ``local`` is ``[len(grads), k]``, computed on each rank's shards: the first ``sum_cols``
    columns are counts (summed over the shards), the rest maxima (max over the shards). Two
    collectives for all gradients; call it on every rank. Plain tensors pass through.

    Raises:
        NotImplementedError: gradients on several or multi-dimensional device meshes (FSDP
            combined with tensor parallelism).
    """
    import torch.distributed as dist

    sharded = [i for i, g in enumerate(grads) if is_dtensor(g)]
    if not sharded:
        return local
    group = _shard_group([grads[i] for i in sharded])
    if group is None:  # replicated: the local statistics are the whole tensor's
        return local
    if group is False:
        raise NotImplementedError(
            "gradient statistics over several or multi-dimensional device meshes (FSDP with tensor "
            "parallelism) are not supported"
        )
    idx = torch.tensor(sharded, device=local.device)
    counts = local[idx, :sum_cols].contiguous()
    maxima = local[idx, sum_cols:].contiguous()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    if maxima.numel():
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    local = local.clone()
    local[idx, :sum_cols] = counts
    local[idx, sum_cols:] = maxima
    return local
