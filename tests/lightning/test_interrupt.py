"""``GracefulInterrupt`` with Lightning's own ``ModelCheckpoint``: the checkpoint a signal writes is the
callback's ``last.ckpt``, so a run resumed from it in the same directory overwrites it at its end
(Lightning's version counter would otherwise save ``last-v1.ckpt`` beside it and leave ``last.ckpt``
at the interrupted step, for the next resume to go back to)."""

from __future__ import annotations

import signal

import pytest
import torch
from _models import TinyClassifier, as_lightning, quiet_trainer

from amp_plugin import MixedPrecisionPlugin
from amp_plugin.lightning.interrupt import GracefulInterrupt, RunInterrupted


def signal_at(pl, step: int, interrupt: GracefulInterrupt):
    class SignalAt(pl.Callback):
        """What the signal handler does, at the start of ``step``."""

        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == step:
                interrupt.requested = signal.SIGTERM

    return SignalAt()


def fit(pl, tmp_path, max_steps, callbacks, ckpt_path=None):
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)  # Lightning's defaults otherwise
    trainer = quiet_trainer(
        pl,
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[checkpoint, *callbacks],
        plugins=[MixedPrecisionPlugin("bf16_sr")],
    )
    pl.seed_everything(0)
    trainer.fit(as_lightning(pl, TinyClassifier)(), ckpt_path=ckpt_path)
    return trainer


def test_a_run_resumed_from_the_interrupt_checkpoint_overwrites_last_ckpt(pl, tmp_path):
    interrupt = GracefulInterrupt()
    with pytest.raises(RunInterrupted) as stopped:
        fit(pl, tmp_path, 12, [interrupt, signal_at(pl, 3, interrupt)])
    last = tmp_path / "last.ckpt"
    assert stopped.value.step == 4 and stopped.value.checkpoint == str(last)
    assert torch.load(last, weights_only=False)["global_step"] == 4
    fit(pl, tmp_path, 12, [GracefulInterrupt()], ckpt_path=last)
    assert torch.load(last, weights_only=False)["global_step"] == 12
    assert not list(tmp_path.glob("last-v*.ckpt"))
