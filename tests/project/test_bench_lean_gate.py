"""``benchmarks/bench_lean_gate.py`` runs its gates and prints one row per regime and candidate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_lean_gate_benchmark_prints_a_row_per_regime_and_candidate_and_reuses_the_reference(tmp_path):
    out = tmp_path / "all.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_lean_gate.py"), "--regimes", "digits", "--candidates",
        "bf16_lean", "bf16_lean:nearest", "--seeds", "2", "--steps-scale", "0.01", "--dir", str(tmp_path / "runs"),
        "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| `digits`")]
    assert len(rows) == 2
    assert "| `digits`, 15 steps | `bf16_lean` | 10.12 (16.00) |" in rows[0]
    assert "`bf16_lean (moments rounded to nearest)`" in rows[1]
    assert "AMD" in done.stdout or "Intel" in done.stdout or "CPU capability" in done.stdout
    reports = json.loads(out.read_text())
    assert [r["label"] for r in reports] == ["bf16_lean", "bf16_lean:nearest"]
    assert [r["reused"] for r in reports[1]["runs"]] == [True, False] * 2  # the bf16 runs trained once
    assert "precision.moments_rounding=nearest" in reports[1]["overrides"]


def test_a_rounding_the_gate_does_not_know_is_refused():
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_lean_gate.py"), "--candidates", "bf16_lean:down"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "the rounding after ':' is nearest or stochastic" in done.stderr
