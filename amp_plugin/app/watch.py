"""Stop a run whose directory disappears while it trains, with one line instead of a traceback.

A run directory deleted under a running job (a cleanup script, ``rm -rf outputs``) makes the next
write of a logger, a monitor or a checkpoint fail with ``FileNotFoundError`` somewhere inside
Lightning; a checkpoint write would even create the directory again, holding that one file.
:class:`RunDirWatch` checks that the directory is still there before and after every training
step (one ``stat``) and stops the run with :class:`~amp_plugin.app.rundir.RunDirGone`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from amp_plugin.app.rundir import RunDirGone
from amp_plugin.lightning.namespace import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["RunDirWatch"]


class RunDirWatch(Callback):
    """Raise :class:`~amp_plugin.app.rundir.RunDirGone` once ``output_dir`` no longer exists.

    Args:
        output_dir: the run's directory.
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)

    def _check(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero and not self.output_dir.is_dir():
            raise RunDirGone(self.output_dir, trainer.global_step)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._check(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check(trainer)
