"""benchmarks/bench_memory.py runs end to end on a tiny model and counts what each mode keeps.

Every configuration trains in its own process (Lightning's import alone takes seconds), so
these are marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_memory.py"
COLUMNS = ["weights", "grads", "master", "master grads", "moments", "total", "between"]


def run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, f"bench_memory.py failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def rows(text: str) -> dict[str, dict[str, float]]:
    """The table's rows: config -> the bytes-per-parameter columns."""
    table = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| config"):
            cells = [c.strip().strip("*") for c in line.strip().strip("|").split("|")]
            table[cells[0]] = dict(zip(COLUMNS, map(float, cells[1:8])))
    return table


@pytest.mark.slow
def test_bench_memory_quick_counts_each_component(tmp_path):
    out_json = tmp_path / "memory.json"
    out = run(
        "--quick",
        "--configs",
        "ours fp32",
        "ours fp16",
        "ours bf16_pure",
        "ours bf16_split",
        "Lightning bf16-mixed",
        "--out",
        str(out_json),
    )
    assert out.startswith("# Training state per parameter")
    assert "CPU: " in out and "torch " in out and "zero_grad(set_to_none=True)" in out
    table = rows(out)
    assert list(table) == ["ours fp32", "ours fp16", "ours bf16_pure", "ours bf16_split", "Lightning bf16-mixed"]
    assert table["ours fp32"] == {
        **dict.fromkeys(COLUMNS, 0.0),
        "weights": 4.0,
        "grads": 4.0,
        "moments": 8.0,
        "total": 16.0,
        "between": 12.0,
    }
    assert table["Lightning bf16-mixed"] == table["ours fp32"]
    fp16 = table["ours fp16"]  # half weights and grads, FP32 masters, moments; norms stay FP32
    assert 2.0 < fp16["weights"] < 2.1 and 3.8 < fp16["master"] < 4.0 and fp16["master grads"] == 0.0
    assert fp16["moments"] == 8.0 and 15.5 < fp16["total"] <= 16.0  # the master grads are freed by the step
    assert fp16["between"] == pytest.approx(fp16["total"] - fp16["grads"], abs=0.02)
    split = table["ours bf16_split"]  # the masters' low halves instead of FP32 masters
    assert (
        1.9 < split["master"] < 2.0 and split["master grads"] == 0.0 and 13.5 < split["total"] < 14.1
    )  # FP32 norms: 16
    assert table["ours bf16_pure"]["total"] == 8.0
    saved = json.loads(out_json.read_text())
    assert saved["meta"]["devices"] == 1 and saved["meta"]["params"] == 51456
    for row in saved["rows"]:
        assert row["peak_rss_mib"] > row["rss_imports_mib"] > 0


@pytest.mark.slow
def test_bench_memory_fsdp2_halves_the_state_per_rank():
    out = run("--quick", "--devices", "2", "--configs", "ours fp16")
    table = rows(out)
    assert list(table) == ["ours fp16 (rank 0)", "ours fp16 (rank 1)"]
    for row in table.values():  # FP32 shards (the masters), their grads, moments: 16 / 2
        assert row["total"] == 8.0 and row["master"] == 0.0
    assert "gathered in fwd" in out
