"""The error a dynamic loss scaler raises when the scale cannot back off any further."""

from __future__ import annotations

__all__ = ["LossScaleCollapseError"]


class LossScaleCollapseError(FloatingPointError):
    """The loss scale is at ``min_scale`` and the gradients still overflow.

    Attributes:
        scale: the scale at which it happened.
        iteration: the 0-based update index.
        consecutive_skips: how many steps in a row were skipped, this one included.
        checkpoint_path: where the last good state was saved before stopping, if it was.
    """

    def __init__(
        self, scale: float, iteration: int, consecutive_skips: int, checkpoint_path: str | None = None
    ) -> None:
        self.scale = scale
        self.iteration = iteration
        self.consecutive_skips = consecutive_skips
        self.checkpoint_path = checkpoint_path
        saved = f" The last healthy state is in {checkpoint_path}." if checkpoint_path else ""
        super().__init__(
            f"Loss scale collapsed: gradients are still inf/NaN at the minimum scale {scale:g} "
            f"(step {iteration}, {consecutive_skips} steps skipped in a row). Training cannot make "
            "progress. Try: a lower learning rate or gradient clipping; checking the data and the "
            "loss for NaN/inf; bf16 instead of fp16 (same range as fp32, common for weights "
            "pretrained in bf16); or on_min_scale='skip' to keep skipping instead of stopping." + saved
        )
