"""DDP on CPU (gloo, 2 processes): an overflow on one rank is skipped by every rank."""

from __future__ import annotations

import pytest
import torch
from _ddp_launch import run_ddp_worker


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_ranks_agree_on_skips(pl, tmp_path, precision):
    ranks = run_ddp_worker("_ddp_worker.py", tmp_path, precision, pl.__name__)
    for r in ranks:
        assert r["skipped"] == 2 and r["global_step"] == 8
    assert ranks[0]["scale"] == ranks[1]["scale"]
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
