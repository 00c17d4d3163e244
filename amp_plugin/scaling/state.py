"""A loss scaler's state dict: what it saves, and how a saved one is checked and loaded.

:class:`SavedState` is the part of :class:`~amp_plugin.LossScaler` that reads the class's
settings table (:mod:`amp_plugin.scaling.settings`) for ``state_dict()``,
``load_state_dict()``, ``settings()``, ``resume_from()`` and ``restarted()``. Each saved entry
is checked before anything is set (:func:`state_int`, :func:`state_bool`): a bad one is a
``ValueError`` that names its key, the value and what is allowed (a damaged checkpoint, not
a programming error).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from amp_plugin.checks import check_int, check_scale
from amp_plugin.scaling.scale_update import to_float32
from amp_plugin.scaling.settings import Setting, check_settings

__all__ = ["SavedState", "state_bool", "state_int", "state_scale"]


def state_int(state_dict: dict[str, Any], key: str, default: int) -> int:
    """``state_dict[key]`` (or ``default``) as an integer >= 0; a one-element integer tensor
    is read as an int."""
    value = state_dict.get(key, default)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    try:
        return check_int(key, value, ge=0)
    except TypeError as err:
        raise ValueError(str(err)) from None


def state_scale(state_dict: dict[str, Any]) -> float:
    """``state_dict["scale"]`` as the float32 scale it must be; a one-element floating tensor (what
    ``torch.amp.GradScaler`` accepts) is read as a float. ``ValueError`` names the key."""
    value = state_dict["scale"]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = float(value.item())
    try:
        return to_float32(check_scale("scale", value))
    except TypeError as err:
        raise ValueError(str(err)) from None


def state_bool(state_dict: dict[str, Any], key: str, default: bool) -> bool:
    """``state_dict[key]`` (or ``default``), which must be ``True`` or ``False``."""
    value = state_dict.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} is not allowed: {key} must be True or False.")
    return value


class SavedState:
    """A loss scaler's state dict, settings and resume helpers, mixed into
    :class:`~amp_plugin.LossScaler`: everything here reads the class's ``_SETTINGS`` table."""

    _SETTINGS: ClassVar[tuple[Setting, ...]] = ()
    _enabled: bool
    _scale_value: float
    skipped_steps: int
    retried_steps: int
    consecutive_skips: int
    update_count: int
    last_step_skipped: bool

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
            "scale": state_scale(state_dict),
            "skipped_steps": state_int(state_dict, "skipped_steps", 0),
            "retried_steps": state_int(state_dict, "retried_steps", 0),
            "consecutive_skips": state_int(state_dict, "consecutive_skips", 0),
            "update_count": state_int(state_dict, "update_count", 0),
            "last_step_skipped": state_bool(state_dict, "last_step_skipped", False),
        }

    def _load_trackers(self, values: dict[str, Any]) -> None:
        """Set a subclass's own trackers from :meth:`_checked_state`'s values."""

    # Provided by LossScaler.
    def _set_scale(self, value: float) -> None:
        raise NotImplementedError
