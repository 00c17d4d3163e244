"""The checkpoint a run leaves behind when its loss scale collapses."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["LAST_GOOD", "save_last_good"]

LAST_GOOD = "last-good.ckpt"


def save_last_good(trainer: Any) -> str:
    """Save the trainer's state as ``last-good.ckpt`` next to its other checkpoints; return the path.

    Called when ``update()`` raises :class:`~amp_plugin.LossScaleCollapseError`: skipped
    steps change no weight, so the current state is the last one a real step produced.
    """
    callback = trainer.checkpoint_callback
    directory = getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
    path = os.path.join(directory, LAST_GOOD)
    trainer.save_checkpoint(path)
    return path
