"""Two gloo processes: after ``Fp8Layers.update()`` every rank holds the scales of the max amax."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp_plugin.fp8 import reference_scale

WORKER = Path(__file__).resolve().parents[1] / "_fp8_ddp_worker.py"
ROOT = WORKER.parents[1]


@pytest.mark.slow
def test_amax_is_max_reduced_across_two_gloo_ranks(tmp_path) -> None:
    init = tmp_path / "init"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), str(init), str(tmp_path)], cwd=ROOT, env=env)
        for rank in range(2)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # a rank that failed leaves the other waiting at the rendezvous
    assert codes == [0, 0]
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert not torch.equal(ranks[0]["local"], ranks[1]["local"])
    reduced = torch.maximum(ranks[0]["local"], ranks[1]["local"])
    expected = [
        float(torch.tensor(reference_scale(a, 1.0, m, 0, 1e-12)))
        for a, m in zip(reduced.tolist(), [448.0, 448.0, 57344.0])
    ]
    for r in ranks:
        assert r["scale"].tolist() == expected
