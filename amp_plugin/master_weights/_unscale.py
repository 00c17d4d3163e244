"""A loss scaler's ``unscale_`` on a :class:`~amp_plugin.MasterWeightOptimizer`: the inf/NaN check
of the model's gradients and the unscaled FP32 master gradients
(:meth:`~amp_plugin.MasterWeightOptimizer.unscale_grads_`).

Each half-precision gradient goes the cheapest way it can: a contiguous CPU one is only checked
(the fused step reads it with the unscale factor), and so is one the step's first kernel reads as it is
on any device (the fused passes, which upcast a slab at a time: ``_multi_tensor._Targets.step``; checked by
torch's ``_amp_foreach_non_finite_check_and_unscale_`` with a factor of one, which leaves every value as
it is); the others are copied into FP32 and unscaled per device in one or two multi-tensor ops, sparse or
strided ones one by one. FP32 sums of accumulated gradients and the gradients of FP32 parameters are
unscaled in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.fused import adam as _adam
from amp_plugin.master_weights._grads import begin_session, eager_unscale, one_on, unscaled_copy
from amp_plugin.master_weights._refusals import by_device_dtype, flag
from amp_plugin.master_weights._step import step_kernels
from amp_plugin.scaling.unscale import InvScaleOn, record_amax, unscale_grouped

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = ["own_grads", "unscale_grads"]


def unscale_grads(
    opt: MasterWeightOptimizer, inv_scale_on: InvScaleOn, amax: dict[torch.device, torch.Tensor] | None
) -> dict[torch.device, torch.Tensor]:
    """What :meth:`~amp_plugin.MasterWeightOptimizer.unscale_grads_` does (see there); returns one
    found-inf tensor per device."""
    session = begin_session(opt, inv_scale_on)
    if amax is not None:
        held = [g for i, g in enumerate(session.grads) if g is not None and i not in session.eager]
        record_amax([*own_grads(opt), *session.eager.values(), *held], amax)
    found = unscale_grouped(by_device_dtype(own_grads(opt)), inv_scale_on)
    ops = opt._kernel_ops()
    reads = _first_reader(opt)
    checked, eager, single = [], [], []
    left: list[int] = []  # read by the step's kernel as they are, checked here by torch's op
    summed = dict(session.eager)  # FP32 sums of accumulated gradients, ours to unscale in place
    for device in {t.device for t in summed.values()}:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [t for t in summed.values() if t.device == device], flag(found, device), inv_scale_on(device)
        )
    for i, grad in enumerate(session.grads):
        if grad is None or i in summed:
            continue
        if grad.is_sparse or not grad.is_contiguous():
            single.append(i)  # one by one: a coalesced sparse copy, or a contiguous one
        elif ops is not None and grad.is_cpu and grad.dtype in HALF_DTYPES:
            checked.append(grad)  # stays pending: the step reads it
        elif reads is not None and grad.dtype in HALF_DTYPES and reads(grad):
            left.append(i)  # stays pending too
        else:
            eager.append(i)
    if checked:
        _adam.nonfinite_check(ops, checked, flag(found, torch.device("cpu")))
    grads = cast("list[torch.Tensor]", session.grads)  # at the indices in eager, left and single: not None
    for device, dtype in {(grads[i].device, grads[i].dtype) for i in left}:
        index = [i for i in left if grads[i].device == device and grads[i].dtype == dtype]
        torch._amp_foreach_non_finite_check_and_unscale_([grads[i] for i in index], flag(found, device), one_on(device))
        for i in index:  # an in-place op with every value as it was: not a change of the user's
            session.versions[i] = grads[i]._version
    devices = {grads[i].device for i in eager}
    for device in devices:
        index = eager if len(devices) == 1 else [i for i in eager if grads[i].device == device]
        copies = eager_unscale([grads[i] for i in index], inv_scale_on(device), flag(found, device), ops)
        session.eager.update(zip(index, copies))
    for i in single:
        grad = grads[i]
        out = unscaled_copy(grad, None)
        torch._amp_foreach_non_finite_check_and_unscale_(
            [out._values() if out.is_sparse else out], flag(found, grad.device), inv_scale_on(grad.device)
        )
        session.eager[i] = out
    return found


def _first_reader(opt: MasterWeightOptimizer) -> Callable[[torch.Tensor], bool] | None:
    """Which half gradients the first kernel the step will try reads as they are (``None``: it reads none, or
    the wrapped optimizer's own step runs); a step that ends up elsewhere makes them FP32 then (``to_fp32``)."""
    kernels = step_kernels(opt, {})
    return kernels[0].reads_half_grad if kernels else None


def own_grads(opt: MasterWeightOptimizer) -> list[torch.Tensor]:
    """The gradients of the FP32 parameters (their own master) to unscale in place: the
    values of a sparse one (as torch.amp.GradScaler unscales them)."""
    grads = []
    for p in opt._own:
        g = p.grad
        if g is not None:
            grads.append(g._values() if g.is_sparse else g)
    return grads
