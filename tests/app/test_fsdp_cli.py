"""``strategy=fsdp`` through the CLI: two CPU processes (gloo) shard the recipe with FSDP2.

As a user runs it: ``python train.py precision=fp16 strategy=fsdp trainer.accelerator=cpu
trainer.devices=2``. The sharded run trains like the DDP run of the same config (same data
split, same FP32 master arithmetic), an overflow injected on one rank is skipped by both, and
its ``last.ckpt`` (one file, gathered on rank 0) resumes in place under FSDP and in a single
process.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cli_procs import ROOT, env

TWO_CPU = [
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.enable_progress_bar=false",
    "plot=false",
    "scaler.growth_interval=4",
]


def train(cwd: Path, *args: str) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir="))
    return json.loads((cwd / run_dir / "summary.json").read_text()), result.stdout + result.stderr


def scale_events(run: Path) -> list[dict[str, str]]:
    with open(run / "logs" / "scale_events.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_trains_like_ddp_skips_together_and_resumes(tmp_path):
    fault = ["+fault.rank=1", "+fault.inject_inf_at=[3]"]  # rank 1's gradients only
    fsdp, printed = train(
        tmp_path, "precision=fp16", "strategy=fsdp", *TWO_CPU, *fault, "trainer.max_steps=10", "hydra.run.dir=fsdp"
    )
    ddp, _ = train(
        tmp_path, "precision=fp16", "strategy=ddp", *TWO_CPU, *fault, "trainer.max_steps=10", "hydra.run.dir=ddp"
    )

    assert fsdp["strategy"] == {"name": "ModelParallelStrategy", "processes": 2, "sharded": True}
    assert ddp["strategy"] == {"name": "DDPStrategy", "processes": 2, "sharded": False}
    assert "FSDP2: the FP32 sharded parameters are the master weights" in fsdp["plugin_settings"]["describe"]
    assert "strategy     ModelParallelStrategy, 2 processes" in printed
    # Both ranks skipped step 3 (rank 0's gradients were finite): one skip, one backoff, same scale as DDP.
    for summary in (fsdp, ddp):
        assert summary["skipped_steps"] == 1 and summary["loss_scale"]["backoffs"] == 1
    assert [e["step"] for e in scale_events(tmp_path / "fsdp")] == [e["step"] for e in scale_events(tmp_path / "ddp")]
    assert fsdp["loss_scale"]["end"] == ddp["loss_scale"]["end"]
    # Adam counted the 9 real steps on both (saving FSDP2's optimizer state before the first step,
    # as the recovery checkpoint does, must not count as one: torch initialises it with a step).
    for run in ("fsdp", "ddp"):
        state = torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=False)["optimizer_states"][0]
        assert {float(s["step"]) for s in state["state"].values()} == {9.0}, run
    # The same maths, sharded or replicated: FP16 compute, FP32 masters, FP32 gradient reduction.
    for key in ("train/loss", "val/loss"):
        assert math.isclose(fsdp["final_metrics"][key], ddp["final_metrics"][key], rel_tol=2e-2), key

    # Resume in place under FSDP, then from the same kind of file in one process.
    resumed, printed = train(
        tmp_path,
        "precision=fp16",
        "strategy=fsdp",
        *TWO_CPU,
        "trainer.max_steps=14",
        "ckpt_path=fsdp/checkpoints/last.ckpt",
        "hydra.run.dir=fsdp",
    )
    assert resumed["global_step"] == 14 and resumed["steps"] == 4
    assert "applied to the optimizer" not in printed  # nothing changed (FSDP2 loads betas back as a list)
    assert resumed["loss_scale"]["start"] == fsdp["loss_scale"]["end"]
    assert resumed["skipped_steps_total"] == 1  # the skip count goes on from the checkpoint
    single, _ = train(
        tmp_path,
        "precision=fp16",
        "trainer.accelerator=cpu",
        "trainer.enable_progress_bar=false",
        "plot=false",
        "trainer.max_steps=16",
        "ckpt_path=fsdp/checkpoints/last.ckpt",
        "hydra.run.dir=single",
    )
    assert single["strategy"]["processes"] == 1 and single["global_step"] == 16
    assert single["loss_scale"]["start"] == resumed["loss_scale"]["end"]
    assert single["final_metrics"]["val/acc"] > 0.85

    # The recovery checkpoint of step 0 resumes to the very same first step.
    train(tmp_path, "precision=fp16", "strategy=fsdp", *TWO_CPU, "trainer.max_steps=1", "hydra.run.dir=one")
    assert torch.load(tmp_path / "one/checkpoints/last-good.ckpt", weights_only=False)["global_step"] == 0
    first, _ = train(
        tmp_path,
        "precision=fp16",
        "strategy=fsdp",
        *TWO_CPU,
        "trainer.max_steps=1",
        "ckpt_path=one/checkpoints/last-good.ckpt",
        "hydra.run.dir=from_start",
    )
    assert first["global_step"] == 1
    a, b = (
        torch.load(tmp_path / run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
        for run in ("from_start", "one")
    )
    assert all(torch.equal(a[k], b[k]) for k in b)
