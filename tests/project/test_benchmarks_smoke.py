"""Every benchmark script runs end to end in a tiny configuration and prints the table it promises.

Importing Lightning alone takes several seconds, so every script that trains is marked slow.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
END_TO_END_CONFIGS = [
    "ours fp32",
    "ours fp16",
    "ours bf16",
    "ours fp16_autocast",
    "ours bf16_autocast",
    "ours fp16_pure",
    "ours bf16_pure",
    "Lightning 32-true",
    "Lightning bf16-mixed",
    "Lightning 16-mixed (CPU GradScaler)",
    "Lightning 16-true",
    "Lightning bf16-true",
]


def run(script: str, *args: str, timeout: float = 600, check: bool = True) -> str:
    """The script's stdout; with ``check=False``, a failing run's stdout and stderr."""
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    if not check:
        assert out.returncode != 0, f"{script} {args} should have failed"
        return out.stdout + out.stderr
    assert out.returncode == 0, f"{script} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def table_rows(text: str) -> list[list[str]]:
    """Body rows of every Markdown table in ``text``, as lists of stripped cells."""
    rows = []
    for line in text.splitlines():
        if (
            line.startswith("|")
            and not line.startswith("|---")
            and not line.startswith("| config")
            and not line.startswith("| path")
            and not line.startswith("| mode")
        ):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_bench_step_prints_the_paths_the_traffic_floor_the_memory_and_the_stages():
    out = run(
        "bench_step.py", "--params", "0.2", "--chunks", "4", "--repeats", "2", "--threads", "1", "--stages", "--memory"
    )
    rows = table_rows(out)
    names = [row[0] for row in rows]
    paths = [
        "floor (fused AdamW, FP32)",
        "ours (FP16 + FP32 masters)",
        "ours, unscaled grads shown in the model (torch's AMP recipe)",
        'ours, torch multi-tensor (fused="torch")',
        "ours, stock torch ops (fused=False)",
        "ours, AdamW(foreach=True) (its own step)",
        "ours bf16_split (BF16 + remainder, 14 B/param)",
        "ours bf16_lean (+ BF16 moments, 10 B/param)",
        "ours bf16_lean, moments rounded to nearest (before)",
        "ours bf16_sr (stochastic, BF16 moments, 8 B/param)",
        "ours bf16_lean, no loss scaler (the preset's default)",
        "ours bf16_sr, no loss scaler (the preset's default)",
        "ours bf16_lean, no loss scaler, late in training (step 20,000)",
        "ours bf16_sr, no loss scaler, late in training (step 20,000)",
        'ours bf16_lean, torch multi-tensor (fused="torch")',
        'ours bf16_lean, compiled (fused="compiled")',
        'ours bf16_sr, compiled (fused="compiled")',
        "ours bf16_lean, compiled, no loss scaler (the preset's default)",
        "ours bf16_sr, compiled, no loss scaler (the preset's default)",
        "Lightning 16-mixed path",
    ]
    assert names[: len(paths)] == paths
    assert sum(name.startswith("memory-traffic floor") for name in names) == 3
    # the peak tensor memory of one step, per path: nothing beyond its state for the fused FP32 AdamW and
    # amp_plugin's CPU kernel; 4 bytes per parameter of FP32 gradients and more for the compiled lean step
    memory = {row[0]: float(row[2]) for row in rows[len(paths) + 3 : 2 * len(paths) + 3]}
    assert list(memory) == paths
    assert memory["floor (fused AdamW, FP32)"] == 0 and memory["ours bf16_lean (+ BF16 moments, 10 B/param)"] == 0
    assert memory['ours bf16_lean, compiled (fused="compiled")'] >= 16  # FP32 values, moments, gradients
    assert re.search(r"ours / Lightning 16-mixed path: [0-9.]+x", out)
    stages = [name for name in names if name[0].isdigit()]
    assert len(stages) == 5 and "sum of stages 1-5" in names
    assert [name for name in names if name.startswith("fused")] == [
        "fused A: nonfinite_check_ (reads the FP16 grads)",
        "fused B: adam_step_ (FP16 grads * 1/scale in, FP16 weights out)",
    ]
    assert "sum of fused A + B (+ stage 3)" in names and "sum of base design A + B" in names
    lean = [name for name in names if name.startswith("lean compiled ")]  # the compiled step, profiled
    assert [name[len("lean compiled ") :][:2] for name in lean] == ["1.", "2.", "3.", "4.", "5."]
    assert "lean compiled: the rest (Python, small ops, the profiler)" in names and "sum of lean compiled" in names


@pytest.mark.slow
def test_bench_emulation_prints_matmul_step_and_interception_tables():
    out = run(
        "bench_emulation.py",
        "--matmul",
        "32",
        "--d-model",
        "16",
        "--layers",
        "1",
        "--seq",
        "4",
        "--batch",
        "2",
        "--repeats",
        "1",
        "--skip-native-training",
    )
    names = [row[0] for row in table_rows(out) if row[0] not in ("variant", "context")]  # minus headers
    assert names[:5] == ["FP32", "FP16 emulated", "FP16 native", "BF16 emulated", "BF16 native"]  # (a)
    assert names[5:10] == [
        "FP32",
        "FP16 emulated",
        "BF16 emulated",
        "FP16 emulated, Python kernels",
        "FP16 emulated, mode backend",
    ]  # (b), no native
    assert "kernel backend (C++ kernels for mm), inside `keep_installed()`" in names  # (c)
    assert "kernel backend (Python kernels only), inside `keep_installed()`" in names
    assert re.search(r"FP16 emulated training step: [0-9.]+x FP32 CPU time", out)


@pytest.mark.slow
def test_host_work_of_the_master_weight_modes_stays_below_lightning_bf16_mixed():
    """On a GPU this model's step waits on the host, so the host work a mode issues is its speed.
    Counted exactly (no clock): ours with FP32 master weights must not issue more Python calls
    or computing aten ops per step than Lightning's bf16-mixed, and our autocast mode no more
    than 2% over it."""
    out = run(
        "host_work.py",
        "--steps",
        "2",
        "--configs",
        "ours bf16",
        "ours fp16",
        "ours bf16_autocast",
        "Lightning bf16-mixed",
    )
    rows = {row[0]: row for row in table_rows(out)}
    assert list(rows) == ["ours bf16", "ours fp16", "ours bf16_autocast", "Lightning bf16-mixed"]
    ratio = {name: (float(row[5].rstrip("x")), float(row[6].rstrip("x"))) for name, row in rows.items()}
    assert ratio["Lightning bf16-mixed"] == (1.0, 1.0)
    assert max(ratio["ours bf16"]) <= 1.0 and max(ratio["ours fp16"]) <= 1.0, ratio
    assert max(ratio["ours bf16_autocast"]) <= 1.02, ratio


@pytest.mark.slow
def test_bench_plugin_overhead_compares_matching_modes():
    out = run("bench_plugin_overhead.py", "--steps", "3", "--rounds", "1", "--n-embd", "16")
    assert [row[0] for row in table_rows(out)] == ["bf16 autocast", "fp32"]


@pytest.mark.slow
def test_bench_end_to_end_quick_has_every_configuration_and_memory_column():
    out = run("bench_end_to_end.py", "--quick")
    assert "## char_gpt" in out and "## digits" in out
    rows = table_rows(out)
    assert [row[0] for row in rows] == END_TO_END_CONFIGS * 2
    for row in rows:
        assert float(row[1]) > 0 and float(row[2]) > 0  # wall and CPU ms/step
        activations, fp32_part = row[7].split()  # "0.01 (0.01)": measured in-process in --quick
        assert float(activations) >= float(fp32_part.strip("()")) >= 0
        assert float(row[6]) > 0  # state MB
    assert "goal <= 1.15x" in out


@pytest.mark.slow
def test_bench_convergence_quick_writes_table_csv_json_and_plots(tmp_path):
    out = run("bench_convergence.py", "--quick", "--out-dir", str(tmp_path))
    configs = ["fp32", "fp16", "bf16", "fp16_autocast", "fp16 no scaling", "fp16 no masters"]
    for recipe in ("digits", "char_gpt", "underflow_demo", "stagnation_demo"):
        assert f"## {recipe}" in out
        assert (tmp_path / f"convergence_{recipe}.png").stat().st_size > 1000
    assert [row[0] for row in table_rows(out)] == configs * 4
    csv_lines = (tmp_path / "convergence_runs.csv").read_text().splitlines()
    assert csv_lines[0].startswith("recipe,config,seed,steps") and len(csv_lines) == 1 + 24
    saved = json.loads((tmp_path / "convergence.json").read_text())
    assert set(saved["summary"]) == {"digits", "char_gpt", "underflow_demo", "stagnation_demo"}
    assert len(saved["runs"]) == 24 and all(len(r["train_loss"]) == r["steps"] for r in saved["runs"])
    # The tables can be re-made from the saved runs without training.
    again = run("bench_convergence.py", "--quick", "--from-json", str(tmp_path / "convergence.json"))
    tables = out.split("\n", 1)[1].split("\nwrote ")[0]  # after the header line, before "wrote ..."
    assert again.split("\n", 1)[1].rstrip() == tables.rstrip()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_script_declines_politely_without_a_gpu():
    out = run("gpu.py", timeout=120)
    assert "needs a CUDA device" in out and "nothing to measure" in out


def test_gpu_script_finds_the_recipes_in_a_checkout_that_is_not_installed():
    """A GPU machine runs the checkout as it is: ``recipes/`` is ``amp_plugin.recipes`` only once installed."""
    code = (
        "import sys; sys.modules['amp_plugin.recipes'] = None; "  # as where no install maps recipes/
        f"sys.path.insert(0, {str(BENCH)!r}); import gpu; gpu.recipes_of_checkout(gpu.Path({str(ROOT)!r})); "
        "from amp_plugin.recipes.char_gpt import CharGPTRecipe; print(CharGPTRecipe.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "amp_plugin.recipes.char_gpt"


@pytest.mark.slow
def test_gpu_script_runs_its_code_path_on_cpu():
    out = run(
        "gpu.py",
        "--cpu-dry-run",
        "--configs",
        "ours fp16",
        "ours bf16",
        "ours bf16_lean",
        "Lightning 32-true",
        "Lightning bf16-mixed",
        "--batch-size",
        "2",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--profile",
        "ours fp16",
    )
    rows = table_rows(out)
    assert [row[0] for row in rows] == [
        "ours fp16", "ours bf16", "ours bf16_lean", "Lightning 32-true", "Lightning bf16-mixed"
    ]  # fmt: skip
    assert all(not row[1].startswith("failed") for row in rows)
    assert [row[6] for row in rows] == ["2"] * 5  # the rounds column
    assert out.count("round 2, ") == 5  # the configurations alternate: each one in every round
    assert "ours fp16: " in out and "x FP32" in out
    assert re.search(r"- ours bf16_lean: [0-9.]+x ours bf16, peak", out)
    profile = out.split("## Profile of ours fp16", 1)[1]
    assert "aten::" in profile and "Self CPU time total" in profile


@pytest.mark.slow
def test_gpu_and_step_scripts_refuse_unknown_names_and_missing_devices():
    out = run("gpu.py", "--cpu-dry-run", "--profile", "ours fp64", check=False)
    assert "unknown configs ['ours fp64']" in out
    out = run("gpu.py", "--cpu-dry-run", "--rounds", "0", check=False)
    assert "--rounds 0: need at least 1" in out
    if not torch.cuda.is_available():
        out = run("bench_step.py", "--device", "cuda", check=False)
        assert "--device cuda: torch.cuda.is_available() is False" in out


def test_bench_moments_prints_both_tables_with_the_frozen_nearest_moments():
    out = run("bench_moments.py", "--numel", "256", "--before", "20", "--after", "200", "--betas2", "0.999")
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for scheme in ("fp32", "bf16 nearest", "bf16 stochastic", "fp16 scaled", "bf16_split, bf16 stochastic"):
        assert scheme in rows, out
    assert rows["bf16 nearest"].split("|")[4].strip() == "0.000"  # rounded to nearest, v never decreased
    assert float(rows["bf16 stochastic"].split("|")[4]) > 0.05
