"""What the plugin makes of the optimizers ``configure_optimizers`` returned.

:func:`wrap_optimizers` refuses what a preset cannot step (``LBFGS``, a
:class:`~amp_plugin.MasterWeightOptimizer` under FSDP2, an optimizer another wrapper already
holds) and wraps the rest: in a :class:`~amp_plugin.MasterWeightOptimizer` with master weights,
in a :class:`~amp_plugin.fsdp_moments.Bf16MomentsAdam` under FSDP2 with BF16 moments.
:func:`unwrap` finds the optimizer inside the ``LightningOptimizer`` that hooks receive.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import LBFGS, Optimizer

from amp_plugin.fsdp_moments import Bf16MomentsAdam
from amp_plugin.master_weights import MasterWeightOptimizer, is_wrapped
from amp_plugin.settings import PrecisionSettings

__all__ = ["unwrap", "wrap_optimizers"]


def wrap_optimizers(
    model: torch.nn.Module,
    optimizers: list[Optimizer],
    settings: PrecisionSettings,
    sharded: bool,
    bf16_moment_params: list[torch.Tensor],
) -> list[Optimizer]:
    """The optimizers ``settings`` steps, in the order given.

    Args:
        model: the module being fit (its trainer tells whether a step sees one backward).
        optimizers: what ``configure_optimizers`` returned.
        settings: the plugin's settings.
        sharded: whether the module is sharded with FSDP2.
        bf16_moment_params: under FSDP2 with BF16 moments, the parameters whose moments are BF16.

    Raises:
        ValueError: ``LBFGS`` with a half-precision preset, or an optimizer that is already the
            inner optimizer of a ``MasterWeightOptimizer``.
        TypeError: a ``MasterWeightOptimizer`` under FSDP2.
    """
    if settings.precision != "fp32" and any(isinstance(getattr(o, "optimizer", o), LBFGS) for o in optimizers):
        raise ValueError(
            f"LBFGS cannot be used with precision={settings.preset!r}: it re-evaluates the closure "
            "several times inside one step(), so a loss-scale skip or an FP32 master copy cannot be "
            "applied per step. Train with precision='fp32', or use another optimizer."
        )
    if sharded and any(isinstance(o, MasterWeightOptimizer) for o in optimizers):
        raise TypeError(
            "MasterWeightOptimizer cannot be used with FSDP2: the sharded FP32 parameters already are the "
            "master weights. Return an optimizer over the module's parameters from configure_optimizers."
        )
    if sharded and settings.moments == "bf16":
        # FSDP2: the FP32 shards are the masters; only the moments change dtype (fsdp_moments.py)
        optimizers = [
            o if isinstance(o, Bf16MomentsAdam) else Bf16MomentsAdam(o, bf16_moment_params, settings.moments_rounding)
            for o in optimizers
        ]
    if settings.master_weights and not sharded:
        master, moments = settings.master, settings.moments_dtype
        for o in optimizers:
            if is_wrapped(o) and not isinstance(o, MasterWeightOptimizer):
                raise ValueError(_wrapped_again(type(o).__name__, settings.preset))
        single = _one_backward_per_step(model)  # then no FP32 accumulation hooks
        optimizers = [
            o
            if isinstance(o, MasterWeightOptimizer)
            else MasterWeightOptimizer(
                o,
                master=master,
                moments_dtype=moments,
                accumulate_fp32=not single,
                moments_rounding=settings.moments_rounding,
                unscaled_model_grads=False,  # the plugin shows them where a hook may read them (model_grads.py)
            )
            for o in optimizers
        ]
    return optimizers


def _one_backward_per_step(model: torch.nn.Module) -> bool:
    """Whether every step of this fit sees one backward: automatic optimization, no gradient accumulation,
    and none scheduled. Lightning's ``GradientAccumulationScheduler`` sets ``accumulate_grad_batches`` at
    each epoch's start, after the optimizers were wrapped here, so its presence alone means accumulation
    (its micro-batches were summed in the half dtype: only the window's last gradient had FP32 digits)."""
    trainer = getattr(model, "_trainer", None)
    if not getattr(model, "automatic_optimization", False) or getattr(trainer, "accumulate_grad_batches", 0) != 1:
        return False
    scheduled = (
        any(c.__name__ == "GradientAccumulationScheduler" for c in type(callback).__mro__)  # either package's
        for callback in getattr(trainer, "callbacks", [])
    )
    return not any(scheduled)


def unwrap(optimizer: Any) -> Any:
    """The optimizer inside a ``LightningOptimizer`` (what ``self.optimizers()`` returns)."""
    return getattr(optimizer, "_optimizer", optimizer)


def _wrapped_again(name: str, preset: str) -> str:
    return (
        f"configure_optimizers returned a {name} that is already wrapped by a MasterWeightOptimizer: precision="
        f"{preset!r} wraps the optimizer in place (its param groups then hold the FP32 masters), so the same "
        "optimizer object cannot be given to a second fit or a second plugin. If you built the "
        "MasterWeightOptimizer yourself, return it from configure_optimizers instead of its .optimizer; "
        "otherwise build the optimizer inside configure_optimizers, so that each fit gets a new one "
        "(see docs/lightning_differences.md)."
    )
