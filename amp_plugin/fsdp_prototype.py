"""FSDP2 (``fully_shard``) under Lightning's ``ModelParallelStrategy``: the sharded FP32
parameters are the master weights.

Prototype of what :class:`~amp_plugin.lightning.MixedPrecisionPlugin` needs to run under
``ModelParallelStrategy`` with the user's ``fully_shard`` in ``configure_model``::

    class Model(pl.LightningModule):
        def configure_model(self):
            plugin = self.trainer.precision_plugin
            fully_shard_mixed(self.net, self.device_mesh["data_parallel"], plugin, units=self.net.blocks)

    trainer = pl.Trainer(
        accelerator="cpu", devices=2, plugins=[FSDP2MixedPrecisionPlugin("fp16")],
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    )

How each preset maps onto FSDP2 (:func:`mp_policy_for`):

- ``fp16``/``bf16`` (FP32 master weights): the parameters stay FP32 and sharded; those shards
  are the master weights the optimizer updates, and no :class:`MasterWeightOptimizer` is
  built. ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)`` all-gathers the
  parameters in the half dtype for forward and backward and reduce-scatters the gradients
  in FP32, so the optimizer sees FP32 gradients on FP32 shards. Per rank that is 16/N bytes
  per parameter (FP32 shard, FP32 gradient shard, two FP32 Adam moments) plus the unsharded
  half-precision parameters of the units in flight.
- ``fp16_autocast``/``bf16_autocast``: FP32 parameters and FP32 all-gathers, forward under
  ``torch.autocast`` (the default ``MixedPrecisionPolicy()``).
- ``fp16_pure``/``bf16_pure``: the sharded parameters themselves are cast to the half dtype
  (Lightning's ``16-true``); all-gathers, reductions and the optimizer in that dtype.
- ``fp32``: the default policy.

A unit built with the default policy (the user called ``fully_shard`` without ``mp_policy``)
gets the preset's policy from the plugin before its first forward (a unit of norm layers
alone, with master weights, gets the FP32 one :func:`fully_shard_mixed` gives them). FSDP2
has no public way to change a unit's policy: this writes the three private attributes that
hold it, which only works before the root's lazy initialisation (the first forward). A unit
whose policy contradicts the preset is an error that says which unit, what it has, and what
to pass.

Loss scaling: the gradients are DTensors. The unscale and the inf check run on each rank's
local shards (one fused pass per dtype, no collective), and the scaler max-reduces the
found-inf flag once across all ranks, so every rank skips together, as torch's
``ShardedGradScaler`` does. (Calling ``torch._amp_foreach_non_finite_check_and_unscale_`` on
the DTensors themselves also works in recent torch, through DTensor's
``found_inf_reduce_handler``, but costs one all-reduce per dtype group on top of the scaler's.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from amp_plugin.lightning._namespace import rank_zero_info
from torch import nn
from typing_extensions import override

from amp_plugin.half_module import NORM_TYPES
from amp_plugin.master_weights import MasterWeightOptimizer
from amp_plugin.lightning.plugin import CHECKPOINT_KEY, MixedPrecisionPlugin
from amp_plugin.scaler import unscale_grouped

__all__ = [
    "FSDP2MixedPrecisionPlugin",
    "fsdp2_units",
    "fully_shard_mixed",
    "local_grad",
    "mp_policy_for",
    "sharded_grad_stats",
    "unscale_local_shards",
]


def _fsdp():
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    return FSDPModule, MixedPrecisionPolicy, fully_shard


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_grad(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view sharing its storage), or the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


# ---------------------------------------------------------------------------------- policies
def mp_policy_for(precision: str, master_weights: bool, autocast: bool) -> Any:
    """The ``MixedPrecisionPolicy`` that gives a preset's numerics under FSDP2.

    Half precision with master weights computes in the half dtype and reduces gradients in
    FP32. Pure half precision has half-precision shards; its ``param_dtype`` only makes FSDP
    cast the root's floating inputs, as ``convert_input`` does without FSDP. Autocast (which
    casts per op) and FP32 use the default policy.
    """
    _, MixedPrecisionPolicy, _ = _fsdp()
    if precision == "fp32" or autocast:
        return MixedPrecisionPolicy()
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    if master_weights:
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=half)


def _norm_policy(half: torch.dtype) -> Any:
    """Norm layers kept in FP32: FP32 gather and compute, the output back in the half dtype."""
    _, MixedPrecisionPolicy, _ = _fsdp()
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=half)


def fully_shard_mixed(
    module: nn.Module,
    mesh: Any,
    policy: Any,
    *,
    units: Iterable[nn.Module] | tuple[type[nn.Module], ...] = (),
    keep_norm_fp32: bool | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply ``fully_shard`` bottom-up with the policy a precision plugin asks for.

    Args:
        module: the root to shard (its parameters not in ``units`` form the root unit).
        mesh: the data-parallel ``DeviceMesh`` (``self.device_mesh["data_parallel"]`` in a
            ``LightningModule.configure_model``).
        policy: a :class:`FSDP2MixedPrecisionPlugin` (its :attr:`~FSDP2MixedPrecisionPlugin.mp_policy`)
            or a ``MixedPrecisionPolicy``.
        units: submodules (or module types) that each become their own FSDP unit, so that
            only one of them is unsharded at a time (transformer blocks, typically).
        keep_norm_fp32: normalisation layers (:data:`~amp_plugin.half_module.NORM_TYPES`)
            become their own units gathered and computed in FP32, their outputs cast back to
            the half dtype. Default: the plugin's ``master_weights`` (False for a bare policy).
        fully_shard_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``, ...).

    Returns ``module`` (now an ``FSDPModule``).
    """
    _, MixedPrecisionPolicy, fully_shard = _fsdp()
    if isinstance(policy, FSDP2MixedPrecisionPlugin):
        plugin = policy
        policy = plugin.mp_policy
        if keep_norm_fp32 is None:
            keep_norm_fp32 = plugin.master_weights
    elif not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"policy={policy!r} is not allowed: pass the FSDP2MixedPrecisionPlugin or a MixedPrecisionPolicy."
        )
    half = policy.param_dtype if policy.param_dtype in (torch.float16, torch.bfloat16) else None
    keep_norm_fp32 = bool(keep_norm_fp32) and half is not None
    if isinstance(units, tuple) and all(isinstance(u, type) for u in units):
        types = units
        chosen = [m for m in module.modules() if m is not module and isinstance(m, types)]
    else:
        chosen = list(units)
    if keep_norm_fp32:
        norms = [m for m in module.modules() if isinstance(m, NORM_TYPES) and any(True for _ in m.parameters())]
        for norm in norms:
            fully_shard(norm, mesh=mesh, mp_policy=_norm_policy(half), **fully_shard_kwargs)
    for unit in reversed(chosen):  # innermost first, as fully_shard requires
        fully_shard(unit, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    fully_shard(module, mesh=mesh, mp_policy=policy, **fully_shard_kwargs)
    return module


def fsdp2_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, submodule)`` of every FSDP2 unit in ``module`` (``module`` itself included)."""
    try:
        FSDPModule, _, _ = _fsdp()
    except ImportError:  # torch without FSDP2
        return []
    return [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def _unit_state(unit: nn.Module) -> Any:
    return unit._get_fsdp_state()  # private: FSDP2 has no public getter for a unit's policy


def _unit_policy(unit: nn.Module) -> Any:
    return _unit_state(unit)._mp_policy


def _unit_is_norm_only(unit: nn.Module) -> bool:
    """Every parameter the unit itself manages (not its sub-units') is in a norm layer."""
    FSDPModule, _, _ = _fsdp()
    own = []
    stack = [unit]
    while stack:
        m = stack.pop()
        own += [(m, p) for p in m.parameters(recurse=False)]
        stack += [c for c in m.children() if not isinstance(c, FSDPModule)]
    return bool(own) and all(isinstance(m, NORM_TYPES) for m, _ in own)


def _set_unit_policy(unit: nn.Module, policy: Any) -> None:
    """Give a unit built with the default policy another one, before its first forward.

    FSDP2 reads the policy in three places: the state (input/output casts), each param
    group and each parameter (dtypes fixed at the root's lazy init). All are private.
    """
    state = _unit_state(unit)
    if getattr(state, "_is_root", None) is not None:
        raise RuntimeError("the unit has already run a forward; its dtypes are fixed")
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.10 kept one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    state._mp_policy = policy
    for group in groups:
        group.mp_policy = policy
        for fsdp_param in group.fsdp_params:
            fsdp_param.mp_policy = policy


# ---------------------------------------------------------------------------------- scaling
@torch.no_grad()
def unscale_local_shards(
    optimizer: torch.optim.Optimizer, inv_scale_on: Callable[[torch.device], torch.Tensor]
) -> dict[torch.device, torch.Tensor]:
    """Unscale every gradient of ``optimizer`` in place on this rank's shards; flag inf/NaN.

    DTensor gradients are unscaled through ``to_local()`` (the local shard shares the
    DTensor's storage), so no collective runs here: the scaler max-reduces the returned
    flags once across all ranks when it decides the skip. Called by
    :meth:`LossScaler.unscale_` through the optimizer's ``unscale_grads_`` attribute.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            g = local_grad(g)
            if g.is_sparse:
                raise TypeError("sparse gradients are not supported with FSDP2")
            if g.numel():
                groups.setdefault((g.device, g.dtype), []).append(g)
    return unscale_grouped(groups, inv_scale_on)


def _shard_group(tensors: list[torch.Tensor]) -> Any:
    """The process group over which the DTensors in ``tensors`` are sharded when they all
    live on one 1-D mesh (FSDP2 alone): its group if every one is sharded (on any dim),
    ``None`` if every one is replicated, ``False`` otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    meshes = {id(t.device_mesh) for t in tensors}
    mesh = tensors[0].device_mesh
    if len(meshes) != 1 or mesh.ndim != 1:
        return False
    placements = [t.placements[0] for t in tensors]
    if all(isinstance(p, Shard) for p in placements):
        return mesh.get_group()
    if all(isinstance(p, Replicate) for p in placements):
        return None
    return False


def _reduce_stats(grads: list[torch.Tensor], local: torch.Tensor, sum_cols: int) -> torch.Tensor:
    """Reduce per-gradient stats computed on local shards to whole-tensor stats.

    ``local`` is ``[len(grads), k]``: the first ``sum_cols`` columns are counts (summed over
    the shards), the rest maxima (max over the shards). Two collectives for all gradients,
    on FSDP2's 1-D mesh; several or multi-dimensional meshes (FSDP + tensor parallelism)
    are not handled yet.
    """
    import torch.distributed as dist

    sharded = [i for i, g in enumerate(grads) if _is_dtensor(g)]
    if not sharded:
        return local
    group = _shard_group([grads[i] for i in sharded])
    if group is None:  # replicated: the local stats are the whole tensor's
        return local
    if group is False:
        raise NotImplementedError(
            "gradient statistics over several or multi-dimensional device meshes (FSDP + tensor "
            "parallelism) are not handled yet"
        )
    idx = torch.tensor(sharded, device=local.device)
    counts = local[idx, :sum_cols].contiguous()
    maxima = local[idx, sum_cols:].contiguous()
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    local = local.clone()
    local[idx, :sum_cols] = counts
    local[idx, sum_cols:] = maxima
    return local


@torch.no_grad()
def sharded_grad_stats(grads: list[torch.Tensor], scale: float) -> list[list[float]]:
    """:func:`amp_plugin.lightning.callbacks.grad_health.measure` for DTensor gradients.

    Per gradient ``[zero_count, underflow_count_scale1, underflow_count_current, amax]`` over
    the whole (unsharded) tensor: counted on the local shards, counts summed and maxima
    max-reduced across the shards (two collectives for all gradients). Every rank gets the
    same rows, so call it on every rank.
    """
    from amp_plugin.lightning.callbacks.grad_health import FP16_MIN_NORMAL

    if not grads:
        return []
    current = FP16_MIN_NORMAL / scale
    rows = []
    for g in grads:
        a = local_grad(g.detach()).abs()
        if a.dtype not in (torch.float32, torch.float64):
            a = a.float()
        if a.numel() == 0:  # a rank may hold an empty shard of a small parameter
            rows.append(torch.zeros(4, dtype=torch.float64, device=a.device))
            continue
        rows.append(torch.stack([
            (a == 0).sum().double(), (a < FP16_MIN_NORMAL).sum().double(), (a < current).sum().double(),
            a.max().double(),
        ]))
    local = torch.stack(rows)
    return _reduce_stats(grads, local, sum_cols=3).tolist()


# ---------------------------------------------------------------------------------- the plugin
class FSDP2MixedPrecisionPlugin(MixedPrecisionPlugin):
    """:class:`~amp_plugin.lightning.MixedPrecisionPlugin` that also runs under FSDP2.

    Same arguments and behaviour as the base class on a module without ``fully_shard``.
    On an FSDP2 module (``ModelParallelStrategy`` with ``fully_shard`` in
    ``configure_model``):

    - ``convert_module`` leaves the FP32 shards alone (master-weight and autocast presets),
      gives units with the default policy the preset's :attr:`mp_policy`, and rejects a
      policy that contradicts the preset; pure presets cast the shards to the half dtype.
    - ``connect`` builds no :class:`MasterWeightOptimizer`: the FP32 shards are the masters.
    - The loss scaler unscales the local shards; the found-inf flag is max-reduced over all
      ranks, so every rank skips together (and holds step-interval LR schedulers together).
    - ``last_nonfinite_params`` counts over whole tensors, the same on every rank.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharded = False  # set by convert_module when the module holds FSDP2 units

    @property
    def mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` for this plugin's preset (:func:`mp_policy_for`)."""
        return mp_policy_for(self.amp_precision, self.master_weights, self.autocast)

    # ------------------------------------------------------------------ setup
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        units = fsdp2_units(module)
        if not units:
            self.sharded = False
            return super().convert_module(module)
        self.sharded = True
        self._check_or_set_policies(units)
        if self.amp_precision != "fp32" and not self.master_weights and not self.autocast:
            # pure half precision: the shards themselves become half (FSDPModule._apply re-registers them)
            module.to(self.compute_dtype)
        return module

    def _check_or_set_policies(self, units: list[tuple[str, nn.Module]]) -> None:
        _, MixedPrecisionPolicy, _ = _fsdp()
        default = MixedPrecisionPolicy()
        wanted = self.mp_policy
        half = self.compute_dtype if self.amp_precision != "fp32" else None
        problems = []
        for name, unit in units:
            have = _unit_policy(unit)
            if have == wanted:
                continue
            norm_only = self.master_weights and half is not None and _unit_is_norm_only(unit)
            if have == default:  # the user left the policy to us
                _set_unit_policy(unit, _norm_policy(half) if norm_only else wanted)
                continue
            if norm_only and have.param_dtype in (None, torch.float32):
                continue  # a norm layer kept in FP32 (fully_shard_mixed does this)
            if self.master_weights and half is not None:
                if have.param_dtype == half:
                    if have.reduce_dtype != torch.float32:
                        warnings.warn(
                            f"FSDP2 unit {name!r} reduces gradients in {have.reduce_dtype or half} "
                            f"(mp_policy.reduce_dtype={have.reduce_dtype}): the loss-scaled gradients are "
                            "summed across ranks in half precision, where they overflow (FP16) or lose "
                            "digits sooner than in FP32. reduce_dtype=torch.float32 is what the preset uses.",
                            stacklevel=3,
                        )
                    continue
                problems.append(
                    f"{name!r} has param_dtype={have.param_dtype} (precision={self.amp_precision!r} with "
                    f"master weights computes in {half}: the FP32 shards are the master weights and "
                    f"FSDP2 all-gathers them in {half})"
                )
            elif self.autocast or half is None:
                if have.param_dtype not in (None, torch.float32):
                    why = ("autocast presets keep FP32 parameters and let torch.autocast cast per op"
                           if self.autocast else "precision='fp32' computes in FP32")
                    problems.append(f"{name!r} has param_dtype={have.param_dtype} ({why})")
            elif have.param_dtype not in (None, half):  # pure
                problems.append(f"{name!r} has param_dtype={have.param_dtype} (pure {half} computes in {half})")
        if problems:
            raise ValueError(
                "The FSDP2 MixedPrecisionPolicy of these units contradicts the plugin "
                f"({self!r}): " + "; ".join(problems) + ". Build the units with "
                f"fully_shard(..., mp_policy=plugin.mp_policy) (here {wanted}), with "
                "amp_plugin.fsdp_prototype.fully_shard_mixed(module, mesh, plugin, units=...), or "
                "without mp_policy (the plugin then sets it); or choose the preset that matches your policy."
            )

    @override
    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, Any, Any]:
        if not self.sharded:
            return super().connect(model, optimizers, lr_schedulers)
        for opt in optimizers:
            if isinstance(opt, MasterWeightOptimizer):
                raise TypeError(
                    "MasterWeightOptimizer cannot be used with FSDP2: the sharded FP32 parameters are already "
                    "the master weights. Build the optimizer over the module's parameters directly."
                )
            # The scaler unscales through this hook (LossScaler.unscale_ looks for it).
            opt.unscale_grads_ = _LocalShardUnscale(opt)
        # The base class wraps when master_weights is set: hide it for that call, and describe
        # the run here, once master_weights says again what the preset means.
        described, self._described = self._described, True
        master_weights, self.master_weights = self.master_weights, False
        try:
            result = super().connect(model, optimizers, lr_schedulers)
        finally:
            self.master_weights = master_weights
        if not described:
            rank_zero_info(f"amp_plugin: {self.describe()}")
        return result

    @override
    def describe(self) -> str:
        text = super().describe()
        if self.sharded and self.master_weights:
            text = text.replace(
                "FP32 master weights, half-precision model",
                f"FSDP2: FP32 sharded parameters are the master weights, compute in {self.amp_precision} "
                f"({self.mp_policy})",
            )
        return text

    # ------------------------------------------------------------------ the optimizer step
    @override
    def _nonfinite_params(self, model: nn.Module, top: int = 5) -> list[tuple[str, int]]:
        if not self.sharded:
            return super()._nonfinite_params(model, top)
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if not named:
            return []
        local = torch.stack([(~torch.isfinite(local_grad(g))).sum().double() for _, g in named]).unsqueeze(1)
        bad = _reduce_stats([g for _, g in named], local, sum_cols=1)[:, 0].tolist()
        counts = sorted(((name, int(n)) for (name, _), n in zip(named, bad) if n), key=lambda item: -item[1])
        return counts[:top]

    # ------------------------------------------------------------------ checkpoints
    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.sharded and self.master_weights:
            checkpoint[CHECKPOINT_KEY]["master_params_in"] = "state_dict (FSDP2: the FP32 sharded parameters)"


class _LocalShardUnscale:
    """``optimizer.unscale_grads_``: :func:`unscale_local_shards` bound to one optimizer
    (a class rather than a closure so the optimizer still pickles)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __call__(self, inv_scale_on: Callable[[torch.device], torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        return unscale_local_shards(self.optimizer, inv_scale_on)
