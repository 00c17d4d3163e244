"""Run by test_fp8_ddp.py, one process per rank: python _fp8_ddp_worker.py RANK INIT_FILE OUT_DIR."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from amp_plugin.fp8 import Fp8Recipe, convert_to_fp8


def main(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
        fp8 = convert_to_fp8(model, Fp8Recipe(amax_history_len=2, fallback_steps=0))
        if fp8.reduce is None:
            raise RuntimeError("no amax reduction under an initialised 2-process group")
        torch.manual_seed(1 + rank)
        x = torch.randn(8, 16) * (1 + 9 * rank)  # rank 1's activations are 10x larger
        model(x).sum().backward()
        local = model[1].fp8_amax_history[0].clone()
        fp8.update()
        torch.save({"local": local, "scale": model[1].fp8_scale.clone()}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
