"""The module's own ``p.grad`` during the hooks between the unscale and the step.

With FP32 master weights the step uses the masters' gradients, while ``on_before_optimizer_step``
hooks and ``configure_gradient_clipping`` read the module's ``p.grad`` (``grad_norm(self)``, a
clip of ``self.parameters()``), which still holds the scaled half-precision gradient. When a hook
may read them there (:func:`hooks_may_read_grads`), :func:`show_unscaled` writes the unscaled
gradients, rounded to the half type, into the module's ``p.grad``, and
:meth:`ShownGrads.take_edits` hands what a hook changed there to the step. Neither runs otherwise:
it costs the FP32 master gradients (made when shown) and a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

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
    """The module parameters whose ``p.grad`` now holds the unscaled gradient, their masters,
    and each gradient's version counter when it was written (to see a hook's edit)."""

    models: list[Tensor]
    masters: list[Tensor]
    versions: list[int]

    @torch.no_grad()
    def take_edits(self) -> None:
        """A hook edited the module's (unscaled) ``p.grad``: the step uses the edited values."""
        for model_p, master, version in zip(self.models, self.masters, self.versions):
            grad = model_p.grad
            if grad is not None and grad._version != version and master.grad is not None:
                master.grad.copy_(grad)


def show_unscaled(optimizer: MasterWeightOptimizer) -> ShownGrads:
    """Write the unscaled gradients of ``optimizer``'s half-precision parameters into their ``p.grad``."""
    models, masters, grads = [], [], []
    for model_p, master in zip(optimizer.model_params(), optimizer.master_params()):
        if model_p is master or model_p.grad is None or model_p.grad.is_sparse:
            continue
        fp32 = master.grad  # made here, from the still scaled model gradient
        if fp32 is None or fp32.is_sparse:
            continue
        models.append(model_p)
        masters.append(master)
        grads.append(fp32)
    model_grads = cast("list[Tensor]", [p.grad for p in models])  # checked above: not None
    if grads:
        torch._foreach_copy_(model_grads, grads)
    return ShownGrads(models, masters, [g._version for g in model_grads])
