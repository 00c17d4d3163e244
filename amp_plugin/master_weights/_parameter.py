"""The FP32 master of a half-precision model parameter: :class:`MasterParameter`, and the
record that ties it to its model parameter.

A master's gradient is transient. Between ``scaler.unscale_(opt)`` (or ``opt.sync_grads()``, or
a first read without either) and the end of the step it *is* the model's gradient times the
unscale factor, but nothing is stored until someone reads it: reading ``master.grad`` from Python (clipping, a hook, a
callback) materializes ``model_grad.float() * inv_scale`` into an FP32 buffer, which the step
then uses as it finds it (clipped, edited, replaced). The fused step reads the half gradient
itself where nobody did. C++ code (kernels, autograd) sees the tensor's own ``grad`` slot,
never the Python property, and autograd never writes a master's gradient: masters are not in
any graph.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, SupportsIndex, TypeVar, cast

import torch
from torch.utils.weak import WeakIdKeyDictionary

from amp_plugin.dtypes import HALF_DTYPES

__all__ = ["MasterParameter", "is_wrapped"]

_T = TypeVar("_T")


class _Slot(Protocol[_T]):
    """A getset descriptor of torch's C tensor (the stubs type the class attribute as its value)."""

    def __get__(self, obj: torch.Tensor, objtype: type | None = None, /) -> _T: ...

    def __set__(self, obj: torch.Tensor, value: _T, /) -> None: ...


# The tensor's own slots, under the Python properties MasterParameter puts over them.
GRAD_SLOT = cast("_Slot[torch.Tensor | None]", torch._C.TensorBase.grad)
REQUIRES_GRAD_SLOT = cast("_Slot[bool]", torch._C.TensorBase.requires_grad)


class _Session(Protocol):  # the gradient session of a MasterWeightOptimizer step (see _grads.py)
    def materialize(self, index: int) -> torch.Tensor | None: ...

    def override(self, index: int) -> None: ...


class MasterParameter(torch.nn.Parameter):
    """The FP32 master copy of one FP16/BF16 model parameter (made by
    :class:`~amp_plugin.MasterWeightOptimizer`, which puts it in the wrapped optimizer's
    param groups).

    Two attributes differ from a plain ``Parameter``:

    - ``grad``: the gradient the next step will use. From ``scaler.unscale_(opt)`` or
      ``opt.sync_grads()`` until the step ends, reading it returns the unscaled FP32 gradient,
      made on the first read from the model's gradient (``model_grad.float() * inv_scale``:
      the bits a copy-then-unscale pass stores) and kept until the step, which uses it as it
      then is (clipped in place, replaced by assignment, or set to ``None`` to leave the
      parameter out). A read with neither (a plain loop without a scaler) starts the same
      from the model's gradient, unscaled by nothing. The step frees it. Not read, it costs no
      memory: the fused step reads the half gradient directly. ``None`` while the model
      parameter has no gradient.
    - ``requires_grad``: the model parameter's. Setting it (``p.requires_grad = False`` or
      ``p.requires_grad_(False)``, as Lightning's ``toggle_optimizer`` does to the other
      optimizers' parameters) sets the model parameter's too, so freezing an optimizer's
      parameters freezes the model.

    Copies (``copy.deepcopy``, pickling) are plain ``torch.nn.Parameter``s holding the master's
    values; a copy of the :class:`~amp_plugin.MasterWeightOptimizer` holding it makes them masters of
    the copied model parameters again. Do not build one yourself.
    """

    _amp_model: Any  # weakref.ref to the model parameter
    _amp_owner: Any  # weakref.ref to the MasterWeightOptimizer that adopted it or began a step with it last
    _amp_pending: tuple[_Session, int] | None
    _amp_grad: torch.Tensor | None  # what the grad slot holds, as this class wrote it (read without a C call)

    @staticmethod
    def of(model_param: torch.Tensor) -> MasterParameter:
        """A new master for ``model_param``: an FP32 contiguous copy of its values."""
        data = torch.empty(model_param.shape, dtype=torch.float32, device=model_param.device)
        with torch.no_grad():
            data.copy_(model_param)
        return MasterParameter.over(data, model_param)

    @staticmethod
    def placeholder(model_param: torch.Tensor) -> MasterParameter:
        """A master without values, for kinds that keep the FP32 value elsewhere: FP32, shaped
        like ``model_param``, one NaN element broadcast (4 bytes). It is the optimizer state's
        key and carries the FP32 master gradient."""
        data = torch.full((1,), float("nan"), dtype=torch.float32, device=model_param.device)
        return MasterParameter.over(data.as_strided(tuple(model_param.shape), (0,) * model_param.dim()), model_param)

    @staticmethod
    def over(data: torch.Tensor, model_param: torch.Tensor) -> MasterParameter:
        """The master of ``model_param`` over ``data`` as it is (its values, or a placeholder's broadcast
        element): also how a copy of a wrapper makes its masters again from their plain copies."""
        master = torch.Tensor._make_subclass(MasterParameter, data, model_param.requires_grad)
        master._amp_model = weakref.ref(model_param)
        master._amp_owner = _nobody
        master._amp_pending = None
        master._amp_grad = None
        return master

    def model_param(self) -> torch.Tensor | None:
        """The model parameter this is the master of (``None`` once it is gone)."""
        return self._amp_model()

    # ------------------------------------------------------------------ grad
    @property
    def grad(self) -> torch.Tensor | None:
        owner = self._amp_owner()
        session = None if owner is None else owner._session
        if session is None or session.auto:
            self._amp_sync(owner, session)
        g = self._amp_grad
        if g is None:
            pending = self._amp_pending
            g = pending[0].materialize(pending[1]) if pending is not None else GRAD_SLOT.__get__(self)
        return g

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        pending = self._amp_pending
        if pending is not None:
            self._amp_pending = None
            pending[0].override(pending[1])
        set_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    def _amp_sync(self, owner: Any, session: Any) -> None:
        """A read with no step under way (no ``unscale_``, no ``sync_grads()``): start the
        step's gradients from the model's (as ``sync_grads()`` does), so that the read
        (``clip_grad_norm_(opt.master_params(), c)`` before ``opt.step()``) gets the gradient
        the step will use, and the step uses it as the read left it. Before a loss scaler's
        ``unscale_`` that is the model's gradient, still scaled (as torch's own ``p.grad`` is
        then); ``unscale_`` starts afresh. A backward after such a read is taken in: the
        gradients it changed are read anew."""
        if session is not None:
            session.renew(owner._index_of[id(self)])
            return
        model = self._amp_model()
        if owner is not None and model is not None and model.grad is not None:
            owner.sync_grads()
            if owner._session is not None:
                owner._session.auto = True

    # ------------------------------------------------------------------ requires_grad
    @property
    def requires_grad(self) -> bool:
        model = self._amp_model()
        return REQUIRES_GRAD_SLOT.__get__(self) if model is None else model.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        REQUIRES_GRAD_SLOT.__set__(self, value)
        model = self._amp_model()
        if model is not None:
            model.requires_grad = value

    def requires_grad_(self, requires_grad: bool = True) -> MasterParameter:
        self.requires_grad = requires_grad
        return self

    # ------------------------------------------------------------------ copies
    def __deepcopy__(self, memo: dict) -> torch.nn.Parameter:
        if id(self) not in memo:
            data = self.data  # its storage copied and viewed alike: a placeholder stays one element
            storage = data.untyped_storage().clone()
            copy = data.new_empty(0).set_(storage, data.storage_offset(), data.shape, data.stride())
            memo[id(self)] = torch.nn.Parameter(copy, REQUIRES_GRAD_SLOT.__get__(self))
        return memo[id(self)]

    def __reduce_ex__(self, proto: SupportsIndex) -> tuple:
        return torch._utils._rebuild_parameter, (self.data, REQUIRES_GRAD_SLOT.__get__(self), {})

    def __repr__(self) -> str:  # type: ignore[override]  # torch's takes a tensor_contents keyword, unused here
        return "MasterParameter containing:\n" + torch.Tensor.__repr__(self.data)


def _nobody() -> None:
    return None


def set_grad(master: MasterParameter, value: torch.Tensor | None) -> None:
    """Write a master's grad slot (and the copy the ``grad`` property reads)."""
    GRAD_SLOT.__set__(master, value)
    master._amp_grad = value


class Record:
    """What every :class:`~amp_plugin.MasterWeightOptimizer` over one half-precision model
    parameter shares: its master, and when the two were last in sync.

    ``version`` and ``ptr`` are the parameter's ``_version`` and ``data_ptr()`` as they were
    right after the last copy between the two (either way): any in-place write to the
    parameter since then (``zero_()``, ``copy_()``, ``load_state_dict``, an init function)
    changes ``_version``, and ``param.data = other`` changes ``data_ptr()``.

    ``acc`` holds the parameter's FP32 gradient sum while gradients are accumulated over
    several backward passes (:mod:`amp_plugin.master_weights._accumulate`).

    ``master`` is the :class:`MasterParameter` (for the kinds without an FP32 tensor, a
    placeholder: see ``_kinds.py``); ``remainder`` the int16 remainder of ``master="bf16_split"``
    (shaped like the parameter), else ``None``; ``kind`` the master kind's name.
    """

    __slots__ = ("acc", "kind", "master", "ptr", "remainder", "version")

    def __init__(
        self, master: MasterParameter, remainder: torch.Tensor | None, version: int, ptr: int, kind: str = "fp32"
    ) -> None:
        self.acc: Any = None  # the FP32 sum of an accumulation window (see _accumulate.py), once hooked
        self.master = master
        self.remainder = remainder
        self.kind = kind
        self.version = version
        self.ptr = ptr


# Model parameter -> its Record, while the parameter lives: two wrappers over one parameter
# (two optimizers, a GAN's shared layer) share one master, so neither undoes the other's update.
MASTERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Every master made here, and every optimizer wrapped: what a second wrapper must refuse.
MASTER_TENSORS: WeakIdKeyDictionary = WeakIdKeyDictionary()
WRAPPED: weakref.WeakSet = weakref.WeakSet()


def is_wrapped(optimizer: Any) -> bool:
    """Whether ``optimizer`` is the inner optimizer of a :class:`~amp_plugin.MasterWeightOptimizer`
    (its param groups hold FP32 masters), which no second wrapper may take."""
    return optimizer in WRAPPED


def refresh(model_p: torch.Tensor, record: Record) -> None:
    """Re-copy the master if the model parameter was written since the last sync."""
    if model_p._version != record.version or model_p.data_ptr() != record.ptr:
        resync(model_p, record)


@torch.no_grad()
def resync(model_p: torch.Tensor, record: Record) -> None:
    """Copy the model parameter into its master (after a write the wrapper did not make), as
    the record's kind does it (a split master's remainder is cleared: the master is then the
    weight, exactly)."""
    from amp_plugin.master_weights._kinds import KINDS

    like = record.master
    if (
        model_p.dtype not in HALF_DTYPES
        or model_p.shape != like.shape
        or model_p.device != like.device
        or (record.kind != "fp32" and model_p.dtype is not torch.bfloat16)
    ):
        raise RuntimeError(
            f"A model parameter wrapped by MasterWeightOptimizer changed from {tuple(like.shape)} "
            f"half precision on {like.device} to {model_p.dtype} {tuple(model_p.shape)} on {model_p.device} "
            "(param.data = ..., or model.float()/.to() after the optimizer was built): its FP32 master "
            "and optimizer state no longer fit. Convert or resize the model first, then build the "
            "optimizer and the MasterWeightOptimizer."
        )
    KINDS[record.kind].resync(model_p, record)
    record.version, record.ptr = model_p._version, model_p.data_ptr()
