"""Run by lightning/test_ranks_agree.py: Lightning DDP on two CPU processes (gloo) with
``MixedPrecisionPlugin(preset)`` for each lean preset (``bf16_sr``, ``bf16_lean``). The model
starts from a fixed seed (equal on both ranks); ``configure_optimizers`` then seeds each rank
differently (``seed_everything(BASE + global_rank)``) before the optimizer is built, and the
DistributedSampler gives each rank other rows.

Usage: python _ranks_agree_ddp_worker.py OUT_DIR (Lightning starts rank 1 with the same command).
Each rank writes ``OUT_DIR/rank<r>.pt``: one entry per preset.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _models import quiet_trainer, tiny_data

from amp_plugin import MixedPrecisionPlugin

BASE = 1234
PRESETS = ("bf16_sr", "bf16_lean")
STEPS = 20


class Seeded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
            torch.nn.ReLU(), torch.nn.Linear(64, 2),
        )  # fmt: skip
        self.seed = -1
        self.batches: list[torch.Tensor] = []
        self.init: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches.append(x)
        return F.cross_entropy(self.net(x.to(self.net[0].weight.dtype)).float(), y)

    def on_train_start(self) -> None:
        self.init = [p.detach().clone() for p in self.parameters()]

    def configure_optimizers(self):
        pl.seed_everything(BASE + self.global_rank, verbose=False)  # as `seed + rank` scripts do
        self.seed = torch.initial_seed()
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(tiny_data(64), batch_size=8)


def main(out_dir: str) -> None:
    results: dict[str, Any] = {}
    rank = 0
    for preset in PRESETS:
        torch.manual_seed(0)
        model = Seeded()
        trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin(preset)], max_steps=STEPS, strategy="ddp", devices=2)
        trainer.fit(model)
        rank = trainer.global_rank
        opt = trainer.optimizers[0]
        results[preset] = {
            "seed": model.seed,
            "optimizer": type(opt).__name__,
            "init": model.init,
            "params": [p.detach().clone() for p in model.parameters()],
            "state": opt.state_dict(),
            "first_batch": model.batches[0],
            "global_step": trainer.global_step,
        }
    torch.save(results, f"{out_dir}/rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
