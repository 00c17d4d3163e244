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

Every checkpoint written here carries a SHA-256 of its contents under
``checkpoint["amp_plugin_checksum"]`` (:data:`CHECKSUM_KEY`, :func:`content_digest`): the bytes of
every tensor with its dtype and shape, and every number, string and key, in order. ``torch.load``
does not check tensor data, so a checkpoint with flipped bytes loads without complaint;
:func:`verify_checksum` tells (the app checks it before resuming).

A write that fails (a full disk, a quota, a file size limit, a read-only or vanished
directory) raises :class:`CheckpointWriteError`, an ``OSError`` that names the file, the
operating system's reason and what to do, instead of the ``inline_container.cc`` error
``torch.save`` reports; the previous checkpoint is still there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path
from typing import IO, Any, cast

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from typing_extensions import override

from amp_plugin._checksum import CHECKSUM_KEY, content_digest, verify_checksum, with_checksum
from amp_plugin.lightning.namespace import TorchCheckpointIO

__all__ = [
    "CHECKSUM_KEY",
    "AtomicCheckpointIO",
    "CheckpointWriteError",
    "atomic_save",
    "content_digest",
    "verify_checksum",
]


_HINTS = {
    errno.ENOSPC: "the disk is full: free space there",
    errno.EDQUOT: "the disk quota is used up: free space or ask for more",
    errno.EFBIG: "the file size limit is reached (ulimit -f): raise it",
    errno.EROFS: "the file system is read-only: point the run at a writable directory",
    errno.EACCES: "no permission to write there: make the directory writable or use another one",
    errno.EPERM: "the directory cannot be written: make it writable or use another one",
}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous file at ``path`` (if any) is intact.

    Attributes:
        path: the checkpoint file.
        cause: the underlying error (an ``OSError`` with an ``errno`` when the OS refused).
    """

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path, self.cause = path, cause
        code: Any = getattr(cause, "errno", None)  # an int, or None
        reason = f"[Errno {code}] {os.strerror(code)}" if code else " ".join(str(cause).split()) or type(cause).__name__
        hint = _HINTS.get(code, "check that the directory exists and is writable, with space to spare")
        previous = "the previous checkpoint there is intact" if os.path.exists(path) else "nothing was written"
        super().__init__(
            code,
            f"Could not write the checkpoint {path}: {reason}. Fix: {hint} "
            f"(or choose another directory with hydra.run.dir=...); {previous}.",
        )

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class _RecordingFile:
    """A binary file whose ``write`` remembers the ``OSError`` it raised (``torch.save`` swallows it)."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()


def _is_local(path: str | os.PathLike[str]) -> bool:
    return isinstance(url_to_fs(str(path))[0], LocalFileSystem)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, all or nothing: write a sibling temp file, fsync, ``os.replace``.

    A dict (a checkpoint) is saved with its :func:`content_digest` under :data:`CHECKSUM_KEY`.
    """
    path = os.fspath(path)
    if isinstance(obj, dict):
        obj = with_checksum(obj)
    directory = os.path.dirname(os.path.abspath(path))
    # Hex digits only after the prefix: the name can never contain "last" or end in ".ckpt".
    temp = os.path.join(directory, f".partial-{os.getpid()}-{uuid.uuid4().hex}.tmp")
    recorder: _RecordingFile | None = None
    try:
        os.makedirs(directory, exist_ok=True)
        with open(temp, "wb") as f:
            recorder = _RecordingFile(f)
            torch.save(obj, cast(IO[bytes], recorder))  # the file methods torch.save calls
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        cause = recorder.error if recorder is not None and recorder.error is not None else err
        if isinstance(cause, OSError) and not isinstance(cause, CheckpointWriteError):
            raise CheckpointWriteError(path, cause) from err
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
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not _is_local(path):
            # Lightning's annotation says str | Path; it handles any os.PathLike (fsspec)
            super().save_checkpoint(checkpoint, cast("str | Path", path), storage_options=storage_options)
            return
        atomic_save(checkpoint, path)
