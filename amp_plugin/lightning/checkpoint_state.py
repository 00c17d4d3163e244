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
        "scaler_type": type(scaler).__name__ if scaler.is_enabled() else None,
    }


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

    A different precision, master-weight or autocast setup, or another scaler type, warns and
    keeps the configured scaler as it is. Otherwise the saved scale and its trackers are
    restored; changed scaler settings (say a new ``hysteresis``) warn and take effect from the
    next update.
    """
    ours = _setup(settings)
    saved = {"master": "fp32", **saved}  # checkpoints from before split masters existed
    differs = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
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
