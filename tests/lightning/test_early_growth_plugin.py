"""Early growth through ``MixedPrecisionPlugin``: the master-weight optimizer's gradients are measured."""

from __future__ import annotations

import torch
from _models import TinyClassifier, as_lightning, quiet_trainer

from amp_plugin import DynamicLossScaler
from amp_plugin.lightning import MixedPrecisionPlugin
from amp_plugin.scaling.headroom import growths_below_margin


def test_a_scale_started_too_low_grows_early_in_lightning(pl):
    torch.manual_seed(0)
    scaler = DynamicLossScaler(init_scale=2.0**4, early_growth_interval=2)
    amaxes = []

    class Watch(pl.Callback):
        def on_after_backward(self, trainer, module):
            amaxes.append(max(float(p.grad.float().abs().max()) for p in module.parameters() if p.grad is not None))

    model = as_lightning(pl, TinyClassifier)(n=64)
    trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin("fp16", scaler=scaler)], max_steps=2, callbacks=[Watch()])
    trainer.fit(model)
    # The second step ends a run of two: grow as far as the larger amax of the two allows.
    assert scaler.last_grad_amax == amaxes[1]
    times = growths_below_margin(max(amaxes), 4.0, 2.0)
    assert times >= 1 and scaler.get_scale() == min(2.0**4 * 2.0**times, 2.0**24)
    assert [u.reason for u in scaler.iteration_updates] == ["growth"]
