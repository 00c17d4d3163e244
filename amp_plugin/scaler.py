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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from amp_plugin._checks import check_number

__all__ = ["LossScaler", "StaticLossScaler", "ScaleUpdate", "to_float32"]


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
            (``update(new_scale)``).
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


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class _OptimizerState:
    __slots__ = ("stage", "found_inf", "found_inf_host")

    def __init__(self) -> None:
        self.stage = _Stage.READY
        self.found_inf: dict[torch.device, torch.Tensor] = {}
        self.found_inf_host: bool | None = None


class LossScaler:
    """Base class: the ``torch.amp.GradScaler`` interface around a scale policy.

    Args:
        init_scale: the starting scale.
        enabled: ``False`` makes every method a pass-through (``scale`` returns its input,
            ``step`` just steps), so a loop needs no branches for fp32/bf16.
    """

    def __init__(self, init_scale: float, enabled: bool = True) -> None:
        self._enabled = bool(enabled)
        self._scale_value = to_float32(check_number("init_scale", init_scale, gt=0.0))
        self._scale: torch.Tensor | None = None  # device copy, created on first use
        self._inv_scales: dict[torch.device, torch.Tensor] = {}  # 1/scale per device, until the scale changes
        self._per_optimizer: dict[int, _OptimizerState] = {}
        self._iteration_skipped = False
        self._new_iteration = True
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.update_count = 0
        self.last_step_skipped = False
        self.last_update: ScaleUpdate | None = None

    # ------------------------------------------------------------------ public API
    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). Never waits for the device."""
        return self._scale_value if self._enabled else 1.0

    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> Any:
        """Multiply a tensor, or a (nested) list/tuple of tensors, by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._device_scale(outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable) and not isinstance(outputs, (str, bytes)):
            return map(self.scale, outputs)
        raise TypeError(f"scale() takes a tensor or an iterable of tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and record whether any is inf/NaN.

        An optimizer that owns master copies (:class:`~amp_plugin.MasterWeightOptimizer`)
        reads its model's half-precision gradients and writes unscaled FP32 master gradients
        in the same call. Other optimizers are unscaled in place. Call it at most once per
        optimizer between ``update()`` calls (for example before clipping).
        """
        if not self._enabled:
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

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then call ``optimizer.step(*args, **kwargs)`` unless a gradient
        was inf/NaN. Returns what ``optimizer.step`` returned, or ``None`` when skipped.

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
        if state.stage is _Stage.READY:
            self.unscale_(optimizer)
        found = self._found_inf_host(state)
        state.stage = _Stage.STEPPED
        if self._new_iteration:
            self._new_iteration = False
            self._iteration_skipped = False
        self._iteration_skipped |= found
        self.last_step_skipped = self._iteration_skipped
        if found:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: apply the scale policy once, whatever the number of optimizers.

        Raises:
            LossScaleCollapseError: from :class:`DynamicLossScaler` when the scale is due to
                back off below ``min_scale`` and ``on_min_scale="raise"``.
        """
        if not self._enabled:
            return
        old = self._scale_value
        if new_scale is not None:
            found = self._iteration_found_inf(require=False)
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            new, reason = to_float32(check_number("new_scale", value, gt=0.0)), "manual"
        else:
            found = self._iteration_found_inf(require=True)
            new, reason = self._policy(found)
        self._per_optimizer.clear()
        self._new_iteration = True
        self.last_step_skipped = found
        self.skipped_steps += int(found)
        self.consecutive_skips = self.consecutive_skips + 1 if found else 0
        self.last_update = ScaleUpdate(self.update_count, old, new, found, reason)
        self.update_count += 1
        self._set_scale(new)
        self._after_update(self.last_update)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly; ``{}`` when disabled (like GradScaler)."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scale_value,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "update_count": self.update_count,
            "last_step_skipped": self.last_step_skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from a ``torch.amp.GradScaler`` state dict."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled scaler."
            )
        self._set_scale(to_float32(float(state_dict["scale"])))
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self.update_count = int(state_dict.get("update_count", 0))
        self.last_step_skipped = bool(state_dict.get("last_step_skipped", False))

    def settings(self) -> dict[str, Any]:
        """The constructor arguments that shape the scale policy (not its progress)."""
        return {}

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.get_scale():g}, enabled={self._enabled})"

    # ------------------------------------------------------------------ for subclasses
    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        """Return ``(new_scale, reason)`` for an iteration; see :class:`ScaleUpdate`."""
        raise NotImplementedError

    def _after_update(self, update: ScaleUpdate) -> None:
        """Called at the end of ``update()``, state already consistent (may raise)."""

    # ------------------------------------------------------------------ internals
    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        return self._per_optimizer.setdefault(id(optimizer), _OptimizerState())

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
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                if torch.distributed.get_world_size() > 1:
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


def _unscale_in_place(optimizer: torch.optim.Optimizer, inv_scale_on) -> dict[torch.device, torch.Tensor]:
    """Unscale every gradient of ``optimizer`` in place with torch's fused inf check."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                p.grad = g = g.coalesce()
                g = g._values()
            groups.setdefault((g.device, g.dtype), []).append(g)
    return unscale_grouped(groups, inv_scale_on)


def unscale_grouped(
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]], inv_scale_on
) -> dict[torch.device, torch.Tensor]:
    """Run ``torch._amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group."""
    found: dict[torch.device, torch.Tensor] = {}
    for (device, _), grads in groups.items():
        if device not in found:
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv_scale_on(device))
    return found


class StaticLossScaler(LossScaler):
    """A fixed loss scale. Steps with inf/NaN gradients are still skipped; the scale never moves.

    Args:
        scale: the constant scale, a finite number > 0.
        enabled: ``False`` makes it a pass-through.
    """

    def __init__(self, scale: float = 2.0**16, enabled: bool = True) -> None:
        super().__init__(check_number("scale", scale, gt=0.0), enabled=enabled)

    def _policy(self, found_inf: bool) -> tuple[float, str | None]:
        return self._scale_value, None

    def settings(self) -> dict[str, Any]:
        return {"scale": self._scale_value}

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self._scale_value:g}, enabled={self._enabled})"
