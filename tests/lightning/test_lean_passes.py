"""The lean step's fused passes in a real Lightning run: what the plugin runs on CUDA (``fused="triton"``, two
Triton kernels per group around torch's fused Adam), here as ``fused="compiled"``, the same step with the passes
compiled by ``torch.compile``. With a dynamic loss scaler whose ``unscale_`` only checks the BF16 gradients, a
gradient that overflows, clipping (which reads the master gradients), accumulation over two micro-batches and a
hook that reads the gradients, it trains bit for bit as torch's multi-tensor ops (``fused="torch"``), which copy
every gradient into FP32 at ``unscale_``."""

from __future__ import annotations

import math

import pytest
import torch
from _models import quiet_trainer

from amp_plugin import MasterWeightOptimizer, MixedPrecisionPlugin
from amp_plugin.lightning import optimizers as plugin_optimizers


class _Body:
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 4))
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        if self.global_step == 3 and batch_idx % 2 == 0:
            loss = loss * float("inf")  # this step overflows: skipped, the scale backs off
        return loss

    def on_before_optimizer_step(self, optimizer):  # a hook that reads the (unscaled) gradients
        self.norms.append(float(sum(p.grad.float().norm() ** 2 for p in self.parameters() if p.grad is not None)))

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(64, 12, generator=g), torch.randn(64, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _fit(pl, monkeypatch, preset: str, fused: str):
    class Wrapper(MasterWeightOptimizer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, fused=fused, **kwargs)

    monkeypatch.setattr(plugin_optimizers, "MasterWeightOptimizer", Wrapper)
    torch.manual_seed(0)  # the stochastic rounding's seed is drawn from torch's generator
    module = type("Net", (_Body, pl.LightningModule), {})()
    plugin = MixedPrecisionPlugin(preset, scaler={"type": "dynamic", "init_scale": 2.0**12, "growth_interval": 100})
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=8, gradient_clip_val=0.5, accumulate_grad_batches=2)
    trainer.fit(module)
    (optimizer,) = trainer.optimizers
    assert [k.name for k in optimizer._chosen] == [fused]
    state = [t for s in optimizer.state_dict()["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"])]
    assert plugin.scaler.skipped_steps == 1
    return [p.detach() for p in module.parameters()] + state, module.norms, plugin.scaler.get_scale()


@pytest.mark.parametrize("preset", ["bf16_lean", "bf16_sr"])
def test_the_passes_train_as_the_torch_ops_under_lightning(pl, monkeypatch, preset):
    expected, norms, scale = _fit(pl, monkeypatch, preset, "torch")
    got, got_norms, got_scale = _fit(pl, monkeypatch, preset, "compiled")
    assert got_scale == scale == 2.0**11  # the overflow backed the scale off
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms), rtol=0, atol=0, equal_nan=True)
    assert sum(not math.isfinite(n) for n in norms) == 1  # the hook saw the overflowing step's gradients
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
