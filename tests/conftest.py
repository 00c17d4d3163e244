"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest
import torch
from _emulation_helpers import BACKENDS, DTYPES, ids


@pytest.fixture(params=DTYPES, ids=lambda d: ids[d])
def dtype(request) -> torch.dtype:
    """FP16 and BF16: the dtypes CpuHalfEmulation emulates."""
    return request.param


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Both interception backends of CpuHalfEmulation."""
    return request.param
