"""The base of every loss scaler: the ``torch.amp.GradScaler`` interface around a scale policy.

:class:`LossScaler` holds the machinery every scaler shares: multiply the loss, unscale the
gradients with torch's fused inf check, decide the skip, keep per-optimizer stages and a
state dict. Subclasses only say how the scale moves (:meth:`LossScaler._policy`); the retry
machinery is :class:`~amp_plugin.scaling.retries.Retries`.

Host syncs. The scale lives on the device as a tensor (for ``scale()`` and the unscale
kernel) and, exactly, as a Python float on the host, so ``get_scale()`` never waits for the
device. The one sync per optimizer step is in :meth:`LossScaler.step`: it reads the found-inf
flag (with the gradients' amax, when a policy asks for it, in the same transfer) to decide
whether to call ``optimizer.step()``. Under ``torch.distributed`` both are max-reduced across
ranks first, so every rank makes the same skip decision and sees the same amax. ``update()``
then works on host values only; when the scale changes it writes the new value into the
device tensor with a ``fill_`` (no sync).

An optimizer that sets ``_step_supports_amp_scaling = True`` (torch's ``Adam``/``AdamW`` with
``fused=True``, for example) gets the scale handed to its own ``step`` as
``torch.amp.GradScaler.step`` (torch 2.13) does it: ``optimizer.grad_scale`` and
``optimizer.found_inf`` are set for the call, or ``grad_scaler=self`` is passed when its
``step`` takes that keyword. Such an optimizer unscales and skips by itself (and no amax is
measured for it).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from amp_plugin.checks import check_scale
from amp_plugin.scaling.retries import Retries
from amp_plugin.scaling.scale_update import ScaleUpdate, to_float32
from amp_plugin.scaling.scaling_aware import step_scaling_aware
from amp_plugin.scaling.settings import Setting, check_bool
from amp_plugin.scaling.stages import OptimizerStage, Stage
from amp_plugin.scaling.state import SavedState
from amp_plugin.scaling.unscale import ones, unscale_in_place

__all__ = ["HalfLossWarning", "LossScaler"]


class HalfLossWarning(UserWarning):
    """``scale()`` was given a float16 loss.

    The scale reaches the backward pass in the loss's dtype: in float16 a scale of 2**16 is
    already inf, and a non-scalar float16 loss times the scale overflows above 65504. Compute
    the loss in float32 (``loss.float()``, or the loss function on ``output.float()``).
    """


class LossScaler(SavedState, Retries):
    """Base class: the ``torch.amp.GradScaler`` interface around a scale policy.

    A subclass lists its settings once, in ``_SETTINGS`` (:mod:`amp_plugin.scaling.settings`):
    its constructor checks them with :func:`~amp_plugin.scaling.settings.check_settings`, and
    ``settings()``, ``state_dict()``, ``load_state_dict()`` and ``__repr__`` read the table.

    Args:
        init_scale: the starting scale.
        enabled: ``False`` makes every method a pass-through (``scale`` returns its input,
            ``step`` just steps), so a loop needs no branches for fp32/bf16. A bool.

    Attributes:
        skipped_steps: iterations whose step was skipped (their batch was not trained on).
        retried_steps: attempts run again at a lower scale (``DynamicLossScaler(retries=N)``).
        update_count: iterations so far (a retried batch is one iteration).
        iteration_updates: every :class:`ScaleUpdate` of the last iteration: its retries,
            then the update that ended it.
        last_grad_amax: the largest magnitude of the last iteration's scaled gradients (the
            max over its optimizers and, under ``torch.distributed``, over ranks), read with
            the found-inf flag; ``None`` when the policy measures none (see
            ``DynamicLossScaler(early_growth_interval=N)``) or an optimizer was not measured.
    """

    _SETTINGS: ClassVar[tuple[Setting, ...]] = ()

    def __init__(self, init_scale: float, enabled: bool = True) -> None:
        super().__init__()
        self._enabled = check_bool("enabled", enabled)
        self._scale_value = to_float32(check_scale("init_scale", init_scale))
        self._scale: torch.Tensor | None = None  # device copy, created on first use
        self._inv_scales: dict[torch.device, torch.Tensor] = {}  # 1/scale per device, until the scale changes
        self._per_optimizer: dict[int, OptimizerStage] = {}
        self._iteration_skipped = False
        self._new_iteration = True
        self._skipped_by: dict[int, bool] = {}  # id(optimizer) -> its step was skipped, this or the last iteration
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.update_count = 0
        self.last_step_skipped = False
        self.last_update: ScaleUpdate | None = None
        self.iteration_updates: tuple[ScaleUpdate, ...] = ()
        self.last_grad_amax: float | None = None
        self._half_loss_warned = False

    # ------------------------------------------------------------------ public API
    def is_enabled(self) -> bool:
        """Whether this scaler scales (``False``: every method is a pass-through)."""
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Never waits for the device."""
        return self._scale_value if self._enabled else 1.0

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor, or a (nested) list/tuple of tensors, by the scale.

        The product is ``outputs * scale`` with the scale a 0-dim float32 tensor, exactly as
        ``torch.amp.GradScaler.scale`` computes it (same dtype, same value). A float16 loss is
        not upcast: that would not help, since the scale would still reach its backward pass
        in float16. Instead the first float16 loss a scaler sees raises a
        :class:`HalfLossWarning` saying to compute the loss in float32.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if outputs.dtype is torch.float16 and not self._half_loss_warned:
                self._warn_half_loss(outputs)
            return outputs * self._device_scale(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
            return map(self.scale, outputs)
        raise TypeError(f"scale() takes a tensor or an iterable of tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and record whether any is inf/NaN.

        An optimizer that owns master copies (:class:`~amp_plugin.MasterWeightOptimizer`)
        does it through its ``unscale_grads_``: it checks its model's half-precision
        gradients, which stay scaled, and from then until the step its masters' ``.grad`` are
        the unscaled FP32 gradients (made when read); then (unless built with
        ``unscaled_model_grads=False``) its model's ``p.grad`` show the unscaled gradients too,
        rounded to their dtype, and in-place edits of them (torch's AMP recipe:
        ``clip_grad_norm_(model.parameters(), c)``) reach the step
        (:meth:`~amp_plugin.MasterWeightOptimizer.show_unscaled_grads`). Other optimizers are
        unscaled in place. Call it at most once per optimizer between ``update()`` calls (for
        example before clipping).

        When the policy uses the gradients' amax (``DynamicLossScaler(early_growth_interval=N)``)
        the same call measures it on the still scaled gradients, on the device (torch's
        multi-tensor norm); ``step()`` reads it with the found-inf flag. A master-weight
        optimizer measures it in its ``unscale_grads_(inv_scale_on, amax=...)``; one whose
        ``unscale_grads_`` takes no ``amax`` is not measured.

        On a disabled scaler there is nothing to unscale, but a master-weight optimizer still
        gets its FP32 master gradients copied from the model (``sync_grads()``), so clipping
        ``opt.master_params()`` works the same whether scaling is on or off.
        """
        self._unscale(optimizer)
        show = getattr(optimizer, "show_unscaled_grads", None)
        if show is not None and self._enabled:
            show()

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`unscale_` without showing a master-weight optimizer's unscaled gradients in its
        model (what ``step()`` runs when nobody unscaled: then nothing reads the model's gradients)."""
        if not self._enabled:
            sync = getattr(optimizer, "sync_grads", None)
            if sync is not None:
                sync()
            return
        state = self._state(optimizer)
        if state.stage is Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state.stage is Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        amax: dict[torch.device, torch.Tensor] | None = {} if self._wants_amax() else None
        unscale = getattr(optimizer, "unscale_grads_", None)
        if unscale is None:
            state.found_inf = unscale_in_place(optimizer, self._inv_scale, amax=amax)
        elif amax is not None and "amax" in inspect.signature(unscale).parameters:
            state.found_inf = unscale(self._inv_scale, amax=amax)
        else:
            state.found_inf, amax = unscale(self._inv_scale), None
        state.amax = amax
        state.stage = Stage.UNSCALED

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step was skipped in the iteration under way or, after ``update()``,
        in the one ``update()`` ended (until the next ``step()``).

        ``last_step_skipped`` covers the whole iteration: with several optimizers it is True as
        soon as one of them skipped. This is the answer for one optimizer, so a loop holds only
        the schedule of the optimizer that did not step. False for an optimizer that was not
        stepped in that iteration, and always False on a disabled scaler.
        """
        return self._skipped_by.get(id(optimizer), False)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then call ``optimizer.step(*args, **kwargs)`` unless a gradient
        was inf/NaN. Returns what ``optimizer.step`` returned, or ``None`` when skipped
        (as ``torch.amp.GradScaler.step``).

        An optimizer with ``_step_supports_amp_scaling = True`` is stepped whatever the
        gradients hold, with the scale and the found-inf flag handed to it (see the module
        docstring): it unscales and skips by itself.

        This is the one place that waits for the device: it reads the found-inf flag
        (max-reduced across ranks under ``torch.distributed``).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):  # torch's step(closure=None), by name or place
            raise RuntimeError("Closure use is not supported: run the closure, then call step(optimizer).")
        state = self._state(optimizer)
        if state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return step_scaling_aware(self, optimizer, state, args, kwargs)
        if state.stage is Stage.READY:
            self._unscale(optimizer)
        found = self._found_inf_host(state)
        state.stage = Stage.STEPPED
        self._record_step(found, optimizer)
        if found:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: apply the scale policy once, whatever the number of optimizers.

        Args:
            new_scale: set this scale instead of applying the policy (``reason="manual"``). It
                must be a scale float32 holds (see :func:`~amp_plugin.checks.check_scale`;
                :class:`DynamicLossScaler` also requires ``[min_scale, max_scale]``). A tensor
                is read with ``.item()`` (a host sync).

        Raises:
            LossScaleCollapseError: from :class:`DynamicLossScaler` when the scale is due to
                back off below ``min_scale`` and ``on_min_scale="raise"``.
            ValueError: ``new_scale`` is not allowed (nothing has changed then).
        """
        if not self._enabled:
            return
        old = self._scale_value
        reason: str | None
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1:
                    raise ValueError(
                        f"new_scale has {new_scale.numel()} elements: new_scale must be a float or a "
                        "one-element tensor."
                    )
                new_scale = new_scale.item()
            new, reason = self._check_manual_scale(new_scale), "manual"
            found = self._iteration_found_inf(require=False)
            self.last_grad_amax = self._iteration_amax()
        else:
            found = self._iteration_found_inf(require=True)
            retry = self._retry_scale() if found and self._may_retry() else None
            if retry is not None:
                self._begin_retry(old, retry)
                return
            self.last_grad_amax = self._iteration_amax()
            new, reason = self._policy(found)
        self._per_optimizer.clear()
        self._new_iteration = True
        self.last_step_skipped = found
        self.skipped_steps += int(found)
        self.consecutive_skips = self.consecutive_skips + 1 if found else 0
        self.last_update = ScaleUpdate(self.update_count, old, new, found, reason)
        self.iteration_updates = (*self._take_retry_updates(), self.last_update)
        self.update_count += 1
        self._set_scale(new)
        self._after_update(self.last_update)

    def __repr__(self) -> str:
        shown = [s.shown(self) for s in self._SETTINGS if s.name != "scale"]
        return ", ".join([f"{type(self).__name__}(scale={self._scale_value:g}", *shown, f"enabled={self._enabled})"])

    # ------------------------------------------------------------------ for subclasses
    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        """Return ``(new_scale, reason)`` for an iteration; see :class:`ScaleUpdate`."""
        raise NotImplementedError

    def _wants_amax(self) -> bool:
        """Whether ``unscale_`` measures the gradients' amax for the policy
        (``last_grad_amax``); every rank must answer the same."""
        return False

    def _check_manual_scale(self, value: Any) -> float:
        """The float32 scale ``update(new_scale)`` sets, or ``ValueError``."""
        return to_float32(check_scale("new_scale", value))

    def _after_update(self, update: ScaleUpdate) -> None:
        """Called at the end of ``update()``, state already consistent (may raise)."""

    # ------------------------------------------------------------------ internals
    def _state(self, optimizer: torch.optim.Optimizer) -> OptimizerStage:
        return self._per_optimizer.setdefault(id(optimizer), OptimizerStage())

    def _warn_half_loss(self, loss: torch.Tensor) -> None:
        self._half_loss_warned = True
        warnings.warn(
            f"scale() got a float16 loss (shape {tuple(loss.shape)}). Its backward pass receives the scale "
            f"({self._scale_value:g}) in float16, where 65536 and above are inf and any loss * scale "
            "above 65504 overflows, so steps get skipped for nothing. Compute the loss in float32: "
            "scaler.scale(loss.float()), or the loss function on output.float(). (Warned once per scaler.)",
            HalfLossWarning,
            stacklevel=3,
        )

    def _record_step(self, found: bool, optimizer: torch.optim.Optimizer) -> None:
        if self._new_iteration:
            self._new_iteration = False
            self._iteration_skipped = False
            self._skipped_by.clear()
        self._skipped_by[id(optimizer)] = found
        self._iteration_skipped |= found
        self.last_step_skipped = self._iteration_skipped

    # torch.amp.GradScaler's hooks for optimizers that handle the scale themselves (an optimizer
    # given grad_scaler=self may call them).
    def _get_scale_async(self) -> torch.Tensor | None:
        """The device scale tensor (``None`` before the first ``scale()``)."""
        return self._scale

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Record the found-inf flags of ``optimizer``'s gradients without unscaling them."""
        state = self._state(optimizer)
        state.found_inf = unscale_in_place(optimizer, ones)
        state.found_inf_host = None
        return state.found_inf

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        return self._state(optimizer).found_inf

    def _device_scale(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((), self._scale_value, dtype=torch.float32, device=device)
        elif self._scale.device != device:
            return self._scale.to(device=device, non_blocking=True)
        return self._scale

    def _inv_scale(self, device: torch.device) -> torch.Tensor:
        # Computed on the host from the exact float32 scale: the same double reciprocal
        # GradScaler computes on the device, rounded to float32. Kept while the scale holds
        # (most steps), so an unscale allocates and fills nothing.
        inv = self._inv_scales.get(device)
        if inv is None:
            inv = self._inv_scales[device] = torch.full((), 1.0 / self._scale_value, dtype=torch.float32, device=device)
        return inv

    def _set_scale(self, value: float) -> None:
        if value != self._scale_value:
            if self._scale is not None:
                self._scale.fill_(value)
            self._inv_scales.clear()
        self._scale_value = value

    def _found_inf_host(self, state: OptimizerStage) -> bool:
        return state.read(self._scale.device if self._scale is not None else "cpu")

    def _iteration_amax(self) -> float | None:
        """The iteration's gradient amax, the max over its optimizers (``None`` when one of
        them was not measured). Their flags are read already: no further host sync."""
        values = []
        for state in self._per_optimizer.values():
            if state.stage is not Stage.READY:
                self._found_inf_host(state)
                if state.amax_host is None:
                    return None
                values.append(state.amax_host)
        return max(values) if values else None

    def _iteration_found_inf(self, require: bool) -> bool:
        states = [s for s in self._per_optimizer.values() if s.stage is not Stage.READY]
        if not states:
            if require:
                raise RuntimeError("No inf checks were recorded prior to update(): call step() or unscale_() first.")
            return False
        return any(self._found_inf_host(s) for s in states)
