"""The gradients of one master-weight step, from ``scaler.unscale_(opt)`` (or
``opt.sync_grads()``, or the step itself) to the end of the step.

A :class:`GradSession` records the model's half-precision gradients as it found them and
the unscale factor per device. Each half parameter's FP32 master gradient is then one of:

- *pending*: nothing stored; it is ``model_grad * inv_scale``. The fused CPU step reads the
  half gradient and the factor directly. A Python read of ``master.grad`` materializes it.
- *eager*: computed already (a new FP32 tensor), by the multi-tensor unscale
  (``torch._amp_foreach_non_finite_check_and_unscale_`` needs an FP32 tensor to write), or for
  a gradient the kernels cannot read. Handed out on the first read.
- *materialized*: in the master's ``grad`` slot (read, or set by user code); the step uses
  it as it is then. ``None`` there (set by user code) leaves the parameter out of the step.

Everything is dropped when the step ends (or on ``zero_grad``, or at the next unscale).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.master_weights import _accumulate
from amp_plugin.master_weights._parameter import set_grad

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = [
    "GradSession",
    "MasterGradWarning",
    "begin_session",
    "clear_grads",
    "eager_unscale",
    "end_session",
    "one_on",
    "take_sum",
    "unscaled_copy",
    "warn_grads_changed",
]


class MasterGradWarning(UserWarning):
    """The model's gradients changed after ``scaler.unscale_(optimizer)`` (or
    ``optimizer.sync_grads()``).

    The model's gradients are the *scaled* ones (the unscaled FP32 gradients are the masters'),
    so an edit to them acts on scaled values; where a master gradient was already read, the
    step uses that and the edit has no effect. The usual cause is
    ``clip_grad_norm_(model.parameters(), ...)`` after ``scaler.unscale_(optimizer)``: clip
    ``optimizer.master_params()`` instead.
    """


_CHANGED_MESSAGE = (
    "The model's gradients were changed after scaler.unscale_(optimizer) (or optimizer.sync_grads()). With "
    "master weights the model's gradients stay multiplied by the loss scale and the unscaled FP32 gradients are "
    "the masters': the step uses a master gradient that was read before the change as it is (the change has no "
    "effect there) and otherwise reads the changed, still scaled, model gradient (the change acts on scaled "
    "values, after the inf/NaN check). To clip, clip the master gradients between unscale_ and step: "
    "torch.nn.utils.clip_grad_norm_(optimizer.master_params(), max_norm). (Warned once per optimizer.)"
)


@torch.no_grad()
def unscaled_copy(grad: torch.Tensor, inv_scale: torch.Tensor | None, ops: Any | None = None) -> torch.Tensor:
    """A new FP32 tensor ``grad.float() * inv_scale`` (the rounding of copy-then-unscale), laid
    out contiguous; for a sparse gradient a coalesced sparse FP32 one (duplicates summed in
    FP32), its values unscaled. ``inv_scale=None``: no scaling."""
    if grad.is_sparse:
        out = grad.to(torch.float32).coalesce()
        if inv_scale is not None:
            out._values().mul_(inv_scale)
        return out
    out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    if (
        inv_scale is not None
        and ops is not None
        and grad.device.type == "cpu"
        and grad.is_contiguous()
        and grad.dtype in HALF_DTYPES
    ):
        ops.unscale_into_([grad], [out], torch.zeros((), dtype=torch.float32), inv_scale.float())
        return out
    out.copy_(grad)
    if inv_scale is not None:
        out.mul_(inv_scale)
    return out


_ONES: dict[tuple[torch.device, int], torch.Tensor] = {}


@torch.no_grad()
def eager_unscale(
    grads: list[torch.Tensor], inv_scale: torch.Tensor | None, found: torch.Tensor | None, ops: Any | None = None
) -> list[torch.Tensor]:
    """New FP32 tensors ``grad.float() * inv_scale`` for dense half ``grads`` (one device, laid
    out like them) with the inf check into ``found`` (``inv_scale=None``: a plain upcast).
    One op whatever the number of tensors, two on the torch path:

    - on the CPU with amp_plugin's kernels (``ops``): ``unscale_copy``, one pass;
    - otherwise torch's: ``torch._foreach_mul`` by a one-element FP32 tensor (type promotion:
      an exact upcast that allocates every output in one op, so no per-tensor allocation or
      view is dispatched from Python: host work on a GPU; a 0-dim gradient's product, of shape
      ``(1,)``, is viewed back as 0-dim), then
      ``torch._amp_foreach_non_finite_check_and_unscale_``. On the CPU this mixed-dtype
      multiply runs torch's unvectorised casting loop, several times slower than a copy, and first
      copies each input into a temporary FP32 tensor (kept: CI runs here what a GPU runs).
    """
    device = grads[0].device
    if found is None:
        found = torch.zeros((), dtype=torch.float32, device=device)
    if ops is not None and device.type == "cpu" and all(g.is_contiguous() for g in grads):
        return list(ops.unscale_copy(grads, found, (inv_scale if inv_scale is not None else one_on(device)).float()))
    out = list(torch._foreach_mul(grads, [one_on(device, 1)] * len(grads)))
    for i, g in enumerate(grads):
        if g.dim() == 0:  # broadcast against the (1,)-shaped one: back to the gradient's shape
            out[i] = out[i].view(())
    if inv_scale is not None:
        torch._amp_foreach_non_finite_check_and_unscale_(out, found, inv_scale)
    return out


def one_on(device: torch.device, dims: int = 0) -> torch.Tensor:
    """A cached FP32 one on ``device``: 0-dim, or (``dims=1``) of shape ``(1,)``."""
    key = (device, dims)
    one = _ONES.get(key)
    if one is None:
        one = _ONES[key] = torch.ones((1,) * dims, dtype=torch.float32, device=device)
    return one


class GradSession:
    """One step's gradients for one :class:`~amp_plugin.MasterWeightOptimizer` (see the module
    docstring). Indices are positions in the optimizer's half-precision pairs."""

    __slots__ = ("auto", "eager", "grads", "inv", "ops", "owner", "touched", "versions")

    def __init__(
        self,
        owner: MasterWeightOptimizer,
        inv: Callable[[torch.device], torch.Tensor] | None,
        grads: list[torch.Tensor | None],
        ops: Any | None,
    ) -> None:
        self.owner = owner
        self.inv = inv  # device -> the unscale factor there; None: the gradients are not scaled
        self.grads = grads  # each model gradient as found (None: no gradient)
        self.versions = [0 if g is None else g._version for g in grads]
        self.eager: dict[int, torch.Tensor] = {}  # index -> FP32 gradient computed ahead
        self.touched: set[int] = set()  # indices whose master's grad slot was filled (read or set)
        self.ops = ops
        self.auto = False  # started by reading a master's gradient, not by unscale_/sync_grads/the step

    def renew(self, index: int) -> None:
        """A session started by a read (``auto``): if the model gradient at ``index`` changed
        since (a backward ran after the read), take the new one, as if the session began now.

        Unless no backward wrote it: a model gradient changed in place while the FP32 accumulation hooks saw
        no backward (:func:`~amp_plugin.master_weights._accumulate.by_backward`) was edited, after its master's
        gradient was read or set. That is ``torch.amp.GradScaler``'s flow: its ``unscale_`` reads the
        masters' gradients and unscales them in place, then the AMP recipe's
        ``clip_grad_norm_(model.parameters())`` scales the still-scaled model gradients. The step then uses
        the master gradient as it is, with the warning of such a change; taking the model gradient applied
        it still multiplied by the loss scale."""
        grad = self.owner._half_models[index].grad
        if not self.changed(index, grad):
            return
        master = self.owner._half_masters[index]
        edited = grad is self.grads[index] and _accumulate.by_backward(self.owner._records[index], grad) is False
        if index in self.touched and master._amp_grad is not None and edited:
            self.owner._warn_grads_changed()
            self.grads[index] = grad
            self.versions[index] = 0 if grad is None else grad._version
            return
        set_grad(master, None)
        self.touched.discard(index)
        self.eager.pop(index, None)
        self.grads[index] = grad
        self.versions[index] = 0 if grad is None else grad._version
        master._amp_pending = None if grad is None else (self, index)
        take_sum(self, index, grad)

    def renew_all(self) -> None:
        for index in range(len(self.grads)):
            self.renew(index)

    def inv_on(self, device: torch.device) -> torch.Tensor | None:
        return None if self.inv is None else self.inv(device)

    def changed(self, index: int, grad: torch.Tensor | None) -> bool:
        """Whether the model gradient at ``index`` is no longer the one this session found."""
        seen = self.grads[index]
        return grad is not seen or (grad is not None and grad._version != self.versions[index])

    def current(self, index: int) -> torch.Tensor | None:
        """The model's gradient at ``index`` now (warning once if it changed)."""
        grad = self.owner._half_models[index].grad
        if self.changed(index, grad):
            self.owner._warn_grads_changed()
        return grad

    def fp32(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """The FP32 master gradient for the model gradient ``grad`` at ``index``."""
        eager = self.eager.get(index)
        if eager is not None and not self.changed(index, grad):
            return eager
        return unscaled_copy(grad, self.inv_on(grad.device), self.ops)

    def materialize(self, index: int) -> torch.Tensor | None:
        """``master.grad`` read while pending: compute it, put it in the master's grad slot."""
        master = self.owner._half_masters[index]
        master._amp_pending = None
        grad = self.current(index)
        if grad is None:
            return None
        out = self.fp32(index, grad)
        set_grad(master, out)
        self.touched.add(index)
        return out

    def materialize_all(self) -> None:
        """Make every pending master gradient ahead, one multi-tensor copy-and-unscale per device
        (reads then hand them out without an op per tensor); sparse or strided ones stay pending."""
        masters = self.owner._half_masters
        batch: dict[torch.device, list[int]] = {}
        for i, grad in enumerate(self.grads):
            pending = masters[i]._amp_pending
            if grad is None or pending is None or pending[0] is not self or i in self.eager:
                continue
            if grad.is_sparse or not grad.is_contiguous() or grad.dtype not in HALF_DTYPES or self.changed(i, grad):
                continue
            batch.setdefault(grad.device, []).append(i)
        for device, index in batch.items():
            copies = eager_unscale([self.grads[i] for i in index], self.inv_on(device), None, self.ops)  # type: ignore[misc]
            self.eager.update(zip(index, copies))

    def override(self, index: int) -> None:
        """User code set ``master.grad`` (pending until then): the step uses the slot."""
        self.touched.add(index)

    def end(self) -> None:
        """Free every master gradient of this session; nothing is pending any more."""
        masters = self.owner._half_masters
        for index in self.touched:
            set_grad(masters[index], None)
        for index, grad in enumerate(self.grads):
            if grad is not None:
                master = masters[index]
                pending = master._amp_pending
                if pending is not None and pending[0] is self:
                    master._amp_pending = None
        self.eager.clear()
        self.touched.clear()


def warn_grads_changed(stacklevel: int) -> None:
    warnings.warn(_CHANGED_MESSAGE, MasterGradWarning, stacklevel=stacklevel)


def begin_session(
    opt: MasterWeightOptimizer, inv_scale_on: Callable[[torch.device], torch.Tensor] | None
) -> GradSession:
    """Start ``opt``'s step gradients: note the model's, make each master's pending."""
    end_session(opt)
    grads = [p.grad for p in opt._half_models]
    session = opt._session = GradSession(opt, inv_scale_on, grads, opt._kernel_ops())
    owner = weakref.ref(opt)
    for i, (master, grad) in enumerate(zip(opt._half_masters, grads)):
        # a master in several optimizers answers to the one stepping now: its grad reads are this session's
        master._amp_owner = owner
        if master._amp_grad is not None:  # set outside a step: the model's gradient replaces it
            set_grad(master, None)
        master._amp_pending = None if grad is None else (session, i)
        take_sum(session, i, grad)
    return session


def take_sum(session: GradSession, index: int, grad: torch.Tensor | None) -> None:
    """Gradients accumulated over several backward passes: their FP32 sum is the master
    gradient (still scaled: ``unscale_grads_`` unscales it in place)."""
    record = session.owner._records[index]
    if record.acc is not None and grad is not None:
        summed = _accumulate.sum_for(record, grad)
        if summed is not None:
            session.eager[index] = summed


def end_session(opt: MasterWeightOptimizer) -> None:
    """End ``opt``'s step gradients, if a session is under way (see :meth:`GradSession.end`)."""
    session, opt._session = opt._session, None
    opt._shown = None
    if session is not None:
        session.end()


def clear_grads(opt: MasterWeightOptimizer, set_to_none: bool) -> None:
    """What :meth:`~amp_plugin.MasterWeightOptimizer.zero_grad` does: end the session, drop the
    FP32 accumulation sums, and clear the model's gradients (set to ``None``, or zeroed in place)."""
    end_session(opt)
    for record in opt._records:
        if record.acc is not None:
            _accumulate.detach_sum(record)
    if set_to_none:
        for p in opt._model_params:
            p.grad = None
        return
    dense = []
    for p in opt._model_params:
        g = p.grad
        if g is None:
            continue
        g.detach_()
        if g.is_sparse:
            g.zero_()
        else:
            dense.append(g)
    if dense:
        torch._foreach_zero_(dense)
