"""Loss scalers with the ``torch.amp.GradScaler`` interface.

:class:`LossScaler` holds the machinery every scaler shares: multiply the loss, unscale the
gradients with torch's fused inf check, decide the skip, keep per-optimizer stages and a
state dict. Subclasses only say how the scale moves (:meth:`LossScaler._policy`).

Host syncs. The scale lives on the device as a tensor (for ``scale()`` and the unscale
kernel) and, exactly, as a Python float on the host, so ``get_scale()`` never waits for the
device. The one sync per optimizer step is in :meth:`LossScaler.step`: it reads the found-inf
flag to decide whether to call ``optimizer.step()``. Under ``torch.distributed`` the flag is
max-reduced across ranks first, so every rank makes the same skip decision. ``update()`` then
works on host values only; when the scale changes it writes the new value into the device
tensor with a ``fill_`` (no sync).

An optimizer that sets ``_step_supports_amp_scaling = True`` (torch's ``Adam``/``AdamW`` with
``fused=True``, for example) gets the scale handed to its own ``step`` as
``torch.amp.GradScaler.step`` (torch 2.13) does it: ``optimizer.grad_scale`` and
``optimizer.found_inf`` are set for the call, or ``grad_scaler=self`` is passed when its
``step`` takes that keyword. Such an optimizer unscales and skips by itself.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Protocol, cast

import torch

from amp_plugin._dtensor import is_dtensor
from amp_plugin.checks import check_int, check_scale
from amp_plugin.rng_state import RngState
from amp_plugin.scaler_settings import Setting, check_bool, check_settings

__all__ = ["HalfLossWarning", "LossScaler", "ScaleUpdate", "StaticLossScaler", "to_float32"]


class HalfLossWarning(UserWarning):
    """``scale()`` was given a float16 loss.

    The scale reaches the backward pass in the loss's dtype: in float16 a scale of 2**16 is
    already inf, and a non-scalar float16 loss times the scale overflows above 65504. Compute
    the loss in float32 (``loss.float()``, or the loss function on ``output.float()``).
    """


def to_float32(value: float) -> float:
    """Round a Python float to the nearest float32, as torch's scale kernels store it."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


@dataclass(frozen=True)
class ScaleUpdate:
    """What one ``update()`` did.

    Attributes:
        iteration: 0-based index of the update (iteration) this describes.
        old_scale: the scale before the update.
        new_scale: the scale after it.
        found_inf: whether the iteration had a non-finite gradient (its step was skipped).
        reason: ``None`` for a clean step that left the scale alone, otherwise one of
            ``"growth"`` (grew after ``growth_interval`` clean steps; a growth capped at
            ``max_scale`` still counts), ``"overflow"`` (backed off), ``"hysteresis"``
            (overflow absorbed by hysteresis, scale kept), ``"min_scale"`` (overflow at
            ``min_scale`` with ``on_min_scale="skip"``, scale kept), ``"manual"``
            (``update(new_scale)``), ``"retry"`` (backed off to run the same batch again,
            see ``DynamicLossScaler(retries=N)``; the batch is not skipped yet).
    """

    iteration: int
    old_scale: float
    new_scale: float
    found_inf: bool
    reason: str | None

    @property
    def changed(self) -> bool:
        """True when the scale value changed."""
        return self.old_scale != self.new_scale


class _ScalingAwareOptimizer(Protocol):
    """An optimizer with ``_step_supports_amp_scaling`` (torch's private protocol, not in the
    stubs): its ``step`` takes ``grad_scaler=``, or reads ``grad_scale`` and ``found_inf``."""

    grad_scale: torch.Tensor | None
    found_inf: torch.Tensor

    def step(self, *args: Any, **kwargs: Any) -> Any: ...


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptimizerState:
    __slots__ = ("found_inf", "found_inf_host", "stage")

    def __init__(self) -> None:
        self.stage = _Stage.READY
        self.found_inf: dict[torch.device, torch.Tensor] = {}
        self.found_inf_host: bool | None = None


class LossScaler:
    """Base class: the ``torch.amp.GradScaler`` interface around a scale policy.

    A subclass lists its settings once, in ``_SETTINGS`` (:mod:`amp_plugin.scaler_settings`):
    its constructor checks them with :func:`~amp_plugin.scaler_settings.check_settings`, and
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
    """

    _SETTINGS: ClassVar[tuple[Setting, ...]] = ()
    retries: int = 0  # how often an overflowing batch may run again (DynamicLossScaler's setting)

    def __init__(self, init_scale: float, enabled: bool = True) -> None:
        self._enabled = check_bool("enabled", enabled)
        self._scale_value = to_float32(check_scale("init_scale", init_scale))
        self._scale: torch.Tensor | None = None  # device copy, created on first use
        self._inv_scales: dict[torch.device, torch.Tensor] = {}  # 1/scale per device, until the scale changes
        self._per_optimizer: dict[int, _OptimizerState] = {}
        self._iteration_skipped = False
        self._new_iteration = True
        self._skipped_by: dict[int, bool] = {}  # id(optimizer) -> its step was skipped, this or the last iteration
        self.skipped_steps = 0
        self.retried_steps = 0
        self.consecutive_skips = 0
        self.update_count = 0
        self.last_step_skipped = False
        self.last_update: ScaleUpdate | None = None
        self.iteration_updates: tuple[ScaleUpdate, ...] = ()
        self._retry_updates: list[ScaleUpdate] = []  # this iteration's retries so far
        self._attempt: int | None = None  # inside attempts(): the attempt running (0 = first)
        self._retrying = False
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
        the unscaled FP32 gradients (made when read). Other optimizers are unscaled in place.
        Call it at most once per optimizer between ``update()`` calls (for example before
        clipping).

        On a disabled scaler there is nothing to unscale, but a master-weight optimizer still
        gets its FP32 master gradients copied from the model (``sync_grads()``), so clipping
        ``opt.master_params()`` works the same whether scaling is on or off.
        """
        if not self._enabled:
            sync = getattr(optimizer, "sync_grads", None)
            if sync is not None:
                sync()
            return
        state = self._state(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        unscale = getattr(optimizer, "unscale_grads_", None)
        if unscale is not None:
            state.found_inf = unscale(self._inv_scale)
        else:
            state.found_inf = _unscale_in_place(optimizer, self._inv_scale)
        state.stage = _Stage.UNSCALED

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
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not supported: run the closure, then call step(optimizer).")
        state = self._state(optimizer)
        if state.stage is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._step_scaling_aware(optimizer, state, args, kwargs)
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        found = self._found_inf_host(state)
        state.stage = _Stage.STEPPED
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
        else:
            found = self._iteration_found_inf(require=True)
            retry = self._retry_scale() if found and self._may_retry() else None
            if retry is not None:
                self._begin_retry(old, retry)
                return
            new, reason = self._policy(found)
        self._per_optimizer.clear()
        self._new_iteration = True
        self.last_step_skipped = found
        self.skipped_steps += int(found)
        self.consecutive_skips = self.consecutive_skips + 1 if found else 0
        self.last_update = ScaleUpdate(self.update_count, old, new, found, reason)
        self.iteration_updates = (*self._retry_updates, self.last_update)
        self._retry_updates = []
        self._retrying = False
        self.update_count += 1
        self._set_scale(new)
        self._after_update(self.last_update)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly; ``{}`` when disabled (like GradScaler)."""
        if not self._enabled:
            return {}
        state = {
            "scale": self._scale_value,
            "skipped_steps": self.skipped_steps,
            "retried_steps": self.retried_steps,
            "consecutive_skips": self.consecutive_skips,
            "update_count": self.update_count,
            "last_step_skipped": self.last_step_skipped,
        }
        state.update((s.name, s.get(self)) for s in self._SETTINGS if s.in_state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from a ``torch.amp.GradScaler`` state dict.

        Every value is checked as the constructor checks it before anything changes: a bad
        or missing entry raises ``ValueError`` naming its key and leaves the scaler as it was.
        A setting the dict does not hold keeps this scaler's value, and a
        :class:`StaticLossScaler`'s dict brings no settings. Keys this scaler does not know
        are ignored (a dynamic scaler's settings, loaded into a :class:`StaticLossScaler`).
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled scaler.")
        table = [s for s in self._SETTINGS if s.in_state]
        source = {} if state_dict.get("static") is True else state_dict
        settings = check_settings(table, {s.name: source.get(s.name, s.get(self)) for s in table}, loading=True)
        self._check_together(settings)
        values = self._checked_state(state_dict, settings)
        # All checked: apply.
        for setting in table:
            setattr(self, setting.attr or setting.name, settings[setting.name])
        self._set_scale(values["scale"])
        self.skipped_steps = values["skipped_steps"]
        self.retried_steps = values["retried_steps"]
        self.consecutive_skips = values["consecutive_skips"]
        self.update_count = values["update_count"]
        self.last_step_skipped = values["last_step_skipped"]
        self._load_trackers(values)

    def settings(self) -> dict[str, Any]:
        """The constructor arguments that shape the scale policy (not its progress)."""
        return {s.name: s.get(self) for s in self._SETTINGS}

    def resume_from(self, state_dict: dict[str, Any]) -> list[str]:
        """Continue a saved run's scale and trackers under this scaler's own settings.

        Returns ``"key: saved -> now"`` for every setting that differs from the saved one;
        the configured value is kept.
        """
        state, changed = dict(state_dict), []
        for key, value in self.settings().items():
            if key in state and state[key] != value:
                changed.append(f"{key}: {state[key]!r} -> {value!r}")
            state[key] = value
        self.load_state_dict(state)
        return changed

    def restarted(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A saved state dict whose scale restarts at this scaler's current scale.

        The saved run's counters (skipped steps, retries, updates) are kept; what drives the
        scale from here (the run of clean steps, the hysteresis, the skips in a row) starts
        afresh, as in a new scaler. Load the result with :meth:`load_state_dict` or
        :meth:`resume_from`; ``state_dict`` itself is not changed.
        """
        return {**state_dict, "scale": self._scale_value, "consecutive_skips": 0, "last_step_skipped": False}

    def __repr__(self) -> str:
        shown = [s.shown(self) for s in self._SETTINGS if s.name != "scale"]
        return ", ".join([f"{type(self).__name__}(scale={self._scale_value:g}", *shown, f"enabled={self._enabled})"])

    # ------------------------------------------------------------------ retries
    @property
    def retrying(self) -> bool:
        """True after an ``update()`` that backed the scale off to run the same batch again
        (inside :meth:`attempts`, until the next attempt starts)."""
        return self._retrying

    @property
    def passes(self) -> int:
        """Forward and backward passes that ended in an update: iterations plus retries."""
        return self.update_count + self.retried_steps

    @property
    def wasted_passes(self) -> int:
        """Passes that updated nothing: every retried attempt and every skipped iteration."""
        return self.retried_steps + self.skipped_steps

    @property
    def wasted_fraction(self) -> float:
        """``wasted_passes / passes`` (0.0 before the first update)."""
        return self.wasted_passes / self.passes if self.passes else 0.0

    def attempts(self) -> Iterator[int]:
        """Run one batch (or one accumulation window) until it steps or its retries are spent.

        Yields the attempt number (0 first). Put the batch's whole step inside::

            for _ in scaler.attempts():
                optimizer.zero_grad()
                scaler.scale(loss_fn(model(x), y)).backward()
                scaler.step(optimizer)
                scaler.update()

        With ``retries=0`` (or a disabled scaler) the body runs once. Otherwise, when the step
        overflowed, ``update()`` backs the scale off instead of ending the iteration, and the
        body runs again, with the random streams put back where they were before the first
        attempt (:class:`~amp_plugin.rng_state.RngState`), up to ``retries`` times; the last
        overflow is a skip as without retries. Only an ``update()`` inside this loop can retry.
        """
        rng = RngState() if self._enabled and self.retries > 0 else None
        self._attempt, self._retrying, self._retry_updates = 0, False, []
        try:
            while True:
                yield self._attempt
                if not self._retrying:
                    return
                self._retrying = False
                if rng is not None:
                    rng.restore()
        finally:
            self._attempt, self._retrying = None, False

    # ------------------------------------------------------------------ for subclasses
    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        """Return ``(new_scale, reason)`` for an iteration; see :class:`ScaleUpdate`."""
        raise NotImplementedError

    def _retry_scale(self) -> float | None:
        """The scale to run an overflowing batch again with, or ``None`` for no retry."""
        return None

    def _check_manual_scale(self, value: Any) -> float:
        """The float32 scale ``update(new_scale)`` sets, or ``ValueError``."""
        return to_float32(check_scale("new_scale", value))

    def _check_together(self, settings: dict[str, Any]) -> None:
        """Check what the settings' own checks cannot see alone (``ValueError``)."""

    def _checked_state(self, state_dict: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
        """The progress :meth:`load_state_dict` sets, each value checked (with the loaded
        ``settings`` at hand); ``ValueError`` names the key."""
        if "scale" not in state_dict:
            raise ValueError(
                f"The state dict has no 'scale' entry (its keys: {sorted(state_dict)}): a scaler state dict "
                "needs at least 'scale'. Pass what a scaler's state_dict() returned."
            )
        return {
            "scale": to_float32(check_scale("scale", state_dict["scale"])),
            "skipped_steps": _state_int(state_dict, "skipped_steps", 0),
            "retried_steps": _state_int(state_dict, "retried_steps", 0),
            "consecutive_skips": _state_int(state_dict, "consecutive_skips", 0),
            "update_count": _state_int(state_dict, "update_count", 0),
            "last_step_skipped": _state_bool(state_dict, "last_step_skipped", False),
        }

    def _load_trackers(self, values: dict[str, Any]) -> None:
        """Set a subclass's own trackers from :meth:`_checked_state`'s values."""

    def _after_update(self, update: ScaleUpdate) -> None:
        """Called at the end of ``update()``, state already consistent (may raise)."""

    # ------------------------------------------------------------------ internals
    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        return self._per_optimizer.setdefault(id(optimizer), _OptimizerState())

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

    def _step_scaling_aware(
        self, optimizer: torch.optim.Optimizer, state: _OptimizerState, args: tuple, kwargs: dict[str, Any]
    ) -> Any:
        """``step()`` for an optimizer with ``_step_supports_amp_scaling``: torch 2.13's protocol."""
        aware = cast(_ScalingAwareOptimizer, optimizer)
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(  # as torch.amp.GradScaler warns, which deprecates this protocol
                f"{type(self).__name__} passes itself as a keyword argument (grad_scaler=) to "
                f"{type(optimizer).__name__}.step, as torch.amp.GradScaler does until torch removes that protocol. "
                "Let the optimizer's step read the "
                "`grad_scale` and `found_inf` tensors the scaler sets on it instead (drop its grad_scaler argument).",
                FutureWarning,
                stacklevel=3,
            )
            retval = aware.step(*args, **kwargs, grad_scaler=self)
            state.stage = _Stage.STEPPED
            if state.found_inf:  # the optimizer ran the inf check through _check_inf_per_device
                self._record_step(self._found_inf_host(state), optimizer)
            return retval
        unscaled = state.stage is _Stage.UNSCALED
        if not unscaled:
            self._check_inf_per_device(optimizer)
        flags = list(state.found_inf.values())
        scale = self._device_scale(flags[0].device if flags else torch.device("cpu"))
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
        state.stage = _Stage.STEPPED
        self._record_step(self._found_inf_host(state), optimizer)
        return retval

    def _record_step(self, found: bool, optimizer: torch.optim.Optimizer) -> None:
        if self._new_iteration:
            self._new_iteration = False
            self._iteration_skipped = False
            self._skipped_by.clear()
        self._skipped_by[id(optimizer)] = found
        self._iteration_skipped |= found
        self.last_step_skipped = self._iteration_skipped

    def _may_retry(self) -> bool:
        """Inside :meth:`attempts`, with retries left, and no optimizer of the iteration stepped."""
        if self._attempt is None or self._attempt >= self.retries:
            return False
        states = [s for s in self._per_optimizer.values() if s.stage is not _Stage.READY]
        return all(self._found_inf_host(s) for s in states)

    def _begin_retry(self, old: float, new: float) -> None:
        """``update()`` for an attempt that runs again at ``new``: the iteration goes on."""
        self._per_optimizer.clear()
        self._new_iteration = True
        self.last_step_skipped = True
        self.retried_steps += 1
        self._attempt = (self._attempt or 0) + 1
        self._retrying = True
        self.last_update = ScaleUpdate(self.update_count, old, new, True, "retry")
        self._retry_updates.append(self.last_update)
        self._set_scale(new)

    # torch.amp.GradScaler's hooks for optimizers that handle the scale themselves (an optimizer
    # given grad_scaler=self may call them).
    def _get_scale_async(self) -> torch.Tensor | None:
        """The device scale tensor (``None`` before the first ``scale()``)."""
        return self._scale

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
        """Record the found-inf flags of ``optimizer``'s gradients without unscaling them."""
        state = self._state(optimizer)
        state.found_inf = _unscale_in_place(optimizer, _ones)
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

    def _found_inf_host(self, state: _OptimizerState) -> bool:
        if state.found_inf_host is None:
            flags = list(state.found_inf.values())
            if not flags:  # no gradients at all: nothing overflowed (still joins the all-reduce)
                device = self._scale.device if self._scale is not None else "cpu"
                found = torch.zeros((), dtype=torch.float32, device=device)
            else:
                found = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum()
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            if distributed and torch.distributed.get_world_size() > 1:
                found = found.clone()
                torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
            state.found_inf_host = bool(found.item() != 0)
        return state.found_inf_host

    def _iteration_found_inf(self, require: bool) -> bool:
        states = [s for s in self._per_optimizer.values() if s.stage is not _Stage.READY]
        if not states:
            if require:
                raise RuntimeError("No inf checks were recorded prior to update(): call step() or unscale_() first.")
            return False
        return any(self._found_inf_host(s) for s in states)


def _state_int(state_dict: dict[str, Any], key: str, default: int) -> int:
    value = state_dict.get(key, default)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    try:
        return check_int(key, value, ge=0)
    except TypeError as err:
        raise ValueError(str(err)) from None


def _state_bool(state_dict: dict[str, Any], key: str, default: bool) -> bool:
    value = state_dict.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not allowed: {key} must be True or False.")
    return value


def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def _unscale_in_place(optimizer: torch.optim.Optimizer, inv_scale_on) -> dict[torch.device, torch.Tensor]:
    """Unscale every gradient of ``optimizer`` in place with torch's fused inf check.

    A sparse float16 gradient is coalesced first (duplicates summed, in float16, as
    ``torch.amp.GradScaler`` does) and its values unscaled. A DTensor gradient (FSDP2) is
    unscaled on this rank's shard, with no collective: :meth:`LossScaler.step` max-reduces the
    found-inf flag across ranks once.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if is_dtensor(g):
                g = g.to_local()
                if g.numel() == 0:  # this rank holds no shard of a small parameter
                    continue
            if g.is_sparse:
                if g.dtype is torch.float16:
                    p.grad = g = g.coalesce()
                g = g._values()
            groups.setdefault((g.device, g.dtype), []).append(g)
    return unscale_grouped(groups, inv_scale_on)


def unscale_grouped(
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]],
    inv_scale_on,
    found: dict[torch.device, torch.Tensor] | None = None,
) -> dict[torch.device, torch.Tensor]:
    """Run ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group,
    adding to ``found`` (one flag per device, made as needed) and returning it."""
    if found is None:
        found = {}
    for (device, _), grads in groups.items():
        if device not in found:
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv_scale_on(device))
    return found


class StaticLossScaler(LossScaler):
    """A fixed loss scale. Steps with inf/NaN gradients are still skipped; the scale never moves.

    It has no ``torch.amp.GradScaler`` counterpart, so no growth/backoff getters and setters
    (:class:`~amp_plugin.DynamicLossScaler` has them). ``load_state_dict`` takes the
    ``"scale"`` and the counters of any scaler's state dict and ignores a dynamic scaler's
    settings: the loaded scale stays fixed from then on. Its own state dict loads into
    ``torch.amp.GradScaler`` as one whose scale never moves (growth and backoff factors 1.0),
    and into :class:`~amp_plugin.DynamicLossScaler` with that scaler's own settings.

    Args:
        scale: the constant scale: finite, > 0, inside float32's normal range.
        enabled: ``False`` makes it a pass-through.
    """

    _SETTINGS = (Setting("scale", check_scale, "g", attr="_scale_value", in_state=False),)

    def __init__(self, scale: float = 2.0**16, enabled: bool = True) -> None:
        checked = check_settings(self._SETTINGS, {"scale": scale})
        super().__init__(checked["scale"], enabled=enabled)

    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        return self._scale_value, None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            # What torch.amp.GradScaler.load_state_dict reads, for a scale that never moves;
            # "static" tells a DynamicLossScaler that these are no settings of its own.
            state.update(growth_factor=1.0, backoff_factor=1.0, growth_interval=_INT32_MAX, _growth_tracker=0)
            state["static"] = True
        return state


_INT32_MAX = 2**31 - 1
