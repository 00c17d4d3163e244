"""torch's protocol for optimizers that unscale and skip by themselves.

An optimizer that sets ``_step_supports_amp_scaling = True`` (torch's ``Adam``/``AdamW`` with
``fused=True``, for example) gets the scale handed to its own ``step`` as
``torch.amp.GradScaler.step`` (torch 2.13) does it: ``optimizer.grad_scale`` and
``optimizer.found_inf`` are set for the call, or ``grad_scaler=scaler`` is passed when its
``step`` takes that keyword.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from amp_plugin.scaling.stages import OptimizerStage, Stage

if TYPE_CHECKING:
    from amp_plugin.scaling.loss_scaler import LossScaler

__all__ = ["step_scaling_aware"]


class _ScalingAwareOptimizer(Protocol):
    """An optimizer with ``_step_supports_amp_scaling`` (torch's private protocol, not in the
    stubs): its ``step`` takes ``grad_scaler=``, or reads ``grad_scale`` and ``found_inf``."""

    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor

    def step(self, *args: Any, **kwargs: Any) -> Any: ...


def step_scaling_aware(
    scaler: LossScaler, optimizer: torch.optim.Optimizer, state: OptimizerStage, args: tuple, kwargs: dict[str, Any]
) -> Any:
    """``scaler.step(optimizer, *args, **kwargs)`` for an optimizer with ``_step_supports_amp_scaling``.

    The optimizer is stepped whatever its gradients hold: it gets ``grad_scale`` and
    ``found_inf`` set for the call (or ``grad_scaler=scaler`` when its ``step`` takes that
    keyword, with the ``FutureWarning`` torch's GradScaler gives) and unscales and skips by
    itself. The scaler records the skip from the found-inf flag (one host read).
    """
    aware = cast(_ScalingAwareOptimizer, optimizer)
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        warnings.warn(  # as torch.amp.GradScaler warns, which deprecates this protocol
            f"{type(scaler).__name__} passes itself as a keyword argument (grad_scaler=) to "
            f"{type(optimizer).__name__}.step, as torch.amp.GradScaler does until torch removes that protocol. "
            "Let the optimizer's step read the "
            "`grad_scale` and `found_inf` tensors the scaler sets on it instead (drop its grad_scaler argument).",
            FutureWarning,
            stacklevel=3,
        )
        retval = aware.step(*args, **kwargs, grad_scaler=scaler)
        state.stage = Stage.STEPPED
        if state.found_inf:  # the optimizer ran the inf check through _check_inf_per_device
            scaler._record_step(scaler._found_inf_host(state), optimizer)
        return retval
    unscaled = state.stage is Stage.UNSCALED
    if not unscaled:
        scaler._check_inf_per_device(optimizer)
    flags = list(state.found_inf.values())
    scale = scaler._device_scale(flags[0].device if flags else torch.device("cpu"))
    found = torch.zeros((), dtype=torch.float32, device=scale.device)
    for flag in flags:
        found = found + flag.to(scale.device, non_blocking=True)
    aware.grad_scale = (
        getattr(optimizer, "grad_scale", None) if unscaled else scale * getattr(optimizer, "grad_scale", 1)
    )
    aware.found_inf = found
    try:
        retval = aware.step(*args, **kwargs)
    finally:
        del aware.grad_scale
        del aware.found_inf
    state.stage = Stage.STEPPED
    scaler._record_step(scaler._found_inf_host(state), optimizer)
    return retval
