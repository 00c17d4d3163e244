"""Injected faults are skipped, counted and leave weights, optimizer state and LR untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from _models import TinyClassifier, as_lightning, quiet_trainer

from amp_plugin import DynamicLossScaler, MixedPrecisionPlugin
from amp_plugin.callbacks import FaultInjector
from amp_plugin.lightning.namespace import Callback


class FullSnapshots(Callback):
    """Weights, optimizer state and LR before and after every batch."""

    def __init__(self):
        self.before, self.after = {}, {}

    def _take(self, trainer, pl_module):
        opt = trainer.optimizers[0]
        return {
            "params": [p.detach().clone() for p in pl_module.parameters()],
            "masters": [m.detach().clone() for m in opt.master_params()],
            "state": copy.deepcopy(opt.optimizer.state_dict()["state"]),
            "lr": opt.param_groups[0]["lr"],
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = self._take(trainer, pl_module)


def identical(a, b):
    if a["lr"] != b["lr"]:
        return False
    if not all(torch.equal(x, y) for k in ("params", "masters") for x, y in zip(a[k], b[k])):
        return False
    return all(
        torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k]))
        for sa, sb in zip(a["state"].values(), b["state"].values())
        for k in sa
    )


def run(pl, faults, steps=30):
    pl.seed_everything(0)
    model = as_lightning(pl, TinyClassifier)(scheduler_gamma=0.99, lr=2e-2)
    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**12, growth_interval=4))
    snaps = FullSnapshots()
    injector = FaultInjector(**faults)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=steps, callbacks=[injector, snaps])
    trainer.fit(model)
    return model, plugin, snaps, injector, trainer


@pytest.mark.slow
@pytest.mark.parametrize(
    "faults, kind",
    [
        (dict(inject_inf_at=[3, 9]), "inf_grad:net.0.weight"),
        (dict(inject_nan_at=[3, 9]), "nan_grad:net.0.weight"),
        (dict(nan_loss_at=[3, 9]), "nan_loss"),
        (dict(nan_input_at=[3, 9]), "nan_input"),
    ],
)
def test_fault_is_skipped_counted_and_changes_nothing(pl, faults, kind):
    _model, plugin, snaps, injector, _ = run(pl, faults)
    assert injector.injected == [(3, kind), (9, kind)]
    assert plugin.scaler.skipped_steps == 2
    for step in (3, 9):
        assert identical(snaps.before[step], snaps.after[step]), step
    assert not identical(snaps.before[4], snaps.after[4])
    # The scale follows the policy (interval 4): 3 clean, overflow at 3 (halve), growth at 7,
    # overflow at 9 (halve), then 20 clean steps grow it 5 times.
    assert plugin.scaler.get_scale() == 2.0**12 / 2 * 2 / 2 * 2**5


@pytest.mark.slow
def test_training_recovers_close_to_an_unfaulted_run(pl):
    clean, *_ = run(pl, {})
    faulted, *_ = run(pl, dict(inject_inf_at=[3, 9], nan_loss_at=[15], nan_input_at=[20]))
    x, y = as_lightning(pl, TinyClassifier)().train_dataloader().dataset.tensors
    accuracy = {}
    for name, model in (("clean", clean), ("faulted", faulted)):
        with torch.no_grad():
            logits = model(x.half()).float()
        accuracy[name] = (logits.argmax(1) == y).float().mean().item()
    assert accuracy["faulted"] > 0.85 and abs(accuracy["faulted"] - accuracy["clean"]) < 0.1


def test_rank_and_param_selection(pl):
    injector = FaultInjector(inject_inf_at=[1], param="net.3.bias")
    pl.seed_everything(0)
    model = as_lightning(pl, TinyClassifier)()
    plugin = MixedPrecisionPlugin("fp16")
    quiet_trainer(pl, plugins=[plugin], max_steps=3, callbacks=[injector]).fit(model)
    assert injector.injected == [(1, "inf_grad:net.3.bias")]
    assert plugin.last_nonfinite_params == []  # the last step was clean


@pytest.mark.parametrize("bad", [dict(inject_inf_at=[-1]), dict(nan_loss_at=["3"]), dict(inject_nan_at=[True])])
def test_bad_steps_are_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        FaultInjector(**bad)


def test_unknown_param_is_a_clear_error(pl):
    model = as_lightning(pl, TinyClassifier)()
    plugin = MixedPrecisionPlugin("fp16")
    trainer = quiet_trainer(
        pl, plugins=[plugin], max_steps=3, callbacks=[FaultInjector(inject_inf_at=[0], param="nope")]
    )
    with pytest.raises(ValueError, match="param='nope'.*net.0.weight"):
        trainer.fit(model)
