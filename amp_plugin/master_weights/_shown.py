"""The model's own ``p.grad`` between a loss scaler's ``unscale_`` and the step.

With FP32 master weights the step uses the masters' gradients, while code written for
``torch.amp.GradScaler`` reads and edits the model's ``p.grad`` after ``scaler.unscale_(opt)`` (torch's
AMP recipe: ``clip_grad_norm_(model.parameters(), c)``), where the half-precision gradient is still
scaled. :func:`show_unscaled` writes the unscaled gradients, rounded to the half type, into the
model's ``p.grad``, so the model shows what an FP32 run shows, within the half type's rounding.

Two things keep the model's ``p.grad`` and the masters' gradients in step:

- :meth:`ShownGrads.take_edits`: what user code changed in the model's ``p.grad`` reaches the step,
  element by element. An element counts as changed when its value no longer equals the master
  gradient rounded to the half type; a changed element's master gradient becomes the edited value
  (upcast), every other element keeps its FP32 master gradient. So an in-place touch that changes
  no value (``clip_grad_norm_(params, 1e9)`` multiplies by 1.0) changes nothing, and an edit takes
  effect where it changed a value and nowhere else (an element too small for the half type, shown
  as 0, keeps its FP32 value: the edit misses it by less than the half type's smallest number).
  ``p.grad = None`` leaves the parameter out of the step, as in an FP32 run. Tensors whose
  ``p.grad`` was not written since it was shown (same tensor, same version counter) are not
  compared at all.
- :meth:`ShownGrads.show_again`: after the masters' gradients were changed (clipped) by the
  wrapper's owner, the model's ``p.grad`` shows the new values.

It costs the FP32 master gradients (made when shown: 4 bytes per parameter until the step) and a
copy, so it runs only where something may read the model's gradients: after a user's own
``scaler.unscale_(opt)`` (``MasterWeightOptimizer(..., unscaled_model_grads=True)``, the default),
and in the Lightning plugin when a hook may read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = ["ShownGrads", "show_unscaled"]


@dataclass
class ShownGrads:
    """The model parameters whose ``p.grad`` shows the unscaled gradient, their masters, and
    each shown gradient tensor with its version counter when it was written (to see an edit)."""

    models: list[Tensor]
    masters: list[Tensor]
    shown: list[Tensor | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._record()

    @torch.no_grad()
    def take_edits(self) -> None:
        """Hand what user code changed in the model's ``p.grad`` to the step (module docstring)."""
        for i, (model_p, master) in enumerate(zip(self.models, self.masters)):
            grad = model_p.grad
            if grad is self.shown[i] and (grad is None or grad._version == self.versions[i]):
                continue  # not written since shown
            if grad is None:
                master.grad = None  # left out of the step, as an FP32 parameter would be
                continue
            master_grad = master.grad
            if master_grad is None or master_grad.is_sparse or grad.is_sparse or grad.shape != master_grad.shape:
                continue
            changed = grad != master_grad.to(grad.dtype)  # NaN counts as changed: taking it changes nothing
            # no host sync (no `if changed.any()`): one more pass over a tensor a hook wrote
            master_grad.copy_(torch.where(changed, grad.to(master_grad.dtype), master_grad))
        self._record()

    @torch.no_grad()
    def show_again(self) -> None:
        """Write the masters' gradients as they are now (clipped) into the module's ``p.grad``."""
        models, grads = [], []
        for model_p, master in zip(self.models, self.masters):
            master_grad = master.grad
            if model_p.grad is None or master_grad is None or master_grad.is_sparse:
                continue
            models.append(model_p.grad)
            grads.append(master_grad)
        if grads:
            torch._foreach_copy_(models, grads)
        self._record()

    def _record(self) -> None:
        self.shown = [p.grad for p in self.models]
        self.versions = [0 if g is None else g._version for g in self.shown]


@torch.no_grad()
def show_unscaled(optimizer: MasterWeightOptimizer) -> ShownGrads:
    """Write the unscaled gradients of ``optimizer``'s half-precision parameters into their ``p.grad``
    (between its loss scaler's ``unscale_`` and the step)."""
    models, masters, model_grads, grads = [], [], [], []
    if optimizer._session is not None:
        optimizer._session.materialize_all()  # one multi-tensor op per device, not one per tensor
    for model_p, master in zip(optimizer.model_params(), optimizer.master_params()):
        model_grad = model_p.grad
        if model_p is master or model_grad is None or model_grad.is_sparse:
            continue
        fp32 = master.grad  # made here, from the still scaled model gradient
        if fp32 is None or fp32.is_sparse:
            continue
        models.append(model_p)
        masters.append(master)
        model_grads.append(model_grad)
        grads.append(fp32)
    if grads:
        torch._foreach_copy_(model_grads, grads)
    return ShownGrads(models, masters)
