"""The master-weight Adam/AdamW step with torch's multi-tensor kernels, on any device.

This is the path for CUDA (and any non-CPU) tensors, and, forced with ``fused="torch"``,
on the CPU. Per device, whatever the number of parameters:

1. unscale (``scaler.unscale_``): new FP32 copies of the half gradients from one
   ``torch._foreach_mul`` by a one-element FP32 tensor (type promotion: an exact upcast that
   allocates every output in one op), then ``torch._amp_foreach_non_finite_check_and_unscale_``
   on them (the unscale and the inf check);
2. the skip decision: the scaler reads the found-inf flag (the one host sync);
3. ``torch._foreach_add_`` on the step counters and ``torch._fused_adam_``/``_fused_adamw_``
   on the FP32 masters (what ``torch.optim.Adam(fused=True).step()`` runs, so the masters get
   the same bits), with the hyperparameters as the group holds them (a tensor ``lr`` stays
   on its device);
4. ``torch._foreach_copy_`` of the masters into the half-precision model parameters.

The kinds without an FP32 master tensor (``master="bf16_split"``, ``"stochastic"``) run the
same kernel on FP32 values rebuilt for the step (the weight joined with its remainder, or the
weight upcast), then store the results their way (split, or rounded stochastically); BF16
moments are upcast for the kernel and rounded back into their BF16 tensors (stochastically with
the moments' key of :func:`~amp_plugin.master_weights._stochastic.moments_key`, the CPU kernel's
bits, or to nearest). With the fused passes (``passes``) these FP32 copies are made for one slab of at
most :data:`SLAB_ELEMENTS` elements at a time (:meth:`_Targets.step`), with the torch ops for one group;
and so are the FP32 gradients of the half ones the step is handed as they are (no loss scaler, or one
whose ``unscale_`` left them to the step): step 1 runs per slab, over its pieces.

The FP32 gradients are dropped when the step ends. Python only gathers references (the
gradients, the state tensors) into lists: no per-parameter tensor op, no host sync. (The
upcast's outputs have the gradients' shapes, so it takes ``_foreach_mul``'s general path:
one launch per tensor on CUDA, issued from C++.)

torch's fused Adam takes a ``grad_scale`` to unscale on the fly, but only for gradients of
the parameters' own dtype (FP32 here), and it divides by the scale where the unscale
multiplies by its reciprocal (different bits unless the scale is a power of two): the copy
into FP32 is needed anyway, so the unscale happens there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.optim import Optimizer

from amp_plugin.adam_rule import fused_adam_update, init_state
from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.master_weights import _compiled
from amp_plugin.master_weights._grads import eager_unscale
from amp_plugin.master_weights._parameter import Record
from amp_plugin.master_weights._passes import Passes
from amp_plugin.master_weights._stochastic import moments_key, offset_key, round_stochastic

L = list[torch.Tensor]
__all__ = ["slabs", "torch_adam_step"]


@torch.no_grad()
def torch_adam_step(
    optimizer: Optimizer,
    grads: list[torch.Tensor | None],
    index_of: dict[int, int],
    models: list[torch.Tensor] | None = None,
    records: list[Record] | None = None,
    kind: Any = None,
    keys: list[int] | None = None,
    moments_dtype: torch.dtype = torch.float32,
    sr_moments: bool = False,
    passes: Passes | None = None,
    inv_on: Callable[[torch.device], torch.Tensor | None] | None = None,
) -> None:
    """One Adam/AdamW step of ``optimizer`` over FP32 masters with torch's fused kernel.

    ``grads[index_of[id(master)]]``: the FP32 gradient of each half-precision parameter's
    master (``None``: not stepped); parameters that are their own master (absent from
    ``index_of``) use their ``.grad``. State is initialised as ``torch.optim.Adam(fused=True)``
    does. With ``kind`` (a master kind without an FP32 tensor, from ``_kinds.py``) the values
    are rebuilt from ``models``/``records`` and stored back by it (``keys``: the stochastic
    rounding keys by index); otherwise the caller copies the stepped masters into the model.
    ``sr_moments``: BF16 moments rounded stochastically with the moment keys of ``keys[i]``.
    ``passes``: the joins and stores of the lean kinds and BF16 moments run as fused passes
    (:mod:`amp_plugin.master_weights._compiled`: one per tensor, :mod:`~amp_plugin.master_weights._triton`:
    one per group), the same bits. With ``passes`` a gradient may also be the model's half one (dense,
    contiguous), ``grad.float() * inv_on(device)`` in FP32 (``inv_on`` ``None``: not scaled), upcast a slab
    at a time.
    """
    lean = kind is not None and not kind.has_fp32_tensor
    for group in optimizer.param_groups:
        params, group_grads, indices = [], [], []
        values: list[Any] = []
        for p in group["params"]:
            i = index_of.get(id(p))
            g = p.grad if i is None else grads[i]
            if g is not None:
                params.append(p)
                group_grads.append(g)
                indices.append(i)
                if lean and i is not None and passes is None:
                    values.append(kind.step_value(cast("list", models)[i], cast("list", records)[i]))
                elif lean and i is not None:
                    values.append(None)  # from passes.prepare, below
                else:
                    values.append(p)
        if not params:
            continue
        states = [
            init_state(optimizer, p, moments_dtype if i is not None else torch.float32) for p, i in zip(params, indices)
        ]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        low = [j for j, m in enumerate(exp_avgs) if m.dtype is not torch.float32]
        if passes is not None:
            targets = _pass_targets(params, indices, exp_avgs, lean, models, records, passes)
            handled = {j for target in targets for j in target.js}
            rest = [j for j in range(len(params)) if j not in handled]
            lists = [values, group_grads, exp_avgs, exp_avg_sqs, [s["step"] for s in states]]
            rest_lists = [[x[j] for j in rest] for x in lists]
            rest_lists[1] = _fp32_grads(rest_lists[1], inv_on)  # FP32 masters' half gradients, whole
            fused_adam_update(group, optimizer, rest_lists, increment=True)
            for target in targets:
                target.step(group, optimizer, lists, cast("list", keys), sr_moments, inv_on)
            continue
        for j in low:  # BF16 moments: computed in FP32, rounded once when stored
            exp_avgs[j] = exp_avgs[j].float()
            exp_avg_sqs[j] = exp_avg_sqs[j].float()
        fused_adam_update(
            group, optimizer, [values, group_grads, exp_avgs, exp_avg_sqs, [s["step"] for s in states]], increment=True
        )
        for j in low:
            if sr_moments:
                key = moments_key(cast("list", keys)[cast("int", indices[j])])
                round_stochastic(exp_avgs[j], states[j]["exp_avg"], key)
                round_stochastic(exp_avg_sqs[j], states[j]["exp_avg_sq"], key, low=True)
            else:
                states[j]["exp_avg"].copy_(exp_avgs[j])
                states[j]["exp_avg_sq"].copy_(exp_avg_sqs[j])
        if lean:
            for value, i in zip(values, indices):
                if i is not None:
                    kind.store(cast("list", models)[i], cast("list", records)[i], value, cast("list", keys)[i])


SLAB_ELEMENTS = 1 << 24
"""Elements per slab of the passes' step: the most FP32 values, moments (12 bytes an element) the step
holds at once beyond its gradients, 192 MiB, where a group's whole would be 12 bytes per parameter. A
multiple of 8 (torch's CPU vector width, see :meth:`_Targets.step`). Not smaller on the CPU: the compiled
passes there are not bound by memory traffic (at ``2**18``, which the cache holds, a step of 4M parameters
took 38 ms against 34 ms in one slab on an Ice Lake Xeon, AVX-512, one thread: each slab costs some
0.3 ms of host work)."""


def slabs(numels: Sequence[int], limit: int) -> Iterator[list[tuple[int, int, int]]]:
    """The tensors of ``numels`` cut into pieces ``(n, start, stop)`` at the multiples of ``limit`` of each
    tensor's flat index, gathered in order into slabs of at most ``limit`` elements."""
    slab: list[tuple[int, int, int]] = []
    size = 0
    for n, numel in enumerate(numels):
        for start in range(0, max(numel, 1), limit):
            stop = min(numel, start + limit)
            if slab and size + stop - start > limit:
                yield slab
                slab, size = [], 0
            slab.append((n, start, stop))
            size += stop - start
    if slab:
        yield slab


def _piece(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t.detach().view(-1)[start:stop]


def _fp32_grads(grads: list[Any], inv_on: Callable[[torch.device], torch.Tensor | None] | None) -> list[Any]:
    """``grads`` with each half one (dense, contiguous) replaced by ``grad.float() * inv_on(device)`` in FP32,
    one multi-tensor copy and unscale per device (``eager_unscale``; ``inv_on`` ``None``: not scaled)."""
    half = [k for k, g in enumerate(grads) if g.dtype in HALF_DTYPES]
    if not half:
        return grads
    out = list(grads)
    for device in {grads[k].device for k in half}:
        index = [k for k in half if grads[k].device == device]
        factor = None if inv_on is None else inv_on(device)
        for k, copy in zip(index, eager_unscale([grads[k] for k in index], factor, None)):
            out[k] = copy
    return out


def _dense(tensors: list[Any], written: list[tuple[torch.Tensor, torch.Tensor]] | None) -> list[Any]:
    """``tensors`` (``None`` entries kept) with a contiguous copy in place of each strided one (a channels_last
    weight, its gradient): the passes pair elements, and hash them, by their index in the tensor's logical
    order, as the torch ops do. The copies of the tensors the step writes are added to ``written``
    (``None``: read only), to be copied back."""
    out = []
    for t in tensors:
        if t is None or t.is_contiguous():
            out.append(t)
            continue
        copy = t.detach().contiguous()
        out.append(copy)
        if written is not None:
            written.append((t.detach(), copy))
    return out


@dataclass
class _Targets:
    """The positions of one group's tensors on one ``device`` whose bits the fused ``passes`` handle (a
    lean kind's weights, or BF16 moments), tensors of two elements or more first
    (:func:`_compiled.size_class`: fewer batch patterns), with what the passes read of them."""

    passes: Passes
    device: torch.device
    js: list[int]  # positions in the group's lists
    indices: list[int]  # their indices in the wrapper's model parameters (and keys)
    weights: list[torch.Tensor] | None  # the lean kinds' BF16 weights; None: FP32 masters
    remainders: list[torch.Tensor] | None  # bf16_split's
    bf16_moments: bool

    def step(
        self,
        group: dict[str, Any],
        optimizer: Optimizer,
        lists: list[list[Any]],
        keys: list[int],
        sr_moments: bool,
        inv_on: Callable[[torch.device], torch.Tensor | None] | None = None,
    ) -> None:
        """The update of these tensors (``lists``: the group's values, gradients, moments and step counters)
        slab by slab (:func:`slabs`): the passes build a slab's FP32 values and moments (and FP32 gradients,
        where the model's half ones come: upcast and unscaled with ``inv_on``), torch's fused Adam
        updates them, the passes store them. torch's fused Adam computes each element alike wherever a
        tensor is cut (on the CPU: its scalar tail is the last ``numel % 8`` elements of each call, and the
        cuts fall on multiples of the slab size, so only a tensor's last piece has one, the same elements),
        and a piece's rounding keys are its tensor's, offset to its first element
        (:func:`~amp_plugin.master_weights._stochastic.offset_key`): the bits of one pass over whole tensors,
        with FP32 copies of one slab at a time, never of a whole group."""
        written: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a strided tensor the step writes, its copy)
        values, grads, exp_avgs, exp_avg_sqs, steps = ([x[j] for j in self.js] for x in lists)
        values, exp_avgs, exp_avg_sqs = (_dense(x, written) for x in (values, exp_avgs, exp_avg_sqs))
        weights, remainders = (None if x is None else _dense(x, written) for x in (self.weights, self.remainders))
        mine = [values, _dense(grads, None), exp_avgs, exp_avg_sqs, steps]
        torch._foreach_add_(steps, 1)
        for slab in slabs([g.numel() for g in grads], SLAB_ELEMENTS):
            self._step_slab(slab, group, optimizer, mine, weights, remainders, keys, sr_moments, inv_on)
        for tensor, copy in written:
            tensor.copy_(copy)

    def _step_slab(
        self,
        slab: list[tuple[int, int, int]],
        group: dict[str, Any],
        optimizer: Optimizer,
        lists: list[list[Any]],
        weights: L | None,
        remainders: L | None,
        keys: list[int],
        sr_moments: bool,
        inv_on: Callable[[torch.device], torch.Tensor | None] | None,
    ) -> None:
        """The pieces ``slab`` of these tensors (``lists``, ``weights``, ``remainders``: theirs, in :attr:`js`'s
        order, contiguous) prepared, updated and stored; the FP32 copies are freed on return, before the next
        slab's are made. The FP32 gradients of half ones: from the passes' prepare where it makes them (the
        Triton kernels), else upcast and unscaled by torch's multi-tensor ops (:func:`_fp32_grads`)."""
        values, grads, exp_avgs, exp_avg_sqs, steps = lists

        def cut(tensors: Sequence[Any]) -> L:
            return [_piece(tensors[n], a, b) for n, a, b in slab]

        w = None if weights is None else cut(weights)
        r = None if remainders is None else cut(remainders)
        m, v = cut(exp_avgs), cut(exp_avg_sqs)
        g = cut(grads)
        inv = None if inv_on is None else inv_on(self.device)
        # the passes leave a slab's gradients to torch's ops unless all are half, of one dtype (half_grads_dtype)
        new_values, m32s, v32s, g32s = self.passes.prepare(w, r, (m, v) if self.bf16_moments else None, g, inv)
        g = g32s if g32s is not None else _fp32_grads(g, inv_on)
        slab_values = new_values if new_values is not None else cut(values)
        m32, v32 = (m, v) if m32s is None or v32s is None else (m32s, v32s)
        fused_adam_update(group, optimizer, [slab_values, g, m32, v32, [steps[n] for n, _, _ in slab]], increment=False)
        rows = [
            (offset_key(keys[self.indices[n]], a), offset_key(moments_key(keys[self.indices[n]]), a))
            for n, a, _ in slab
        ]
        moments = (m32, v32, m, v) if self.bf16_moments else None
        keys_t = self.passes.keys_tensor(rows, self.device)
        self.passes.store(slab_values, w, r, moments, keys_t, sr_moments)


def _pass_targets(
    params: list[torch.Tensor],
    indices: list[int | None],
    exp_avgs: list[torch.Tensor],
    lean: bool,
    models: list[torch.Tensor] | None,
    records: list[Record] | None,
    passes: Passes,
) -> list[_Targets]:
    """The :class:`_Targets` of a group, one per device (``exp_avgs``: its state tensors, before the step)."""
    by_device: dict[torch.device, list[int]] = {}
    for j, i in enumerate(indices):
        if i is not None and (lean or exp_avgs[j].dtype is not torch.float32):
            by_device.setdefault(params[j].device, []).append(j)
    targets = []
    for device, js in by_device.items():
        js.sort(key=lambda j: -_compiled.size_class(params[j]))
        ii = [cast("int", indices[j]) for j in js]
        weights = remainders = None
        if lean:
            weights = [cast("list", models)[i] for i in ii]
            remainders = [cast("list", records)[i].remainder for i in ii]
            if remainders[0] is None:
                remainders = None
        bf16_moments = exp_avgs[js[0]].dtype is not torch.float32
        targets.append(_Targets(passes, device, js, ii, weights, remainders, bf16_moments))
    return targets
