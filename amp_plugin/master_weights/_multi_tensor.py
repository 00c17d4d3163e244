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
bits, or to nearest). These FP32 copies live for one group's step.

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

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.optim import Optimizer

from amp_plugin.adam_rule import as_float, init_state
from amp_plugin.master_weights import _compiled
from amp_plugin.master_weights._parameter import Record
from amp_plugin.master_weights._passes import Passes
from amp_plugin.master_weights._stochastic import moments_key, round_stochastic

__all__ = ["torch_adam_step"]


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
    one per group), the same bits.
    """
    lean = kind is not None and not kind.has_fp32_tensor
    adamw_default = isinstance(optimizer, torch.optim.AdamW)
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
        targets = _pass_targets(params, indices, exp_avgs, lean, models, records, passes) if passes else []
        for target in targets:
            target.prepare(values, exp_avgs, exp_avg_sqs)
        for j in low if passes is None else ():  # BF16 moments: computed in FP32, rounded once when stored
            exp_avgs[j] = exp_avgs[j].float()
            exp_avg_sqs[j] = exp_avg_sqs[j].float()
        grouped = cast(  # its lists hold no None: every list given has a tensor at every index
            "dict[tuple[torch.device, torch.dtype], tuple[list[list[torch.Tensor]], list[int]]]",
            Optimizer._group_tensors_by_device_and_dtype(
                [  # one C++ call, as torch's fused Adam
                    values,
                    group_grads,
                    exp_avgs,
                    exp_avg_sqs,
                    [s["step"] for s in states],
                ]
            ),
        )
        beta1, beta2 = group["betas"]
        decoupled = bool(group.get("decoupled_weight_decay", adamw_default))
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        lr = group["lr"]
        for (device, _), ((d_params, d_grads, d_exp_avgs, d_exp_avg_sqs, d_steps), _) in grouped.items():
            torch._foreach_add_(d_steps, 1)
            # as torch's fused Adam: a tensor lr moves to a CUDA device, a CPU one stays
            d_lr: Any = (
                lr.to(device)
                if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != device
                else lr
            )
            kernel(
                d_params,
                d_grads,
                d_exp_avgs,
                d_exp_avg_sqs,
                [],
                d_steps,
                amsgrad=False,
                lr=d_lr,
                beta1=as_float(beta1),
                beta2=as_float(beta2),
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                grad_scale=None,
                found_inf=None,
            )
        if passes is not None:
            for target in targets:
                target.store(values, states, exp_avgs, exp_avg_sqs, cast("list", keys), sr_moments)
            continue
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

    def prepare(self, values: list[Any], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor]) -> None:
        """The FP32 values and moments of the step, through the passes' ``prepare``: in place of the
        entries of ``values``, ``exp_avgs`` and ``exp_avg_sqs`` at :attr:`js`."""
        moments = ([exp_avgs[j] for j in self.js], [exp_avg_sqs[j] for j in self.js]) if self.bf16_moments else None
        new_values, m32s, v32s = self.passes.prepare(self.weights, self.remainders, moments)
        for n, j in enumerate(self.js):
            if new_values is not None:
                values[j] = new_values[n]
            if m32s is not None:
                exp_avgs[j], exp_avg_sqs[j] = m32s[n], cast("list", v32s)[n]

    def store(
        self,
        values: list[torch.Tensor],
        states: list[dict[str, Any]],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        keys: list[int],
        sr_moments: bool,
    ) -> None:
        """What the torch ops store, through the passes' ``store``."""
        js = self.js
        moments = None
        if self.bf16_moments:
            moments = (
                [exp_avgs[j] for j in js],
                [exp_avg_sqs[j] for j in js],
                [states[j]["exp_avg"] for j in js],
                [states[j]["exp_avg_sq"] for j in js],
            )
        rows = [(keys[i], moments_key(keys[i])) for i in self.indices]
        keys_t = self.passes.keys_tensor(rows, self.device)
        self.passes.store([values[j] for j in js], self.weights, self.remainders, moments, keys_t, sr_moments)


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
