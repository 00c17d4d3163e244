"""``AtomicCheckpointIO``: a checkpoint file is either the old one or the complete new one.

Lightning's ``TorchCheckpointIO`` writes through an fsspec transaction: the bytes go to a
temporary file from ``tempfile.mkstemp()`` (in ``$TMPDIR``) and are then moved to the target
with ``shutil.move``. When ``$TMPDIR`` is on another filesystem than the run directory (a
tmpfs ``/tmp``, a node-local disk next to a network file system), that move is a copy into
the target itself: a process killed during the copy leaves a truncated ``last.ckpt``, and the
previous checkpoint is gone.

This plugin writes the new file next to the target (same directory, so same filesystem),
flushes it to disk, and renames it over the target with ``os.replace``, which is atomic. A
kill at any point leaves the previous checkpoint untouched; at worst a hidden
``.partial-*.tmp`` file stays behind, whose name never matches ``*.ckpt`` or ``last``.
Remote paths (``s3://`` and the like) keep Lightning's behaviour.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from typing_extensions import override

from amp_plugin.lightning._namespace import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "atomic_save"]


def _is_local(path: str | os.PathLike[str]) -> bool:
    return isinstance(url_to_fs(str(path))[0], LocalFileSystem)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, all or nothing: write a sibling temp file, fsync, ``os.replace``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Hex digits only after the prefix: the name can never contain "last" or end in ".ckpt".
    temp = os.path.join(directory, f".partial-{os.getpid()}-{uuid.uuid4().hex}.tmp")
    try:
        with open(temp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (not possible everywhere)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic: ``Trainer(plugins=[AtomicCheckpointIO()])``.

    Used by ``train.py`` for every checkpoint (``last.ckpt``, the periodic ones and the
    ``last-good.ckpt`` written when the loss scale collapses).
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_save(checkpoint, path)
