"""``last.ckpt`` at the final step, also when ``every_n_train_steps`` does not divide ``max_steps``.

``ModelCheckpoint(every_n_train_steps=10, save_last=True)`` in a 3005-step run writes its last
``last.ckpt`` at step 3000: the last five steps are lost to a resume, and a summary pointing at
``last.ckpt`` calls step 3000 final. :class:`FinalCheckpoint` writes ``last.ckpt`` once more when
training ends at a step that no periodic save covered.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol, cast

from typing_extensions import override

from amp_plugin.lightning.namespace import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FinalCheckpoint"]


class _SavesLast(Protocol):
    """What this reads of a ``ModelCheckpoint`` (``trainer.checkpoint_callbacks`` are typed ``Checkpoint``)."""

    CHECKPOINT_NAME_LAST: str
    FILE_EXTENSION: str
    dirpath: str
    last_model_path: str


class FinalCheckpoint(Callback):
    """At the end of training, save each ``ModelCheckpoint(save_last=True)``'s ``last.ckpt`` if it is behind."""

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for callback in trainer.checkpoint_callbacks:
            if not getattr(callback, "save_last", False) or not getattr(callback, "dirpath", None):
                continue
            if not getattr(callback, "_last_checkpoint_saved", ""):
                continue  # nothing saved yet: ModelCheckpoint's own on_train_end saves last.ckpt now
            if getattr(callback, "_last_global_step_saved", None) == trainer.global_step:
                continue
            saves_last = cast(_SavesLast, callback)  # save_last and dirpath are set: a ModelCheckpoint
            name = saves_last.CHECKPOINT_NAME_LAST + saves_last.FILE_EXTENSION
            path = saves_last.last_model_path or os.path.join(saves_last.dirpath, name)
            saves_last.last_model_path = path
            trainer.save_checkpoint(path, weights_only=False)
