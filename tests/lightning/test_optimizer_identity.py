"""What user code sees of the optimizers the plugin wraps, against Lightning's own precision or an
FP32 run: a parameter in two optimizers, the wrapped class (``isinstance``), its ``zero_grad``,
copies after a skipped step, and the repr."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
from _models import quiet_trainer

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, MixedPrecisionPlugin

GRAD = torch.tensor([1.0, 0.5, 0.25, 2.0])


def two_optimizers_module(pl):
    class TwoOptimizers(pl.LightningModule):
        """``shared`` in both ``SGD([shared, a])`` and ``SGD([shared, b])``, manual optimization."""

        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.shared = torch.nn.Parameter(torch.zeros(4))
            self.a = torch.nn.Parameter(torch.zeros(4))
            self.b = torch.nn.Parameter(torch.zeros(4))

        def training_step(self, batch, batch_idx):
            first, second = self.optimizers()
            loss = (self.shared.float() * GRAD).sum() + (self.a.float() + self.b.float()).sum()
            self.manual_backward(loss)
            first.step()
            second.step()
            first.zero_grad()
            second.zero_grad()

        def configure_optimizers(self):
            return torch.optim.SGD([self.shared, self.a], lr=0.125), torch.optim.SGD([self.shared, self.b], lr=0.125)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(2, 1), batch_size=1)

    return TwoOptimizers()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32", "bf16_lean", "bf16_sr"])
def test_a_parameter_in_two_optimizers_steps_with_unscaled_gradients_in_manual_optimization(pl, precision):
    """Each optimizer's step uses the unscaled gradient: one batch (``max_steps`` counts both
    optimizers' steps) moves ``shared`` by ``2 * 0.125 * g`` as in FP32 (one of them used to step
    with the scaled gradient: ``shared`` ended at -128x)."""
    module = two_optimizers_module(pl)
    scaler = DynamicLossScaler(init_scale=1024.0) if precision == "fp16" else "auto"
    trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin(precision, scaler=scaler)], max_steps=2)
    trainer.fit(module)
    assert torch.equal(module.shared.detach().float(), -0.25 * GRAD)


def test_a_parameter_in_two_wrappers_in_a_plain_loop_gets_both_unscaled_updates():
    shared, a, b = (torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)) for _ in range(3))
    first = MasterWeightOptimizer(torch.optim.SGD([shared, a], lr=0.125))
    second = MasterWeightOptimizer(torch.optim.SGD([shared, b], lr=0.125))
    scaler = DynamicLossScaler(init_scale=1024.0)
    for _ in range(2):
        scaler.scale((shared.float() * GRAD).sum() + (a.float() + b.float()).sum()).backward()
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        first.zero_grad()
        second.zero_grad()
    assert torch.equal(shared.detach().float(), -0.5 * GRAD)


class CountingSGD(torch.optim.SGD):
    """A user's subclass whose ``zero_grad`` override must run, as without the plugin."""

    zero_grads = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        CountingSGD.zero_grads += 1
        super().zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("precision", ["fp16", "bf16_lean", "32-true"])
def test_trainer_optimizers_are_the_users_class_and_its_zero_grad_runs(pl, precision):
    """``isinstance(trainer.optimizers[0], torch.optim.SGD)`` in a callback (what BaseFinetuning and
    scheduler factories check), and a subclass's ``zero_grad`` runs once per step, as with
    Lightning's own precision (the control, ``32-true``)."""
    from _models import TinyClassifier, as_lightning

    seen = []

    class Check(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append(isinstance(trainer.optimizers[0], (CountingSGD, torch.optim.SGD)))

    class Module(TinyClassifier):
        def configure_optimizers(self):
            return CountingSGD(self.parameters(), lr=0.1, momentum=0.9)

    CountingSGD.zero_grads = 0
    kwargs = {"precision": precision} if precision == "32-true" else {"plugins": [MixedPrecisionPlugin(precision)]}
    trainer = quiet_trainer(pl, max_steps=6, callbacks=[Check()], **kwargs)
    trainer.fit(as_lightning(pl, Module)())
    assert seen == [True] * 6
    opt = trainer.optimizers[0]
    assert isinstance(opt, CountingSGD)
    assert CountingSGD.zero_grads == 6
    if precision != "32-true":
        assert isinstance(opt, MasterWeightOptimizer)
        assert repr(opt).startswith("MasterWeightOptimizer(CountingSGD (")
        assert repr(opt).count("MasterWeightOptimizer") == 1


def test_wrappers_copy_and_pickle_after_a_skipped_last_step():
    """A skipped step's session (holding the fused kernels' op namespace) and the FP32 accumulation
    hooks are not part of a copy: ``copy.deepcopy`` and pickling work and keep the class."""
    for accumulate in (False, True):
        model = torch.nn.Linear(8, 2).half()
        opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulate_fp32=accumulate)
        scaler = DynamicLossScaler(init_scale=1024.0)
        for step in range(2):
            loss = model(torch.randn(4, 8).half()).float().sum() * (math.inf if step == 1 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert scaler.last_step_skipped
        for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
            assert isinstance(clone, MasterWeightOptimizer) and isinstance(clone, torch.optim.SGD)
            assert [torch.equal(a, b) for a, b in zip(clone.fp32_masters(), opt.fp32_masters())] == [True, True]
