"""The module's own ``p.grad`` during the hooks between the unscale and the step.

With FP32 master weights the step uses the masters' gradients, while ``on_before_optimizer_step``
hooks and ``configure_gradient_clipping`` read the module's ``p.grad`` (``grad_norm(self)``, a
clip of ``self.parameters()``), which still holds the scaled half-precision gradient. When a hook
may read them there (:func:`hooks_may_read_grads`), :func:`show_unscaled` writes the unscaled
gradients, rounded to the half type, into the module's ``p.grad``, so a module reads there what an
FP32 run shows, within the half type's rounding. Neither runs otherwise: it costs the FP32 master
gradients (made when shown) and a copy.

The mechanics are the core's (:mod:`amp_plugin.master_weights._shown`, also used after a plain
loop's ``scaler.unscale_(opt)``); two things keep the module's ``p.grad`` and the masters'
gradients in step (see ``docs/lightning_hooks.md``):

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

from typing import Any

from amp_plugin.master_weights import ShownGrads, show_unscaled

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
