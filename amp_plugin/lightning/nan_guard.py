"""Stop a run whose loss or weights stop being finite when no loss scaler skips the step.

With a dynamic loss scaler an inf/NaN gradient skips the step and the weights stay as they
were. Without one (``fp32``, ``bf16``), a NaN loss becomes NaN gradients and then NaN weights,
and every later step trains nothing while the run goes on to "finish". :class:`NonFiniteGuard`
checks the loss and the weights after every step that was not skipped and raises
:class:`NonFiniteError` at the first bad one. It runs before ``ModelCheckpoint`` (Lightning
orders checkpoint callbacks last), so no checkpoint with non-finite weights is ever written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from amp_plugin.lightning.namespace import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["NonFiniteError", "NonFiniteGuard"]


class NonFiniteError(FloatingPointError):
    """The loss or the weights became inf/NaN on a step that no loss scaler skipped.

    Attributes:
        step: the 0-based optimizer step that produced them.
        loss_finite: whether that step's loss was finite.
        bad_params: names of the parameters that hold inf/NaN (the first few).
        checkpoint_dir: where the checkpoints with finite weights are.
    """

    def __init__(
        self, step: int, loss_finite: bool, bad_params: list[str], precision: str, checkpoint_dir: str | None = None
    ) -> None:
        self.step, self.loss_finite, self.bad_params = step, loss_finite, bad_params
        self.checkpoint_dir = checkpoint_dir
        what = [] if loss_finite else ["the loss is inf/NaN"]
        if bad_params:
            what.append(
                "the weights are no longer finite ("
                + ", ".join(bad_params[:3])
                + (", ..." if len(bad_params) > 3 else "")
                + ")"
            )
        scaler = "no loss scaler skips such a step"
        kept = (
            f" Every checkpoint in {checkpoint_dir} has finite weights (this guard stops the run before a "
            "non-finite state is saved)."
            if checkpoint_dir
            else ""
        )
        super().__init__(
            f"Non-finite values at step {step}: {' and '.join(what)}; with precision={precision} {scaler}, so "
            "training cannot continue. Try: a lower learning rate (recipe.lr) or gradient clipping "
            "(trainer.gradient_clip_val=1.0); checking the data and the loss for NaN/inf; or precision=fp16 with "
            "scaler=dynamic, which skips such steps." + kept
        )


class NonFiniteGuard(Callback):
    """Raise :class:`NonFiniteError` after the first step with a non-finite loss or weight, in runs
    without loss scaling (with a scaler, such steps are skipped, and a scale that cannot go
    lower stops the run with ``LossScaleCollapseError``)."""

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        loss_ok = not isinstance(loss, torch.Tensor) or bool(torch.isfinite(loss.detach()).all())
        params = [(name, p) for name, p in pl_module.named_parameters() if p.is_floating_point()]
        flags = [torch.isfinite(p.detach()).all() for _, p in params]
        weights_ok = bool(torch.stack(flags).all()) if flags else True
        ok = loss_ok and weights_ok
        if trainer.world_size > 1:  # every rank stops at the same step
            flag = torch.tensor(0.0 if ok else 1.0, device=trainer.strategy.root_device)
            ok = trainer.strategy.reduce(flag, reduce_op="max").item() == 0
        if ok:
            return
        bad = [name for (name, _), good in zip(params, flags) if not bool(good)]
        from amp_plugin.lightning.interrupt import checkpoint_dir

        precision = getattr(getattr(plugin, "settings", None), "preset", None) or str(trainer.precision)
        raise NonFiniteError(trainer.global_step - 1, loss_ok, bad, precision, checkpoint_dir(trainer))
