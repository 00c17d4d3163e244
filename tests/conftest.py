"""Fixtures shared across test modules."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from _emulation_helpers import BACKENDS, DTYPES, ids

from amp_plugin import fused
from amp_plugin.lightning import NAMESPACES


def pytest_sessionstart(session) -> None:
    """Build (or load) the fused kernels once, up front: the first build takes about 25 s,
    which would otherwise land inside whichever test, or training subprocess, comes first."""
    fused.kernels()


@pytest.fixture(params=DTYPES, ids=lambda d: ids[d])
def dtype(request) -> torch.dtype:
    """FP16 and BF16: the dtypes CpuHalfEmulation emulates."""
    return request.param


@pytest.fixture(params=[*BACKENDS, "kernel-python"])
def backend(request, monkeypatch) -> str:
    """Both interception backends of CpuHalfEmulation; "kernel-python" is the "kernel" backend
    with its Python kernels only (what runs where the C++ kernels cannot be built)."""
    if request.param == "kernel-python":
        from amp_plugin.emulation import _backends

        monkeypatch.setattr(_backends, "USE_NATIVE_KERNELS", False)
        return "kernel"
    return request.param


@pytest.fixture(params=NAMESPACES, ids=lambda ns: ns.__name__)
def pl(request) -> ModuleType:
    """Each installed Lightning namespace in turn (``lightning.pytorch``, ``pytorch_lightning``):
    the plugin and callback suites run against both from one set of tests."""
    return request.param


@pytest.fixture
def simulate(monkeypatch):
    """Pretend to run on another CPU: ``simulate(simulated_cpu(...))``; the real probe comes back after."""
    from amp_plugin.emulation import _cpu

    def apply(features):
        monkeypatch.setattr(_cpu, "_detect", lambda: features)
        _cpu._clear_cache()

    yield apply
    monkeypatch.undo()
    _cpu._clear_cache()
