"""What one ``update()`` of a loss scaler did, and the float32 a scale is stored in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ScaleUpdate", "to_float32"]


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
            ``"growth"`` (grew after ``growth_interval`` clean steps, or earlier from the
            gradients' headroom with ``DynamicLossScaler(early_growth_interval=N)``; a growth
            capped at ``max_scale`` still counts), ``"overflow"`` (backed off), ``"hysteresis"``
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
