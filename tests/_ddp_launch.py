"""Run one of the DDP worker scripts beside this file (two gloo ranks on the CPU) and read each
rank's results (``rank0.pt``, ``rank1.pt``)."""

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
