"""The step of a :class:`~amp_plugin.MasterWeightOptimizer`: which gradient each master is stepped
with, which step kernel runs, and the copy of the stepped masters into the model.

:func:`step_grads` says, per half-precision parameter, what the step uses: an FP32 gradient
(materialized, set by user code, computed ahead) or, for the pending ones, the model's half
gradient, which :func:`to_fp32` copies and unscales where the kernel cannot read it.
:func:`step_kernels` picks the kernels that may run (:mod:`amp_plugin.master_weights._kernels`),
tried in order; without one, :func:`run_step` gives the masters their FP32 gradients and runs
the wrapped optimizer's own ``step()`` over the masters' FP32 values
(:mod:`amp_plugin.master_weights._own_step`), then copies the stepped masters into the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from amp_plugin import fused as _fused
from amp_plugin.adam_rule import foreach_refusal
from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.fused import adam as _adam
from amp_plugin.master_weights._grads import GradSession, eager_unscale, unscaled_copy
from amp_plugin.master_weights._kernels import StepCall, StepKernel, choose
from amp_plugin.master_weights._own_step import own_step
from amp_plugin.master_weights._parameter import set_grad

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = ["copy_into_model", "record_versions", "run_step", "step_grads", "step_kernels", "to_fp32"]


def run_step(opt: MasterWeightOptimizer, session: GradSession, kwargs: dict[str, Any]) -> Any:
    """Step the masters with ``session``'s gradients (``kwargs``: for the wrapped optimizer's ``step``) and
    copy the stepped ones into the model; returns what the wrapped ``step`` returned."""
    grads, pending = step_grads(opt, session)
    masters, models = opt._half_masters, opt._half_models
    kernels = step_kernels(opt, kwargs)
    # one draw per step whichever path runs, so every path (and a resumed run) rounds alike
    keys = opt._sr.keys(list(range(len(models)))) if opt._sr is not None else [0] * len(models)
    for kernel in kernels:
        to_fp32(session, grads, pending, kernel.reads_half_grad)
        call = StepCall(
            opt.optimizer,
            grads,
            opt._index_of,
            models,
            opt._records,
            opt._kind,
            keys,
            opt.moments_dtype,
            opt.sr_moments,
            opt._kernel_ops(),
            opt.fused,
            session.inv_on,
        )
        if kernel.run(call):
            # what an LR scheduler's step tracking records (torch's private flag, not in the stubs)
            opt.optimizer._opt_called = True  # type: ignore[attr-defined]
            record_versions(opt, grads)
            return None
        pending = [i for i in pending if (g := grads[i]) is not None and g.dtype in HALF_DTYPES]
    to_fp32(session, grads, pending)
    touched = session.touched  # the wrapped optimizer's own step reads the masters' .grad
    for i, (master, grad) in enumerate(zip(masters, grads)):
        if grad is not None and master._amp_grad is not grad:
            set_grad(master, grad)
            touched.add(i)
    result = own_step(opt, grads, keys, lambda: opt.optimizer.step(**kwargs))
    if opt._kind.has_fp32_tensor:
        copy_into_model([(models[i], masters[i]) for i, grad in enumerate(grads) if grad is not None])
    record_versions(opt, grads)
    return result


def step_kernels(opt: MasterWeightOptimizer, kwargs: dict[str, Any]) -> list[StepKernel]:
    """The step kernels that may run this step, in order; empty: the wrapped optimizer's own step
    (:mod:`amp_plugin.master_weights._own_step`), which every kind and moments dtype can take.

    With ``fused=None``: FP32 masters with FP32 moments take a kernel only when the optimizer was
    built with ``fused=True`` (otherwise the user chose torch's for-loop or foreach rule, or
    another optimizer); the lean kinds and BF16 moments take the kernels for Adam/AdamW unless it
    was built with ``foreach=True`` (whose roundings the fused rule would replace). Step keyword
    arguments and the wrapped optimizer's own step hooks always send the step its own way."""
    if kwargs or _adam.has_step_hooks(opt.optimizer):
        return []
    if opt._chosen is None:
        plain = opt._kind.has_fp32_tensor and opt.moments_dtype is torch.float32
        if opt.fused is None and (
            not all(g.get("fused") for g in opt.param_groups) if plain else foreach_refusal(opt.optimizer) is not None
        ):
            opt._chosen = []
        else:
            opt._chosen = choose(opt.optimizer, opt.master, opt.fused, opt._all_cpu(), True, _fused.kernels())
    if opt._kernel_ops() is None:
        return [k for k in opt._chosen if k.name != "amp_plugin"]
    return opt._chosen


def copy_into_model(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if pairs:
        models, masters = zip(*pairs)
        with torch.no_grad():
            torch._foreach_copy_(list(models), list(masters))


def record_versions(opt: MasterWeightOptimizer, grads: list[torch.Tensor | None]) -> None:
    for model_p, grad, record in zip(opt._half_models, grads, opt._records):
        if grad is not None:
            record.version, record.ptr = model_p._version, model_p.data_ptr()


def step_grads(opt: MasterWeightOptimizer, session: GradSession) -> tuple[list[torch.Tensor | None], list[int]]:
    """What the step uses per half parameter (by index): an FP32 gradient (materialized,
    set, computed ahead) or, for the pending ones, the model's half gradient; ``None``:
    not stepped. And the indices of the pending ones."""
    grads: list[torch.Tensor | None] = []
    pending: list[int] = []
    touched, seen, versions, eager = session.touched, session.grads, session.versions, session.eager
    for i, (model, master) in enumerate(zip(opt._half_models, opt._half_masters)):
        slot = master._amp_grad
        if slot is not None or seen[i] is None or i in touched:
            grads.append(slot)
            continue
        grad = model.grad
        # seen[i] is not None here, so `grad is None` adds no case to `grad is not seen[i]`: it only
        # narrows grad for the type checker (cheaper than a cast() call per parameter)
        if grad is None or grad is not seen[i] or grad._version != versions[i]:
            opt._warn_grads_changed()
            if grad is not None:
                pending.append(i)
        elif i in eager:
            grad = eager[i]
        else:
            pending.append(i)
        grads.append(grad)
    return grads, pending


def to_fp32(
    session: GradSession,
    grads: list[torch.Tensor | None],
    pending: list[int],
    reads: Callable[[torch.Tensor], bool] | None = None,
) -> None:
    """Replace the pending half gradients in ``grads`` by FP32 master gradients: one
    multi-tensor copy (and unscale) per device, sparse or strided ones one by one
    (``reads``: a kernel's :attr:`~._kernels.StepKernel.reads_half_grad`, just those it cannot read)."""
    batch: list[int] = []
    present = cast("list[torch.Tensor]", grads)  # the same list: not None at the indices in pending
    for i in pending:
        grad = present[i]
        if (
            grad.is_sparse
            or not grad.is_contiguous()
            or grad.dtype not in HALF_DTYPES
            or (reads is not None and not reads(grad))
        ):
            grads[i] = unscaled_copy(grad, session.inv_on(grad.device), session.ops)
        elif reads is None:
            batch.append(i)
    for device in {present[i].device for i in batch}:
        index = [i for i in batch if present[i].device == device]
        copies = eager_unscale([present[i] for i in index], session.inv_on(device), None, session.ops)
        for i, copy in zip(index, copies):
            grads[i] = copy
