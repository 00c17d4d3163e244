"""Lightning: a retried batch puts the LightningModule's buffers back (BatchNorm's running
statistics and counter, a buffer a forward updates), in automatic and manual optimization.

The oracle is a run started at the lower scale: a run whose first batch overflows at 2**16 and
is retried at 2**15 must end bit for bit equal to it: weights, every buffer, the optimizer's
state, the LR schedule, ``global_step``, the data order and the scale.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _ddp_launch import assert_bitwise_equal
from _models import as_lightning, quiet_trainer
from torch import nn

from amp_plugin import DynamicLossScaler
from amp_plugin.lightning import MixedPrecisionPlugin


class ForwardCounter(nn.Module):
    """Buffers a training forward updates: an int64 counter in place and a float count by
    replacing the tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(1)
            self.count = self.count + 1
        return x


class BatchNormClassifier:
    """Linear -> BatchNorm -> counter -> ReLU -> Dropout -> Linear on shuffled data, a step LR
    schedule; the gradient overflows at global step 0 while the scale is above 2**15."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), ForwardCounter(), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)
        )
        self.automatic_optimization = not manual
        self.batches: dict[int, float] = {}  # global step -> the batch it trained on (a checksum)

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y = batch
        self.batches[self.global_step] = float(x.float().sum())
        return F.cross_entropy(self(x).float(), y)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self.loss(batch)
        opt, sched = self.optimizers(), self.lr_schedulers()
        plugin = self.trainer.precision_plugin
        for _ in plugin.attempts():
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            opt.step()
        if not plugin.scaler.last_step_skipped:
            sched.step()
        return None

    def on_after_backward(self):
        if self.global_step == 0 and self.trainer.precision_plugin.scaler.get_scale() > 2.0**15:
            self.net[0].weight.grad.view(-1)[0] = math.inf

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


def run(pl, init_scale, retries, manual):
    torch.manual_seed(0)
    model = as_lightning(pl, BatchNormClassifier)(manual=manual)
    scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=1000, retries=retries)
    trainer = quiet_trainer(pl, max_epochs=2, plugins=[MixedPrecisionPlugin("fp16", scaler=scaler)])
    trainer.fit(model)
    return model, trainer, scaler


@pytest.mark.slow
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_retried_batch_leaves_the_buffers_as_a_run_started_at_the_lower_scale(pl, manual):
    m1, t1, s1 = run(pl, 2.0**16, 1, manual)
    m2, t2, s2 = run(pl, 2.0**15, 0, manual)
    assert (s1.retried_steps, s1.skipped_steps, s2.retried_steps, s2.skipped_steps) == (1, 0, 0, 0)
    bn, counter = m1.net[1], m1.net[2]
    assert int(bn.num_batches_tracked) == int(counter.seen) == float(counter.count) == 8  # not 9
    assert_bitwise_equal(m1.state_dict(), m2.state_dict(), "module")
    assert_bitwise_equal(t1.optimizers[0].state_dict(), t2.optimizers[0].state_dict(), "optimizer")
    assert t1.global_step == t2.global_step == 8
    assert t1.lr_scheduler_configs[0].scheduler.state_dict() == t2.lr_scheduler_configs[0].scheduler.state_dict()
    assert m1.batches == m2.batches and s1.get_scale() == s2.get_scale()


@pytest.mark.slow
def test_fp8_scales_update_once_for_a_retried_batch(pl):
    """The failed attempt's amaxes go back with the buffers and ``Fp8Layers.update()`` runs once
    per iteration: the retried run's FP8 state equals the lower-scale run's."""
    fp8 = {"keep_first_last": False, "min_features": 1, "multiple_of": 1, "amax_history_len": 4}
    runs = []
    for init_scale, retries in ((2.0**16, 1), (2.0**15, 0)):
        torch.manual_seed(0)
        model = as_lightning(pl, BatchNormClassifier)()
        scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=1000, retries=retries)
        plugin = MixedPrecisionPlugin("fp8", fp8=fp8, scaler=scaler)
        trainer = quiet_trainer(pl, max_steps=4, plugins=[plugin])
        trainer.fit(model)
        runs.append((model, plugin, scaler))
    (m1, p1, s1), (m2, p2, s2) = runs
    assert s2.retried_steps == 0
    assert (s1.retried_steps, s1.skipped_steps, p1.fp8_layers.steps, p2.fp8_layers.steps) == (1, 0, 4, 4)
    assert_bitwise_equal(m1.state_dict(), m2.state_dict(), "module")
    assert_bitwise_equal(p1.fp8_layers.state_dict(), p2.fp8_layers.state_dict(), "fp8")
    assert_bitwise_equal(dict(m1.named_buffers()), dict(m2.named_buffers()), "buffers")  # FP8's are not saved
