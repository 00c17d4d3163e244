"""The random number streams a forward pass may draw from, saved and put back.

A retried batch (``DynamicLossScaler(retries=N)``) runs its forward and backward again. Put
back before the retry, the streams give the retry the same dropout masks and noise as the
first attempt, and leave them after a successful retry where one successful attempt would
have left them: the run continues as if the batch had succeeded the first time.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["RngState"]


class RngState:
    """A snapshot of torch's CPU generator, every initialised CUDA generator, Python's
    ``random`` and, when NumPy is imported, NumPy's global generator."""

    __slots__ = ("_cpu", "_cuda", "_numpy", "_python")

    def __init__(self) -> None:
        self._cpu = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._python = random.getstate()
        numpy = sys.modules.get("numpy")
        self._numpy: Any = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        """Put every stream back where it was when the snapshot was taken."""
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        random.setstate(self._python)
        if self._numpy is not None:
            sys.modules["numpy"].random.set_state(self._numpy)
