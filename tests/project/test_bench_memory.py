"""benchmarks/bench_memory.py runs end to end on a tiny model and counts what each mode keeps.

Every configuration trains in its own process (Lightning's import alone takes seconds), so
these are marked slow.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from amp_plugin.settings import PRESETS

ROOT = Path(__file__).resolve().parents[2]
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


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_preset_this_build_lacks_is_a_row_saying_so_with_no_numbers():
    bench = _load_bench()
    args = argparse.Namespace(devices=2)
    rows_ = bench.run_config("ours bf16_nope", args)  # returns before starting a process
    reason = "absent: bf16_nope is not a preset of this build (amp_plugin.settings.PRESETS)"
    assert rows_ == [{"config": "ours bf16_nope", "rank": r, "absent": reason} for r in (0, 1)]
    assert bench.table(rows_, 2).splitlines()[2] == f"| ours bf16_nope (rank 0) | {reason} |"
    assert bench.absent("ours bf16") is None and bench.absent("Lightning bf16-true") is None
    names = bench.config_names(1)
    assert {"ours bf16_split", "ours bf16_lean", "ours bf16_sr", "Lightning bf16-mixed", "Lightning bf16-true"} <= set(
        names
    )


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
        "ours bf16_lean",
        "ours bf16_sr",
        "Lightning bf16-mixed",
        "--out",
        str(out_json),
    )
    assert out.startswith("# Training state per parameter")
    assert "CPU: " in out and "torch " in out and "zero_grad(set_to_none=True)" in out
    absent = [f"ours {p}" for p in ("bf16_lean", "bf16_sr") if p not in PRESETS]
    for name in absent:
        assert f"| {name} | absent: " in out
    table = rows("\n".join(line for line in out.splitlines() if "| absent: " not in line))
    assert list(table) == [
        "ours fp32",
        "ours fp16",
        "ours bf16_pure",
        "ours bf16_split",
        *(f"ours {p}" for p in ("bf16_lean", "bf16_sr") if p in PRESETS),
        "Lightning bf16-mixed",
    ]
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
    if "bf16_lean" in PRESETS:  # BF16 moments: 2 + 2 instead of 4 + 4 (the FP32 norm layers keep theirs)
        lean = table["ours bf16_lean"]
        assert 1.9 < lean["master"] < 2.0 and 4.0 <= lean["moments"] < 4.2 and 9.9 < lean["total"] < 10.4
    if "bf16_sr" in PRESETS:  # no master: BF16 weight, gradient and moments
        sr = table["ours bf16_sr"]
        assert sr["master"] == 0.0 and 4.0 <= sr["moments"] < 4.2 and 7.9 < sr["total"] < 8.4
    saved = json.loads(out_json.read_text())
    assert saved["meta"]["devices"] == 1 and saved["meta"]["params"] == 51456
    for row in saved["rows"]:
        if "absent" in row:
            assert row["config"] in absent and set(row) == {"config", "rank", "absent"}
            continue
        assert row["peak_rss_mib"] > row["rss_imports_mib"] > 0


@pytest.mark.slow
def test_bench_memory_fsdp2_halves_the_state_per_rank():
    out = run("--quick", "--devices", "2", "--configs", "ours fp16")
    table = rows(out)
    assert list(table) == ["ours fp16 (rank 0)", "ours fp16 (rank 1)"]
    for row in table.values():  # FP32 shards (the masters), their grads, moments: 16 / 2
        assert row["total"] == 8.0 and row["master"] == 0.0
    assert "gathered in fwd" in out
