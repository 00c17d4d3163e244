"""Stop on SIGTERM or SIGINT the way a cluster scheduler expects: finish the step, checkpoint, exit 128+N.

SLURM and Kubernetes pre-empt a job with SIGTERM, then SIGKILL a grace period later; Ctrl+C
sends SIGINT. Lightning's own SIGTERM handler only sets ``trainer.received_sigterm`` and later
raises ``SIGTERMException``, a ``SystemExit`` with no code (exit status 0) and no checkpoint.

:class:`GracefulInterrupt` replaces the SIGTERM and SIGINT handlers while training runs
(Lightning restores the previous ones when it tears down). At the end of the step during which
a signal arrived (the point where ``ModelCheckpoint`` saves), it writes ``last.ckpt`` at that
step, lets Lightning log the step, and then stops the run with :class:`RunInterrupted` (before
a validation or the next step, whichever comes first), which carries the signal, the step and
the checkpoint path. If Lightning's ``SIGTERMException`` ends the run first,
:attr:`GracefulInterrupt.pending` holds the same information. The app turns it into a
``FAILED`` note with the resume command and exit status ``128 + signal`` (143 for SIGTERM, 130
for SIGINT). Under DDP a SIGTERM to the launching process is passed on to the ranks it started
(as Lightning's handler does), and every rank sees the request at the same step (one
all-reduce per step), so all ranks save and stop together. A second SIGINT stops at once,
without a checkpoint. A signal during the last step lets the run finish.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from amp_plugin.lightning.namespace import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["GracefulInterrupt", "RunInterrupted", "checkpoint_dir"]


class RunInterrupted(BaseException):
    """A signal stopped the run after a step; a checkpoint at that step was saved.

    A ``BaseException`` (like ``KeyboardInterrupt``), so ``except Exception`` in user code
    does not swallow it.

    Attributes:
        signum: the signal (``signal.SIGTERM``, ``signal.SIGINT``).
        step: ``trainer.global_step`` when the run stopped (the checkpoint's step).
        checkpoint: the checkpoint written at ``step``.
        exit_code: ``128 + signum``, the shell's convention for "terminated by this signal".
    """

    def __init__(self, signum: int, step: int, checkpoint: str | None) -> None:
        self.signum = int(signum)
        self.step = step
        self.checkpoint = checkpoint
        saved = f"; checkpoint at that step: {checkpoint}" if checkpoint else ""
        super().__init__(f"{self.signal_name} received: the run stopped after step {step}{saved}")

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def checkpoint_dir(trainer: pl.Trainer) -> str:
    """Where the trainer's checkpoints go: the ``ModelCheckpoint``'s ``dirpath``, else ``<root>/checkpoints``."""
    callback = trainer.checkpoint_callback
    return getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")


class GracefulInterrupt(Callback):
    """On SIGTERM or SIGINT: finish the current step, save ``last.ckpt``, raise :class:`RunInterrupted`.

    Args:
        filename: the checkpoint written in the trainer's checkpoint directory.
    """

    def __init__(self, filename: str = "last.ckpt") -> None:
        self.filename = filename
        self.requested: int | None = None  # the signal to stop for
        self.pending: RunInterrupted | None = None  # saved, about to stop

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning registered its own handlers (it restores the previous ones at teardown).
        # Its SIGTERM handler would also make validation raise in the middle of a batch loop,
        # on each rank at its own batch; this one leaves the stop to the end of a training step.
        self.requested, self.pending = None, None
        if threading.current_thread() is not threading.main_thread():
            return
        launcher = trainer.strategy.launcher
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, functools.partial(self._on_signal, launcher))

    def _on_signal(self, launcher: Any, signum: int, frame: Any) -> None:
        if self.requested is not None and signum == signal.SIGINT:  # asked twice: stop now, no checkpoint
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        first = self.requested is None
        self.requested = self.requested or signum
        if first and signum == signal.SIGTERM and launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)  # DDP children started by Lightning stop with us (as Lightning's handler does)
        if first:
            name = signal.Signals(signum).name
            again = " Press Ctrl+C again to stop at once, without one." if signum == signal.SIGINT else ""
            print(
                f"\n{name} received: stopping after this step and saving a checkpoint.{again}",
                file=sys.stderr,
                flush=True,
            )

    def _stop_signal(self, trainer: pl.Trainer) -> int:
        signum = self.requested or (signal.SIGTERM if trainer.received_sigterm else 0)
        if trainer.world_size > 1:  # every rank must stop (and save, a collective) at the same step
            flag = torch.tensor(float(signum), device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        return int(signum)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.pending is not None:
            return
        signum = self._stop_signal(trainer)
        if not signum or _last_step(trainer):
            return
        path = os.path.join(checkpoint_dir(trainer), self.filename)
        _record_as_last(trainer, path)
        trainer.save_checkpoint(path, weights_only=False)
        self.pending = RunInterrupted(signum, trainer.global_step, path)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.pending is not None and not trainer.sanity_checking:
            raise self.pending

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.pending is not None:
            raise self.pending


def _record_as_last(trainer: pl.Trainer, path: str) -> None:
    """Tell each ``ModelCheckpoint(save_last=True)`` whose last checkpoint ``path`` is that it wrote it,
    before the save (its state is part of the checkpoint, as ``ModelCheckpoint`` itself does): a run
    resumed from ``path`` then overwrites it at its end. Otherwise the resumed callback finds a file it
    did not write and saves ``last-v1.ckpt`` beside it, leaving ``last.ckpt`` at the interrupted step
    (and a second resume from it would lose every step since)."""
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if not getattr(callback, "save_last", False) or not dirpath:
            continue
        name = getattr(callback, "CHECKPOINT_NAME_LAST", "last") + getattr(callback, "FILE_EXTENSION", ".ckpt")
        if os.path.abspath(os.path.join(dirpath, name)) == os.path.abspath(path):
            callback.last_model_path = path  # type: ignore[attr-defined]


def _last_step(trainer: pl.Trainer) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps
