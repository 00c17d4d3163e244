"""Retries under DDP on CPU (gloo, 2 processes): an overflow on one rank is retried by every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parents[1] / "_ddp_retry_worker.py"


@pytest.mark.slow
def test_every_rank_retries_together(pl, tmp_path):
    path = os.pathsep.join([str(WORKER.parent), str(WORKER.parent.parent)])  # this checkout's amp_plugin
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), pl.__name__],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r in ranks:
        assert (r["retried"], r["skipped"], r["global_step"], r["scale"]) == (1, 0, 6, 512.0)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
