"""Run by test_ddp.py: two CPU processes (gloo), an overflow injected on rank 1 only.

Usage: python _ddp_worker.py OUT_DIR PRECISION NAMESPACE (lightning.pytorch or pytorch_lightning)
"""

from __future__ import annotations

import importlib
import math
import sys

import torch
from _models import TinyClassifier, as_lightning, quiet_trainer

from amp_plugin import DynamicLossScaler, MixedPrecisionPlugin


class RankOneOverflow(TinyClassifier):
    def on_after_backward(self) -> None:
        # After DDP's all-reduce: only this rank sees the inf.
        if self.global_rank == 1 and self.global_step in (2, 5):
            self.net[0].weight.grad[0, 0] = math.inf


def main(out_dir: str, precision: str, namespace: str) -> None:
    pl = importlib.import_module(namespace)
    torch.manual_seed(0)
    model = as_lightning(pl, RankOneOverflow)(n=64)
    plugin = MixedPrecisionPlugin(precision, scaler=DynamicLossScaler(init_scale=2.0**10, growth_interval=3))
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=8, strategy="ddp", devices=2)
    trainer.fit(model)
    torch.save(
        {
            "skipped": plugin.scaler.skipped_steps,
            "scale": plugin.scaler.get_scale(),
            "params": [p.detach().clone() for p in model.parameters()],
            "global_step": trainer.global_step,
        },
        f"{out_dir}/rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
