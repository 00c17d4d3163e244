"""The plugin's part of a Lightning checkpoint: what it saves, and what a resume does with it.

It lives under ``checkpoint["amp_plugin"]`` (:data:`CHECKPOINT_KEY`), not under the plugin's
class name, so renaming or subclassing the plugin never drops the scaler state. The FP32
masters are in each optimizer's state dict (``"master_params"``).
"""

from __future__ import annotations

import warnings
from typing import Any

from amp_plugin.settings import PrecisionSettings

__all__ = ["CHECKPOINT_KEY", "restore", "section"]

CHECKPOINT_KEY = "amp_plugin"
"""Where the plugin's state lives in a Lightning checkpoint (stable across class renames)."""


def _setup(settings: PrecisionSettings) -> dict[str, Any]:
    scaler = settings.scaler
    return {
        "precision": settings.precision,
        "master_weights": settings.master_weights,
        "autocast": settings.autocast,
        "master": settings.master,
        "moments": settings.moments,
        "fp8_gemms": settings.fp8 is not None,  # (the FP8 layers' own state is under "fp8")
        "scaler_type": type(scaler).__name__ if scaler.is_enabled() else None,
    }


_ADDED = ("moments",)
"""A key a checkpoint written before it lacks: compared only where it has it."""


def section(settings: PrecisionSettings) -> dict[str, Any]:
    """The checkpoint entry for a run with ``settings``."""
    return {
        "version": 1,
        **_setup(settings),
        "scaler": settings.scaler.state_dict(),
        "master_params_in": "optimizer_states[i]['master_params']" if settings.master_weights else None,
    }


def restore(settings: PrecisionSettings, saved: dict[str, Any]) -> None:
    """Continue from a checkpoint's entry under the settings configured now.

    A different precision, master-weight, moment or autocast setup, FP8 on one side only (its amax
    histories are then dropped or start afresh), or another scaler type, warns and keeps the
    configured scaler as it is. Otherwise the saved scale and its trackers are
    restored; changed scaler settings (say a new ``hysteresis``) warn and take effect from the
    next update.
    """
    ours = _setup(settings)
    # checkpoints from before split masters, or before this record of FP8 (its layers' state says it)
    saved = {"master": "fp32", "fp8_gemms": "fp8" in saved, **saved}
    differs = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v and (k in saved or k not in _ADDED)}
    if differs:
        detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differs.items())
        warnings.warn(
            f"Resuming with a different mixed-precision setup ({detail}). The model weights and optimizer "
            "state are reused; the checkpoint's loss-scaler state is "
            + ("not restored (different scaler type)." if "scaler_type" in differs else "restored."),
            stacklevel=3,
        )
    if "scaler_type" in differs or not saved.get("scaler") or not settings.scaler.is_enabled():
        return
    changed = settings.scaler.resume_from(saved["scaler"])
    if changed:
        warnings.warn(
            "Loss-scaler settings changed since the checkpoint (" + ", ".join(changed) + "); the scale and its "
            "trackers continue from the checkpoint under the new settings.",
            stacklevel=3,
        )
