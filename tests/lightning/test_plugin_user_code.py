"""MixedPrecisionPlugin with the code users write around the step, in a real Lightning Trainer: manual
clipping, an optimizer stepped twice, weights written after ``configure_optimizers``, hooks that read or edit
gradients, several schedules under manual optimization, schedules of frequency n."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import TinyClassifier, TwoSchedules, as_lightning, quiet_trainer

from amp_plugin import (
    DynamicLossScaler,
    MasterWeightOptimizer,
    MixedPrecisionPlugin,
)
from amp_plugin.lightning.namespace import Callback
from tests.lightning.test_plugin import fit


class ManualClip(TinyClassifier):
    """Manual optimization as Lightning's docs show it: backward, clip_gradients, step;
    ``steps_per_batch`` steps of the same optimizer in one training_step."""

    def __init__(self, algorithm="norm", clip=0.05, steps_per_batch=1, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.algorithm, self.clip, self.steps_per_batch = algorithm, clip, steps_per_batch
        self.stepped_grads = []

    def on_fit_start(self):
        inner = self.trainer.optimizers[0]
        inner = getattr(inner, "optimizer", inner)  # the optimizer inside MasterWeightOptimizer
        inner.register_step_pre_hook(
            lambda opt, args, kwargs: self.stepped_grads.append(
                [p.grad.clone() for g in opt.param_groups for p in g["params"]]
            )
        )

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        for _ in range(self.steps_per_batch):
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self(x).float(), y))
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm=self.algorithm)
            opt.step()


@pytest.mark.parametrize("preset", ["fp16", "fp16_autocast", "bf16"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_clip_gradients_clips_what_the_step_uses(pl, preset, algorithm):
    model = as_lightning(pl, ManualClip)(algorithm=algorithm, clip=0.05, optimizer="sgd")
    plugin = MixedPrecisionPlugin(preset)
    fit(pl, model, plugin, max_steps=3)
    assert len(model.stepped_grads) == 3
    for grads in model.stepped_grads:
        assert all(g.dtype == torch.float32 for g in grads)  # FP32 masters or FP32 parameters
        if algorithm == "norm":  # clipped after unscaling: the norm is the clip value, not clip / scale
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            assert total.item() == pytest.approx(0.05, rel=1e-4)
        else:
            assert max(g.abs().max().item() for g in grads) == pytest.approx(0.05, rel=1e-6)


def test_the_same_optimizer_stepped_twice_in_one_training_step(pl):
    model = as_lightning(pl, ManualClip)(clip=0.0, steps_per_batch=2, optimizer="sgd", overflow_at=())
    model.clip = 0.0
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2)
    fit(pl, model, MixedPrecisionPlugin("fp16", scaler=scaler), max_steps=6)  # 3 batches, 2 steps each
    assert len(model.stepped_grads) == 6 and scaler.skipped_steps == 0
    assert scaler.update_count == 6  # each step is an iteration of its own
    assert scaler.get_scale() == 2.0**13  # grown every second step
    assert not torch.equal(model.stepped_grads[0][0], model.stepped_grads[1][0])  # the second step saw new grads


class WeightsSetAtFitStart(TinyClassifier):
    """Writes the model's weights after the optimizer (and its FP32 masters) exist."""

    def on_fit_start(self):
        with torch.no_grad():
            self.net[0].weight.fill_(0.125)
            self.net[3].load_state_dict(
                {"weight": torch.full_like(self.net[3].weight, -0.25), "bias": torch.zeros_like(self.net[3].bias)}
            )


class SwapInWeights(Callback):
    """An EMA/SWA-style callback: puts other weights into the model before step 2."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.copy_(torch.full_like(p, 0.5))
            self.swapped = [p.detach().clone() for p in pl_module.parameters()]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
def test_weights_written_after_configure_optimizers_are_where_training_continues(pl, optimizer):
    model = as_lightning(pl, WeightsSetAtFitStart)(optimizer=optimizer, lr=0.0)  # lr 0: steps change nothing
    swap = SwapInWeights()
    trainer = fit(pl, model, MixedPrecisionPlugin("fp16"), max_steps=4, callbacks=[swap])
    for p, swapped in zip(model.parameters(), swap.swapped):
        assert torch.equal(p, swapped)  # not undone by a stale FP32 master
    masters = trainer.optimizers[0].master_params()
    assert all(torch.equal(m, p.float()) for m, p in zip(masters, model.parameters()))


def test_weights_set_in_on_fit_start_are_the_starting_point(pl):
    model = as_lightning(pl, WeightsSetAtFitStart)(optimizer="sgd", lr=0.0)
    fit(pl, model, MixedPrecisionPlugin("bf16"), max_steps=2)
    assert torch.all(model.net[0].weight == 0.125) and torch.all(model.net[3].weight == -0.25)


class ReadsGradsInHook(TinyClassifier):
    """Reads the module's gradients where Lightning's docs do it, and edits one layer's."""

    def __init__(self, zero_first_layer=False, **kwargs):
        super().__init__(**kwargs)
        self.zero_first_layer = zero_first_layer
        self.seen = []

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        masters = optimizer.master_params() if hasattr(optimizer, "master_params") else list(self.parameters())
        self.seen.append(
            {
                "model": [p.grad.clone() for p in self.parameters()],
                "master": [m.grad.clone() for m in masters],
                "norm": grad_norm(self, norm_type=2)["grad_2.0_norm_total"],
            }
        )
        if self.zero_first_layer:
            self.net[0].weight.grad.zero_()


@pytest.mark.parametrize("preset", ["fp16", "bf16", "bf16_lean", "bf16_sr"])
def test_hooks_read_the_unscaled_gradient_from_the_module(pl, preset):
    model = as_lightning(pl, ReadsGradsInHook)(optimizer="sgd")
    plugin = MixedPrecisionPlugin(preset, scaler=DynamicLossScaler(init_scale=2.0**12))  # a scale for bf16 too
    fit(pl, model, plugin, max_steps=3)
    for seen in model.seen:
        for p_grad, m_grad in zip(seen["model"], seen["master"]):
            assert torch.equal(p_grad, m_grad.to(p_grad.dtype))  # unscaled, rounded to the model's dtype
        masters_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in seen["master"]]))
        assert float(seen["norm"]) == pytest.approx(float(masters_norm), rel=1e-2)  # not 2**12 times larger


def test_an_edit_to_the_modules_gradient_in_a_hook_reaches_the_step(pl):
    model = as_lightning(pl, ReadsGradsInHook)(zero_first_layer=True, optimizer="sgd")
    before = model.net[0].weight.detach().clone()
    fit(pl, model, MixedPrecisionPlugin("fp16"), max_steps=3)
    assert torch.equal(model.net[0].weight.detach(), before.half())  # its gradient was zeroed every step
    assert not torch.equal(model.net[3].weight.detach().float(), model.seen[0]["master"][0])  # the rest trained


def test_without_hooks_that_read_gradients_nothing_is_written_back(pl):
    from amp_plugin.callbacks import GradientHealthMonitor, LossScaleMonitor

    plugin = MixedPrecisionPlugin("fp16")
    monitors = [LossScaleMonitor(notice_interval_s=None), GradientHealthMonitor(every_n_steps=1, verbose=False)]
    fit(pl, as_lightning(pl, TinyClassifier)(), plugin, max_steps=2, callbacks=monitors)
    assert plugin._hooks_read_model_grads is False
    plugin = MixedPrecisionPlugin("fp16")
    fit(pl, as_lightning(pl, ReadsGradsInHook)(), plugin, max_steps=1)
    assert plugin._hooks_read_model_grads is True


def test_the_bf16_split_preset_keeps_masters_as_weight_plus_extension(pl):
    model = as_lightning(pl, TinyClassifier)()
    plugin = MixedPrecisionPlugin("bf16_split")
    trainer = fit(pl, model, plugin, max_steps=4)
    opt = trainer.optimizers[0]
    assert isinstance(opt, MasterWeightOptimizer) and opt.master == "bf16_split"
    assert plugin.settings.preset == "bf16_split" and "16-bit remainder" in plugin.describe()
    halves = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    for weight, master in zip(halves, opt.fp32_masters()):  # the model's weight: the FP32 master rounded
        ties = (master.view(torch.int32) & 0x1FFFF) == 0x8000  # (halfway with an even lower neighbour: up)
        assert torch.equal(weight[~ties], master[~ties].to(torch.bfloat16))
    with pytest.raises(ValueError, match="master_weights=False contradicts precision='bf16_split'.*bf16_pure"):
        MixedPrecisionPlugin("bf16_split", master_weights=False)


@pytest.mark.parametrize("preset", ["fp16", "fp16_autocast", "fp16_pure"])
def test_manual_optimization_holds_only_the_schedule_of_the_optimizer_that_skipped(pl, preset):
    model = as_lightning(pl, TwoSchedules)(overflow_at=(1,))
    plugin = MixedPrecisionPlugin(preset, scaler=DynamicLossScaler(init_scale=2.0**8))
    trainer = fit(pl, model, plugin, max_epochs=1)
    assert model.iteration == 4 and plugin.scaler.skipped_steps == 1
    sch_a, sch_b = (config.scheduler for config in trainer.lr_scheduler_configs)
    assert (sch_a.last_epoch, sch_b.last_epoch) == (3, 4)  # A skipped once in 4 iterations; B never did
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3, rel=1e-12)
    assert trainer.optimizers[1].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4, rel=1e-12)
    assert type(sch_a) is torch.optim.lr_scheduler.StepLR  # given back after the fit


class EveryOtherStep(TinyClassifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2}}


@pytest.mark.slow
@pytest.mark.parametrize(
    "overflow_at, accumulate, steps",
    [
        ((), 1, 8),  # Lightning's own count: batches 2, 4, 6, 8
        ((1,), 1, 8),  # a skip on a boundary: the schedule steps at the 2nd, 4th and 6th step taken
        ((0,), 1, 8),  # off a boundary: the same, one batch later
        ((0, 3), 1, 9),  # 7 steps taken of 9: 3 schedule steps
        ((1, 3), 1, 8),  # two skips on boundaries: 6 steps taken, 3 schedule steps (Lightning's count: 4 less 2)
        ((), 2, 4),  # accumulation: Lightning counts batches, so frequency 2 over 2 batches is every step
        ((1,), 2, 4),  # 3 steps taken, 3 schedule steps
    ],
)
def test_a_frequency_n_schedule_steps_once_every_n_steps_taken(pl, overflow_at, accumulate, steps):
    model = as_lightning(pl, EveryOtherStep)(overflow_at=overflow_at, lr=0.1, n=64 * 4)
    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**8))
    trainer = fit(pl, model, plugin, max_steps=steps, accumulate_grad_batches=accumulate)
    taken = steps - len(overflow_at)
    assert plugin.scaler.skipped_steps == len(overflow_at)
    expected = taken * accumulate // 2
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == expected
    assert trainer.lr_scheduler_configs[0].frequency == 2  # Lightning's config is given back
    # the control: Lightning's own precision over the steps taken, without skips
    control = quiet_trainer(pl, precision="32-true", max_steps=taken, accumulate_grad_batches=accumulate)
    control.fit(as_lightning(pl, EveryOtherStep)(lr=0.1, n=64 * 4))
    assert control.lr_scheduler_configs[0].scheduler.last_epoch == expected
