"""Run by test_retries_ddp.py: two CPU processes (gloo), rank 1 alone overflows at step 2 while
the scale is above 512, so a retry at 512 succeeds.

Usage: python _ddp_retry_worker.py OUT_DIR NAMESPACE (lightning.pytorch or pytorch_lightning)
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
        scale = self.trainer.precision_plugin.scaler.get_scale()
        if self.global_rank == 1 and self.global_step == 2 and scale > 512.0:
            self.net[0].weight.grad[0, 0] = math.inf


def main(out_dir: str, namespace: str) -> None:
    pl = importlib.import_module(namespace)
    torch.manual_seed(0)
    model = as_lightning(pl, RankOneOverflow)(n=64)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=100, retries=1)
    plugin = MixedPrecisionPlugin("fp16", scaler=scaler)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=6, strategy="ddp", devices=2)
    trainer.fit(model)
    torch.save(
        {
            "skipped": scaler.skipped_steps,
            "retried": scaler.retried_steps,
            "scale": scaler.get_scale(),
            "params": [p.detach().clone() for p in model.parameters()],
            "global_step": trainer.global_step,
        },
        f"{out_dir}/rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
