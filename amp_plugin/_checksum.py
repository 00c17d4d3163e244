"""A checksum of a checkpoint's contents, saved in the checkpoint and checked before resuming.

``torch.load`` reads a checkpoint's zip archive without checking the tensor data, so a file with
bytes flipped in the middle (a disk or a copy error) loads without complaint and resumes from
garbage. :func:`content_digest` hashes what the checkpoint holds (SHA-256: every tensor's dtype,
shape and bytes, every number, string and key, in order); it is saved under :data:`CHECKSUM_KEY`
(:func:`amp_plugin.lightning.checkpoint_io.atomic_save`) and :func:`verify_checksum` compares it
after loading. No Lightning import: the app checks ``ckpt_path`` before importing Lightning.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import torch

__all__ = ["CHECKSUM_KEY", "content_digest", "verify_checksum", "with_checksum"]

CHECKSUM_KEY = "amp_plugin_checksum"


def _feed(digest: Any, value: Any) -> None:
    """Hash ``value`` into ``digest``: containers in order, tensors by dtype, shape and bytes, plain
    values by ``repr``; any other object by its type's name only (its ``repr`` may hold an address)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        if tensor.layout == torch.strided and not tensor.is_quantized and type(tensor) is torch.Tensor:
            data = tensor.cpu().contiguous().reshape(-1)
            if data.numel():
                digest.update(cast(Any, data.view(torch.uint8).numpy()))  # a buffer: no copy
    elif isinstance(value, dict):
        digest.update(f"D{len(value)}".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        digest.update(f"V{type(value).__name__}:{value!r}".encode())
    else:
        digest.update(f"O{type(value).__qualname__}".encode())


def content_digest(checkpoint: dict[str, Any]) -> str:
    """The SHA-256 (hex) of ``checkpoint``'s contents, without its :data:`CHECKSUM_KEY` entry."""
    digest = hashlib.sha256()
    _feed(digest, {k: v for k, v in checkpoint.items() if k != CHECKSUM_KEY})
    return digest.hexdigest()


def verify_checksum(checkpoint: Any) -> bool | None:
    """Whether a loaded checkpoint's contents match its saved checksum; None when it has none
    (written by Lightning's own ``TorchCheckpointIO`` or an older version)."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(CHECKSUM_KEY), dict):
        return None
    saved = checkpoint[CHECKSUM_KEY]
    return saved.get("algorithm") == "sha256" and saved.get("digest") == content_digest(checkpoint)


def with_checksum(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``checkpoint`` with its checksum under :data:`CHECKSUM_KEY`."""
    return {**checkpoint, CHECKSUM_KEY: {"algorithm": "sha256", "digest": content_digest(checkpoint)}}
