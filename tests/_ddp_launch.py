"""Run one of the DDP worker scripts beside this file (two gloo ranks on the CPU) and read each
rank's results (``rank0.pt``, ``rank1.pt``); compare what they saved bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parent


def run_ddp_worker(script: str, out: Path, *args: str) -> list[dict[str, Any]]:
    """``python tests/<script> OUT *args`` in ``out``, this checkout's amp_plugin first on the path."""
    path = os.pathsep.join([str(TESTS), str(TESTS.parent)])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(TESTS / script), str(out), *args],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in (0, 1)]


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal bit for bit: tensors (dtype included) and the dicts, lists and tuples
    holding them (an optimizer's state dict, a list of weights), compared all the way down."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        if a.is_floating_point():  # the bits: -0.0 is not 0.0, a NaN equals the same NaN
            bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            a, b = a.view(bits), b.view(bits)
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, type(a)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
