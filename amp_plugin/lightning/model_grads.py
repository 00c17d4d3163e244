"""The module's own ``p.grad`` during the hooks between the unscale and the step.

With FP32 master weights the step uses the masters' gradients, while ``on_before_optimizer_step``
hooks and ``configure_gradient_clipping`` read the module's ``p.grad`` (``grad_norm(self)``, a
clip of ``self.parameters()``), which still holds the scaled half-precision gradient. When a hook
may read them there (:func:`hooks_may_read_grads`), :func:`show_unscaled` writes the unscaled
gradients, rounded to the half type, into the module's ``p.grad``, so a module reads there what an
FP32 run shows, within the half type's rounding. Neither runs otherwise: it costs the FP32 master
gradients (made when shown) and a copy.

Two things keep the module's ``p.grad`` and the masters' gradients in step (see
``docs/lightning_hooks.md``):

- :meth:`ShownGrads.take_edits`: what a hook changed in the module's ``p.grad`` reaches the step,
  element by element. An element counts as changed when its value no longer equals the master
  gradient rounded to the half type; a changed element's master gradient becomes the hook's value
  (upcast), every other element keeps its FP32 master gradient. So an in-place touch that changes
  no value (``clip_grad_norm_(self.parameters(), 1e9)`` multiplies by 1.0) changes nothing, and an
  edit takes effect where it changed a value and nowhere else. ``p.grad = None`` leaves the
  parameter out of the step, as in an FP32 run. Tensors whose ``p.grad`` was not written since it
  was shown (same tensor, same version counter) are not compared at all.
- :meth:`ShownGrads.show_again`: after Lightning clipped the masters' gradients, the module's
  ``p.grad`` shows the clipped values, so a ``configure_gradient_clipping`` that calls ``super()``
  reads clipped gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from amp_plugin.master_weights import MasterWeightOptimizer

__all__ = ["ShownGrads", "hooks_may_read_grads", "show_unscaled"]

_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")


def hooks_may_read_grads(model: Any) -> bool:
    """Whether the module or a callback overrides a hook that runs between the unscale and the
    step (amp_plugin's callbacks that read the optimizer's FP32 gradients excepted)."""

    def overrides(obj: Any, hook: str) -> bool:
        owner = next((k for k in type(obj).__mro__ if hook in vars(k)), None)
        return owner is not None and not owner.__module__.startswith(("lightning.", "pytorch_lightning."))

    trainer = getattr(model, "trainer", None)
    callbacks = [cb for cb in getattr(trainer, "callbacks", []) if not getattr(cb, "reads_master_grads", False)]
    return any(overrides(model, hook) for hook in _HOOKS) or any(
        overrides(cb, "on_before_optimizer_step") for cb in callbacks
    )


@dataclass
class ShownGrads:
    """The module parameters whose ``p.grad`` shows the unscaled gradient, their masters, and
    each shown gradient tensor with its version counter when it was written (to see an edit)."""

    models: list[Tensor]
    masters: list[Tensor]
    shown: list[Tensor | None] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._record()

    @torch.no_grad()
    def take_edits(self) -> None:
        """Hand what a hook changed in the module's ``p.grad`` to the step (module docstring)."""
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
    """Write the unscaled gradients of ``optimizer``'s half-precision parameters into their ``p.grad``."""
    models, masters, model_grads, grads = [], [], [], []
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
