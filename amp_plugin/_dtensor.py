"""Whether a tensor is a DTensor (FSDP2's sharded tensors), cheaply and without importing FSDP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor"]

_DTENSOR: Any = None


def is_dtensor(t: Any) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch has none)."""
    global _DTENSOR
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:  # the common case, no import
        return False
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor

            _DTENSOR = DTensor
        except ImportError:  # torch built without distributed
            _DTENSOR = ()
    return isinstance(t, _DTENSOR)
