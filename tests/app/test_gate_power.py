"""``amp-gate`` has power against BF16 Adam moments that cannot shrink.

``recipe=bert_grad_drop`` (AdamW at torch's default betas, every gradient 10x smaller from step 100 on),
400 steps, four paired seeds: ``bf16_lean`` with its moments rounded to nearest
(``precision.moments_rounding=nearest``, an ``exp_avg_sq`` that cannot shrink at beta2 = 0.999) is worse
than ``bf16``, far outside the noise band; with the default stochastic rounding it is within noise. Both
gates share one ``--dir``: the key does nothing to ``bf16``'s FP32 moments, so its runs train once.
"""

from __future__ import annotations

import json

import pytest

from amp_plugin.app.gate import main

REGIME = ["recipe=bert_grad_drop", "trainer.max_steps=400", "--tolerance", "0.001"]
"""The regime, and a band of at least 0.1% of ``bf16``'s loss: at this learning rate paired seeds agree to
about 0.01%, so two SE alone would call a 0.02% difference of stochastic rounding significant."""


@pytest.mark.slow
def test_moments_rounded_to_nearest_fail_the_gate_and_stochastic_ones_pass(tmp_path, capsys):
    common = ["precision=bf16_lean", *REGIME, "--against", "bf16", "--seeds", "4", "--dir", str(tmp_path)]

    nearest = tmp_path / "nearest.json"
    assert main([*common, "precision.moments_rounding=nearest", "--json", str(nearest)]) == 1
    out = capsys.readouterr().out
    assert "verdict: worse (exit 1)" in out and len(out.splitlines()) < 20
    before = json.loads(nearest.read_text())
    loss = before["metrics"][0]
    assert loss["metric"] == "val/loss" and loss["verdict"] == "worse"
    assert loss["diff"] > 2 * loss["band"] > 0  # not at the edge of the band
    assert loss["diff"] > 10 * loss["se"]
    a, b = loss["a"], loss["b"]
    assert all(x > y for x, y in zip(a, b)), (a, b)

    stochastic = tmp_path / "stochastic.json"
    assert main([*common, "--json", str(stochastic)]) == 0
    out = capsys.readouterr().out
    assert "verdict: within noise (exit 0)" in out and len(out.splitlines()) < 20
    after = json.loads(stochastic.read_text())
    assert after["verdict"] == "within noise"
    assert [r["reused"] for r in after["runs"]] == [True, False] * 4  # the same bf16 runs as before
    shift = after["metrics"][0]
    assert shift["b"] == b and abs(shift["diff"]) <= shift["band"] < loss["diff"] / 2
    for report in (before, after):  # both candidates store their moments in BF16: 2 + 2 bytes per parameter
        assert report["sides"]["bf16_lean"]["bytes_per_param"]["moments"] < 4.2
        assert report["sides"]["bf16"]["bytes_per_param"]["moments"] > 8.0
