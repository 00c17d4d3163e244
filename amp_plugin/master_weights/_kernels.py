"""The step kernels of :class:`~amp_plugin.MasterWeightOptimizer`, by registration.

A :class:`StepKernel` says which optimizer classes it implements, for which master kinds
(``_kinds.py``), on which device, and whether ``fused=None`` picks it; :data:`KERNELS` lists
them in order of preference and :func:`register_kernel` adds one. The wrapper takes the first
that fits (:func:`choose`); a kernel may still decline one step (a gradient it cannot read:
``run`` returns ``False`` having changed nothing), and the next one that fits runs it. The
kinds that keep an FP32 tensor (``master="fp32"`` with FP32 moments) fall back to the wrapped
optimizer's own ``step()`` ("stock") when no kernel fits.

Registered here, for every kind and both moment dtypes: amp_plugin's one-pass CPU Adam/AdamW
(``amp_plugin.fused``); torch's multi-tensor Adam/AdamW with the lean kinds' joins and stores
as two Triton kernels per group (``_triton.py``; any device Triton compiles for, on the CPU
only when named, in Triton's interpreter); the same with them compiled by ``torch.compile``
(``_compiled.py``; any device, on the CPU only when named); and torch's multi-tensor
Adam/AdamW with those joins and stores in torch ops (any device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin.fused import adam as _adam
from amp_plugin.master_weights import _compiled, _multi_tensor, _triton
from amp_plugin.master_weights._parameter import Record
from amp_plugin.master_weights._passes import Passes

__all__ = ["KERNELS", "StepCall", "StepKernel", "choose", "register_kernel"]


@dataclass
class StepCall:
    """What one step hands a kernel. Indices are positions among the half-precision parameters."""

    optimizer: Optimizer
    grads: list[torch.Tensor | None]  # FP32 master gradients, or the model's half ones (times the unscale factor)
    index_of: dict[int, int]  # id(master) -> index
    models: list[torch.Tensor]
    records: list[Record]
    kind: Any  # the MasterKind
    keys: list[int]  # stochastic rounding keys by index (zeros for the other kinds)
    moments_dtype: torch.dtype
    sr_moments: bool  # BF16 moments rounded stochastically (moment keys from `keys`), else to nearest
    ops: Any  # amp_plugin's kernels, or None
    fused: bool | str | None = None  # the wrapper's fused= (a kernel named there may not fall back)
    inv_on: Callable[[torch.device], torch.Tensor | None] | None = None  # the half gradients' unscale factor
    # on a device (None, or returning None: not scaled)


@dataclass(frozen=True)
class StepKernel:
    """A step kernel's registration.

    Attributes:
        name: what ``fused=`` calls it: ``"amp_plugin"`` (``fused=True``), ``"triton"``, ``"compiled"``
            or ``"torch"``.
        optimizers: the optimizer classes whose update rule it computes (exact type).
        kinds: the ``master=`` kinds it can store into.
        device_type: where the parameters must be (``None``: any device).
        automatic_on_cpu: whether ``fused=None`` picks it when every parameter is on the CPU.
        only_named_on_cpu: on the CPU only ``fused=<name>`` picks it (not a fallback of ``fused=None``).
        ineligible: why an optimizer (options, parameters) cannot take it, or ``None``; the
            flag: its half-precision parameters are not yet replaced by masters.
        run: the step; ``False`` means it declined and changed nothing.
        reads_half_grad: which of the model's half gradients (dense, contiguous) it reads as they are, times
            the unscale factor; the others are made FP32 master gradients first. ``None``: none.
    """

    name: str
    optimizers: tuple[type[Optimizer], ...]
    kinds: frozenset[str]
    device_type: str | None
    automatic_on_cpu: bool
    ineligible: Callable[[Optimizer, bool], str | None]
    run: Callable[[StepCall], bool]
    reads_half_grad: Callable[[torch.Tensor], bool] | None
    only_named_on_cpu: bool = False


KERNELS: list[StepKernel] = []
"""Every registered kernel, most preferred first."""


def register_kernel(kernel: StepKernel) -> StepKernel:
    """Add ``kernel`` to :data:`KERNELS` (after the ones there)."""
    KERNELS.append(kernel)
    return kernel


def choose(
    optimizer: Optimizer, kind: str, fused: bool | str | None, all_cpu: bool, stock: bool, ops: Any
) -> list[StepKernel]:
    """The kernels that may run a step of ``optimizer`` under ``fused=``, in order. ``stock``:
    the wrapped optimizer's own step can run instead (then ``fused=False`` takes no kernel and
    ``fused=None`` no torch kernel on the CPU; otherwise ``fused=False`` takes torch's)."""
    if fused is False and stock:
        return []
    chosen = []
    for kernel in KERNELS:
        if type(optimizer) not in kernel.optimizers or kind not in kernel.kinds:
            continue
        if (fused == "torch" or fused is False) and kernel.name != "torch":
            continue
        if fused in ("compiled", "triton") and kernel.name != fused:
            continue
        if kernel.only_named_on_cpu and all_cpu and fused != kernel.name:
            continue
        if kernel.name == "amp_plugin" and ops is None:
            continue
        if fused is None and all_cpu and stock and not kernel.automatic_on_cpu:
            continue
        if kernel.ineligible(optimizer, False) is None:
            chosen.append(kernel)
    return chosen


_ALL_KINDS = frozenset({"fp32", "bf16_split", "stochastic"})
_ADAM = (torch.optim.Adam, torch.optim.AdamW)


@torch.no_grad()
def _run_amp_plugin(call: StepCall) -> bool:
    factor = None if call.inv_on is None else call.inv_on(torch.device("cpu"))
    inv = 1.0 if factor is None else float(factor)
    if call.kind.has_fp32_tensor:
        unwritten = _adam.adam_step(
            call.ops,
            call.optimizer,
            call.grads,
            call.index_of,
            call.models,
            inv,
            call.moments_dtype,
            call.keys if call.sr_moments else None,
        )
        if unwritten is None:
            return False
        if unwritten:
            models, masters = zip(*unwritten)
            torch._foreach_copy_(list(models), list(masters))
        return True
    remainders = [r.remainder for r in call.records]
    return _adam.bf16_adam_step(
        call.ops,
        call.optimizer,
        call.grads,
        call.index_of,
        call.models,
        remainders,
        call.keys,
        inv,
        call.moments_dtype,
        call.sr_moments,
    )


def _with_passes(passes: Passes, name: str) -> Callable[[StepCall], bool]:
    """The multi-tensor step with the lean bit handling of ``passes``, where they run on every
    device of the step; otherwise it declines (the next kernel runs the step)."""

    @torch.no_grad()
    def run(call: StepCall) -> bool:
        devices = {p.device for g in call.optimizer.param_groups for p in g["params"]}
        strict = call.fused == name
        if not all(passes.available(device, strict) for device in devices):
            return False  # nothing changed
        return _run_torch(call, passes)

    return run


def _sparse(call: StepCall) -> bool:
    """Whether a gradient of the step is sparse (a master's, or an FP32 parameter's own)."""
    own = (p.grad for g in call.optimizer.param_groups for p in g["params"] if id(p) not in call.index_of)
    return any(g is not None and g.is_sparse for g in (*call.grads, *own))


@torch.no_grad()
def _run_torch(call: StepCall, passes: Passes | None = None) -> bool:
    if _sparse(call):  # declined: the optimizer's own step refuses sparse gradients in torch's words
        return False
    _multi_tensor.torch_adam_step(
        call.optimizer,
        call.grads,
        call.index_of,
        call.models,
        call.records,
        call.kind,
        call.keys,
        call.moments_dtype,
        call.sr_moments,
        passes,
        call.inv_on,
    )
    if call.kind.has_fp32_tensor:
        pairs = [(call.models[i], r.master) for i, r in enumerate(call.records) if call.grads[i] is not None]
        if pairs:
            models, masters = zip(*pairs)
            torch._foreach_copy_(list(models), list(masters))
    return True


register_kernel(
    StepKernel(
        name="amp_plugin",
        optimizers=_ADAM,
        kinds=_ALL_KINDS,
        device_type="cpu",
        automatic_on_cpu=True,
        ineligible=lambda opt, to_come: _adam.adam_ineligible(opt, to_come, device_type="cpu"),
        run=_run_amp_plugin,
        reads_half_grad=lambda grad: grad.is_cpu,
    )
)
for _name, _passes in (("triton", _triton), ("compiled", _compiled)):  # most preferred first
    register_kernel(
        StepKernel(
            name=_name,
            optimizers=_ADAM,
            kinds=_ALL_KINDS,
            device_type=None,
            automatic_on_cpu=False,
            ineligible=lambda opt, to_come: _adam.adam_ineligible(opt, to_come, device_type=None),
            run=_with_passes(_passes, _name),
            reads_half_grad=lambda grad: True,  # upcast a slab at a time (_multi_tensor._Targets.step)
            only_named_on_cpu=True,
        )
    )
register_kernel(
    StepKernel(
        name="torch",
        optimizers=_ADAM,
        kinds=_ALL_KINDS,
        device_type=None,
        automatic_on_cpu=False,
        ineligible=lambda opt, to_come: _adam.adam_ineligible(opt, to_come, device_type=None),
        run=_run_torch,
        reads_half_grad=None,
    )
)
