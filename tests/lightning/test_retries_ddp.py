"""Retries under DDP on CPU (gloo, 2 processes): an overflow on one rank is retried by every rank."""

from __future__ import annotations

import pytest
import torch
from _ddp_launch import run_ddp_worker


@pytest.mark.slow
def test_every_rank_retries_together(pl, tmp_path):
    ranks = run_ddp_worker("_ddp_retry_worker.py", tmp_path, pl.__name__)
    for r in ranks:
        assert (r["retried"], r["skipped"], r["global_step"], r["scale"]) == (1, 0, 6, 512.0)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
