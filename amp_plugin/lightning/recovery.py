"""The recovery checkpoint: the last state of a run that was healthy, for when its loss scale collapses.

``last-good.ckpt`` (:data:`LAST_GOOD`) is what to resume from after a
:class:`~amp_plugin.LossScaleCollapseError`. The state at the collapse is not it: the scale sits
at its floor after a streak of skipped steps, and a divergence that led there may already be in
the weights. :class:`RecoveryCheckpoint` therefore writes ``last-good.ckpt`` when training starts
(the state it starts from), then every ``every_n_steps`` steps, and only when the state is
healthy: every weight finite, and no step skipped in the last ``healthy_steps`` steps. An
unhealthy state keeps the previous file.

When the scale collapses, the plugin calls :func:`save_last_good`: it keeps that file, and only
without one (no such callback) writes the current state, whose weights are those before the
streak of skipped steps.

A checkpoint written here carries ``checkpoint["amp_plugin_recovery"]`` (:data:`RECOVERY_KEY`):
resuming from it starts the loss scale again at the configured ``init_scale``
(:mod:`amp_plugin.app.resume`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from amp_plugin.lightning.namespace import Callback, rank_zero_info

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LAST_GOOD", "RECOVERY_KEY", "RecoveryCheckpoint", "is_recovery_checkpoint", "save_last_good"]

LAST_GOOD = "last-good.ckpt"
RECOVERY_KEY = "amp_plugin_recovery"


def _directory(trainer: Any) -> str:
    callback = trainer.checkpoint_callback
    return getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")


def _recovery_callback(trainer: Any) -> RecoveryCheckpoint | None:
    return next((cb for cb in getattr(trainer, "callbacks", []) if isinstance(cb, RecoveryCheckpoint)), None)


def save_last_good(trainer: Any) -> str:
    """The recovery checkpoint's path, once the loss scale has collapsed.

    Keeps the healthy ``last-good.ckpt`` that :class:`RecoveryCheckpoint` wrote (in this run, or
    in the run it resumed in the same directory). Without that callback, saves the trainer's
    current state there: skipped steps change no weight, so its weights are those of the last
    real step.
    """
    callback = _recovery_callback(trainer)
    path = os.path.join(_directory(trainer), LAST_GOOD)
    if callback is not None and os.path.isfile(path):
        return path  # written while healthy, by this run (or the run it resumed in this directory)
    if callback is not None:
        callback.save(trainer, path, reason="collapse")
    else:
        trainer.save_checkpoint(path, weights_only=False)
    return path


def is_recovery_checkpoint(checkpoint: dict[str, Any], path: str | None = None) -> bool:
    """Whether ``checkpoint`` (loaded from ``path``) is a recovery checkpoint."""
    return RECOVERY_KEY in checkpoint or (path is not None and os.path.basename(path) == LAST_GOOD)


class RecoveryCheckpoint(Callback):
    """Write ``last-good.ckpt`` when training starts, then every ``every_n_steps`` steps while the run is healthy.

    Args:
        every_n_steps: how often to consider a save (optimizer steps).
        healthy_steps: a state is healthy when no step was skipped in this many steps before it
            (and every weight is finite).

    Runs without loss scaling need no recovery checkpoint (a non-finite step stops them before
    any checkpoint is written): then this callback does nothing.
    """

    def __init__(self, every_n_steps: int = 50, healthy_steps: int = 10) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("healthy_steps", healthy_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: {name} must be an integer >= 1.")
        self.every_n_steps = every_n_steps
        self.healthy_steps = healthy_steps
        self.saved_path: str | None = None
        self.saved_step: int | None = None
        self._clean_steps = 0
        self._reason: str | None = None
        self._unstepped: list[int] = []
        self._forget_on_start: list[int] = []

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The state training starts from (fresh, or the checkpoint resumed) is the first healthy
        # one: a run that diverges before the first periodic save still has one to go back to.
        self._clean_steps = 0
        for i in self._forget_on_start:  # restored from a file saved before the first step (see save)
            if i < len(trainer.optimizers):
                trainer.optimizers[i].state.clear()
        self._forget_on_start = []
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled() and self._all_finite(trainer, pl_module):
            self.save(trainer, os.path.join(_directory(trainer), LAST_GOOD), reason="start")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is None or not scaler.is_enabled():
            return
        self._clean_steps = 0 if scaler.last_step_skipped else self._clean_steps + 1
        if trainer.global_step % self.every_n_steps or self._clean_steps < self.healthy_steps:
            return
        if self._all_finite(trainer, pl_module):
            self.save(trainer, os.path.join(_directory(trainer), LAST_GOOD), reason="healthy")

    @staticmethod
    def _all_finite(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        flags = [torch.isfinite(p.detach()).all() for p in pl_module.parameters()]
        finite = bool(torch.stack(flags).all()) if flags else True
        if trainer.world_size > 1:  # the save is a collective: all ranks decide together
            flag = torch.tensor(0.0 if finite else 1.0, device=trainer.strategy.root_device)
            finite = trainer.strategy.reduce(flag, reduce_op="max").item() == 0
        return finite

    def save(self, trainer: pl.Trainer, path: str, reason: str) -> None:
        """Write the trainer's state to ``path``, marked as a recovery checkpoint."""
        self._reason = reason
        # torch's get_optimizer_state_dict (how ModelParallelStrategy saves an FSDP2 optimizer)
        # gives an optimizer without state one by stepping it with zero gradients at lr 0:
        # Adam's step count becomes 1, and the first real update would be bias-corrected as the
        # second. Before the first step, forget that state again, and mark it in the file so that
        # a run resumed from it forgets it too (on_train_start).
        self._unstepped = [i for i, optimizer in enumerate(trainer.optimizers) if not optimizer.state]
        try:
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self._reason = None
            for i in self._unstepped:
                trainer.optimizers[i].state.clear()
            self._unstepped = []
        self.saved_path, self.saved_step = path, trainer.global_step
        if reason == "collapse":
            rank_zero_info(
                f"amp_plugin: no healthy state saved yet; {path} holds the state at step "
                f"{trainer.global_step} (skipped steps changed no weight)."
            )

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._reason is None:
            return
        checkpoint[RECOVERY_KEY] = {
            "step": trainer.global_step,
            "reason": self._reason,
            "clean_steps": self._clean_steps,
        }
        if self._unstepped:
            checkpoint[RECOVERY_KEY]["unstepped_optimizers"] = list(self._unstepped)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._forget_on_start = list(checkpoint.get(RECOVERY_KEY, {}).get("unstepped_optimizers", []))
