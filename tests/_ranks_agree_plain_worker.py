"""Run by master_weights/test_ranks_agree_plain.py: a plain DDP-style loop (no Lightning) on two
gloo ranks, each seeded differently (``torch.manual_seed(BASE + rank)``) before its optimizer is
built, with the same initial BF16 weights and different data; the BF16 gradients are all-reduced
and averaged by hand before each ``MasterWeightOptimizer`` step.

Per kind (``KINDS``) two runs: ``shared``, the optimizer built after the process group exists
(its rounding seed is rank 0's, :func:`~amp_plugin.master_weights.shared_seed`), and
``control``, the optimizer built before ``init_process_group`` (no broadcast: each rank keeps the
seed its own generator drew), then trained the same way.

Usage: python _ranks_agree_plain_worker.py OUT_DIR [RANK]. Without RANK this process is rank 0
and starts rank 1 as a second process of this script. Each rank writes ``OUT_DIR/rank<r>.pt``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from amp_plugin import MasterWeightOptimizer

BASE = 1234  # rank r seeds its generator with BASE + r
STEPS = 20
BATCH = 8
KINDS: dict[str, dict[str, Any]] = {
    "stochastic": {"master": "stochastic", "moments_dtype": torch.bfloat16},
    "bf16_split": {"master": "bf16_split", "moments_dtype": torch.bfloat16},
}


def build(kind: str, rank: int) -> tuple[nn.Module, MasterWeightOptimizer, int]:
    """The model from a fixed seed (equal on every rank, as DDP makes it), then this rank's own
    seed, then the optimizer (which draws its rounding seed from the generator)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    ).bfloat16()
    torch.manual_seed(BASE + rank)
    seed = torch.initial_seed()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01), **KINDS[kind])
    return model, opt, seed


def train(model: nn.Module, opt: MasterWeightOptimizer) -> dict[str, Any]:
    world = dist.get_world_size()
    init = [p.detach().clone() for p in model.parameters()]
    batches = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 16)  # this rank's data, from its own generator
        y = (x[:, 0] > x[:, 1]).long() + 2 * (x[:, 2] > 0).long()
        batches.append(x)
        opt.zero_grad()
        F.cross_entropy(model(x.bfloat16()).float(), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
    return {
        "init": init,
        "params": [p.detach().clone() for p in model.parameters()],
        "state": opt.state_dict(),
        "first_batch": batches[0],
    }


def run_rank(out_dir: str, rank: int) -> None:
    # control: built before the process group exists, so each rank keeps its own rounding seed
    controls = {kind: build(kind, rank) for kind in KINDS}
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg_init", rank=rank, world_size=2)
    try:
        results: dict[str, Any] = {}
        for kind in KINDS:
            model, opt, seed = controls[kind]
            results[f"control_{kind}"] = {**train(model, opt), "seed": seed}
            model, opt, seed = build(kind, rank)
            results[f"shared_{kind}"] = {**train(model, opt), "seed": seed}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def main(out_dir: str, rank: int | None) -> None:
    if rank is not None:
        run_rank(out_dir, rank)
        return
    other = subprocess.Popen([sys.executable, __file__, out_dir, "1"])
    try:
        run_rank(out_dir, 0)
        code = other.wait(timeout=200)
    finally:
        if other.poll() is None:
            other.kill()  # rank 0 failed: rank 1 would wait at a collective
    if code != 0:
        raise SystemExit(f"rank 1 exited with {code}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
