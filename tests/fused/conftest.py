"""The fused kernels, built (or loaded) once for the kernel tests."""

from __future__ import annotations

import pytest

from amp_plugin import fused


@pytest.fixture(scope="module")
def ops():
    ops = fused.kernels()
    assert ops is not None, f"the fused kernels did not build here: {fused.unavailable_reason()}"
    return ops
