"""A channels_last weight in a real Lightning run with the lean presets: it trains as the same module laid
out contiguous, bit for bit, and keeps its layout (the plugin's step pairs each weight element with its own
moments and gradient whatever the memory format)."""

from __future__ import annotations

import pytest
import torch
from _models import quiet_trainer

from amp_plugin import MixedPrecisionPlugin

SHAPE = (6, 4, 3, 3)


class _Body:
    """One 4-D weight and an elementwise loss (its gradient is the same in any layout, unlike a
    convolution's, whose kernels sum in another order per memory format)."""

    def __init__(self, channels_last: bool) -> None:
        super().__init__()
        weight = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
        if channels_last:
            weight = weight.to(memory_format=torch.channels_last)
        self.weight = torch.nn.Parameter(weight)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.weight.float() * x).square().mean() + self.weight.float().sum() * 1e-3

    def train_dataloader(self):
        x = torch.randn(16, *SHAPE, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _fit(pl, preset: str, channels_last: bool) -> tuple[torch.Tensor, bool]:
    torch.manual_seed(0)  # the stochastic rounding's seed is drawn from torch's generator
    module = type("Weight", (_Body, pl.LightningModule), {})(channels_last)
    quiet_trainer(pl, plugins=[MixedPrecisionPlugin(preset)], max_steps=6).fit(module)
    weight = module.weight.detach()
    return weight.contiguous().view(torch.int16), weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("preset", ["bf16_sr", "bf16_lean", "bf16_split", "bf16"])
def test_a_channels_last_weight_trains_as_a_contiguous_one(pl, preset):
    expected, _ = _fit(pl, preset, channels_last=False)
    got, channels_last = _fit(pl, preset, channels_last=True)
    assert channels_last
    assert torch.equal(got, expected)
