"""How a :class:`~amp_plugin.MasterWeightOptimizer` takes a param group of the optimizer it wraps.

Each half-precision parameter gets its master (one per parameter: a second wrapper over it shares
the first one's, and must keep the same master kind), the master takes the parameter's place in
the group, existing optimizer state moves over to it (upcast; the moments to their dtype), and,
with FP32 accumulation, the parameter's accumulation hooks are attached
(:mod:`amp_plugin.master_weights._accumulate`). FP32 parameters are their own master.

A copy of a wrapper (``copy.deepcopy``, pickling) holds plain copies of its masters
(``MasterParameter.__reduce_ex__``); :func:`readopt` makes them masters of the copy's model parameters again.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.master_weights import _accumulate
from amp_plugin.master_weights._parameter import MASTER_TENSORS, MASTERS, WRAPPED, MasterParameter, refresh
from amp_plugin.master_weights._refusals import already_wrapped, check_kind_possible, refuse_dtensors, upcast_state

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = ["add_group", "adopt_group", "readopt"]


def add_group(opt: MasterWeightOptimizer, param_group: dict[str, Any]) -> None:
    """What :meth:`~amp_plugin.MasterWeightOptimizer.add_param_group` does: add the group to the
    wrapped optimizer, refuse it (and take it out again) if ``opt`` cannot hold it, adopt it."""
    opt.optimizer.add_param_group(param_group)
    group = opt.optimizer.param_groups[-1]
    held = {id(t) for t in (*opt._model_params, *opt._master_params)}
    if any(id(p) in held for p in group["params"]):
        opt.optimizer.param_groups.pop()
        raise ValueError(
            "some parameters appear in more than one parameter group: the new group repeats a parameter "
            "this MasterWeightOptimizer already holds (as a model parameter or as its FP32 master). Give "
            "each parameter to one group only."
        )
    if any(p in MASTER_TENSORS for p in group["params"]):
        opt.optimizer.param_groups.pop()
        raise ValueError(already_wrapped("the new group"))
    try:
        refuse_dtensors(opt.optimizer)
        check_kind_possible(opt.optimizer, opt._kind)
    except (TypeError, ValueError):
        opt.optimizer.param_groups.pop()
        raise
    adopt_group(opt, group)


def adopt_group(opt: MasterWeightOptimizer, group: dict[str, Any]) -> None:
    """Put the masters of ``group``'s half-precision parameters in their place in the group (see the
    module docstring) and note every parameter in ``opt``'s lists, in order."""
    params = group["params"]
    kind = opt._kind
    for i, p in enumerate(params):
        if p.dtype in HALF_DTYPES:
            record = MASTERS.get(p)
            if record is None:
                record = MASTERS[p] = kind.new_record(p)
                MASTER_TENSORS[record.master] = True
            else:  # another wrapper holds this parameter: share its master
                if record.kind != kind.name:
                    raise ValueError(
                        f"master={opt.master!r} is not possible for a parameter another MasterWeightOptimizer "
                        f"holds with master={record.kind!r}: one master per parameter. Give every optimizer "
                        "over it the same master kind."
                    )
                refresh(p, record)
            master = record.master
            if p in opt.optimizer.state:  # move existing state over, upcast (moments: to their dtype)
                opt.optimizer.state[master] = opt.optimizer.state.pop(p)
            if master in opt.optimizer.state:
                old = opt.optimizer.state[master]
                opt.optimizer.state[master] = {k: upcast_state(v, p, opt.moments_dtype) for k, v in old.items()}
            params[i] = master
            master._amp_owner = weakref.ref(opt)
            if opt._accumulate_fp32:
                _accumulate.attach(p, record, opt, opt._accumulators)
            opt._half_models.append(p)
            opt._half_masters.append(master)
            opt._records.append(record)
            opt._index_of[id(master)] = len(opt._half_models) - 1
        else:
            master = p
            opt._own.append(p)
        opt._model_params.append(p)
        opt._master_params.append(master)


def readopt(opt: MasterWeightOptimizer) -> None:
    """Make a copy of a wrapper whole again: its masters' plain copies become the masters of its
    (copied) model parameters, in its param groups, optimizer state and lists, over the copied
    values and remainders; the records are registered (so another wrapper over the copied
    parameters shares them), the accumulation hooks attached, the copied parameters in sync with
    their masters. Wrappers copied together (two optimizers over one shared layer) share the copied
    records, so the second one takes the masters the first one made."""
    if all(isinstance(m, MasterParameter) for m in opt._half_masters):
        return  # a shallow copy (copy.copy): the original's masters and lists, nothing copied
    swap: dict[int, tuple[torch.Tensor, MasterParameter]] = {}
    for i, (model_p, record) in enumerate(zip(opt._half_models, opt._records, strict=True)):
        copied = opt._half_masters[i]
        if not isinstance(record.master, MasterParameter):  # the first wrapper over this record
            record.master = MasterParameter.over(record.master.data, model_p)
            MASTERS[model_p] = record
            MASTER_TENSORS[record.master] = True
            record.version, record.ptr = model_p._version, model_p.data_ptr()
        master = record.master
        master._amp_owner = weakref.ref(opt)
        swap[id(copied)] = (copied, master)
        opt._half_masters[i] = master
        if opt._accumulate_fp32:
            _accumulate.attach(model_p, record, opt, opt._accumulators)
    opt._index_of = {id(m): i for i, m in enumerate(opt._half_masters)}
    opt._master_params = [swap[id(p)][1] if id(p) in swap else p for p in opt._master_params]
    for group in opt.optimizer.param_groups:
        group["params"] = [swap[id(p)][1] if id(p) in swap else p for p in group["params"]]
    state = opt.optimizer.state
    for copied, master in swap.values():
        if copied in state:
            state[master] = state.pop(copied)
    WRAPPED.add(opt.optimizer)
