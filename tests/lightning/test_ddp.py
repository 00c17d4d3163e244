"""DDP on CPU (gloo, 2 processes): an overflow on one rank is skipped by every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).resolve().parents[1] / "_ddp_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_ranks_agree_on_skips(pl, tmp_path, precision):
    env = {**os.environ, "PYTHONPATH": str(WORKER.parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), precision, pl.__name__],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r in ranks:
        assert r["skipped"] == 2 and r["global_step"] == 8
    assert ranks[0]["scale"] == ranks[1]["scale"]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
