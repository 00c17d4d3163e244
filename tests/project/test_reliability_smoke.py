"""benchmarks/reliability/run.py runs two cheap fault cases end to end and reports nothing lost.

The two cases build their callbacks in the child run from ``_target_`` strings (``Throttle`` and
``SlowSetup`` in ``reliability_harness``), so this also pins down that those strings and the child's
``PYTHONPATH`` find them. Results go to ``--out`` in a temporary directory: the committed
``benchmarks/results/reliability.json`` is left as it is.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "reliability" / "run.py"
COMMITTED = ROOT / "benchmarks" / "results" / "reliability.json"
# In the order the script runs them (its registry order), with the name each has in the table.
CASES = {"deleted": "run directory deleted mid-run", "early_sigterm": "SIGTERM before the first step"}


def fault_rows(text: str) -> dict[str, list[str]]:
    """The rows of the printed fault table, by fault: the cells after the name."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| fault injected"):
            name, *cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            rows[name] = cells
    return rows


@pytest.mark.slow
def test_two_cheap_faults_run_and_lose_nothing(tmp_path):
    committed = COMMITTED.read_bytes()
    out = tmp_path / "reliability.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", *CASES, "--work", str(tmp_path / "work"), "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = fault_rows(proc.stdout)
    assert set(rows) == set(CASES.values()), proc.stdout
    for name, (lost, exact, how) in rows.items():
        assert (lost, exact) == ("no", "n/a"), f"{name}: {how}"
    assert "**Bad input: 0 tried" in proc.stdout  # --only skipped the inputs, and no earlier results were read
    results = json.loads(out.read_text())
    assert [(f["fault"], f["lost"]) for f in results["faults"]] == [(name, False) for name in CASES.values()]
    assert COMMITTED.read_bytes() == committed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reliability.json", "work"]
