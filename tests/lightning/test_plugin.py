"""MixedPrecisionPlugin in a real Lightning Trainer: modes, skips, LR hold, clipping, accumulation (the code
users write around the step: ``test_plugin_user_code.py``)."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from _emulation_helpers import simulated_cpu
from _models import PicklableClassifier, TinyClassifier, as_lightning, quiet_trainer, tiny_data

from amp_plugin import (
    DynamicLossScaler,
    LossScaleCollapseError,
    MasterWeightOptimizer,
    MixedPrecisionPlugin,
    StaticLossScaler,
)
from amp_plugin.lightning.namespace import Callback
from amp_plugin.lightning.optimizers import unwrap
from amp_plugin.settings import PRESETS


def fit(pl, model, plugin, **trainer_kwargs):
    trainer = quiet_trainer(pl, plugins=[plugin], **trainer_kwargs)
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize(
    "kwargs, linear, norm, inputs, wrapped",
    [
        (dict(precision="fp16"), torch.float16, torch.float32, torch.float16, True),
        (dict(precision="bf16"), torch.bfloat16, torch.float32, torch.bfloat16, True),
        (
            dict(precision="fp16", master_weights=False, autocast=True),
            torch.float32,
            torch.float32,
            torch.float32,
            False,
        ),
        (
            dict(precision="bf16", master_weights=False, autocast=True),
            torch.float32,
            torch.float32,
            torch.float32,
            False,
        ),
        (dict(precision="fp16", master_weights=False), torch.float16, torch.float16, torch.float16, False),
        (dict(precision="bf16", master_weights=False), torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
        (dict(precision="fp32"), torch.float32, torch.float32, torch.float32, False),
    ],
)
def test_param_and_input_dtypes_per_mode(pl, kwargs, linear, norm, inputs, wrapped):
    model = as_lightning(pl, TinyClassifier)()
    trainer = fit(pl, model, MixedPrecisionPlugin(**kwargs), max_steps=2)
    assert model.net[0].weight.dtype == linear
    assert model.net[1].weight.dtype == norm
    assert set(model.seen_dtypes) == {inputs}
    opt = trainer.optimizers[0]
    assert isinstance(opt, MasterWeightOptimizer) == wrapped
    # The optimizer updates FP32 everywhere except in pure half precision.
    pure = not kwargs.get("autocast", False) and kwargs.get("master_weights") is False
    assert {p.dtype for g in opt.param_groups for p in g["params"]} == ({linear} if pure else {torch.float32})


def test_default_scaler_per_precision():
    assert isinstance(MixedPrecisionPlugin("fp16").scaler, DynamicLossScaler)
    assert MixedPrecisionPlugin("fp16").scaler.is_enabled()
    for plugin in (
        MixedPrecisionPlugin("bf16"),
        MixedPrecisionPlugin("fp32"),
        MixedPrecisionPlugin("fp16", scaler=None),
    ):
        # No loss scaling is a disabled scaler: same interface, scale 1, nothing skipped.
        assert not plugin.scaler.is_enabled()
        assert plugin.scaler.get_scale() == 1.0 and plugin.scaler.skipped_steps == 0
    explicit = StaticLossScaler(8.0)
    assert MixedPrecisionPlugin("bf16", scaler=explicit).scaler is explicit


def test_autocast_on_cpu_really_is_fp16(pl):
    seen = []
    model = as_lightning(pl, TinyClassifier)()
    model.net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    fit(pl, model, MixedPrecisionPlugin("fp16", master_weights=False, autocast=True), max_steps=1)
    assert seen == [torch.float16]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(precision="fp17"),
            "precision='fp17' is not allowed: precision must be one of " + ", ".join(map(repr, PRESETS)),
        ),
        (dict(emulate="maybe"), "emulate='maybe'"),
        (dict(master_weights=True, autocast=True), "cannot be combined"),
        (dict(precision="fp32", scaler=StaticLossScaler(2.0)), "precision='fp32'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as info:
        MixedPrecisionPlugin(**kwargs)
    assert message in str(info.value)


def test_wrong_types():
    with pytest.raises(TypeError, match="scaler="):
        MixedPrecisionPlugin(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="master_weights="):
        MixedPrecisionPlugin(master_weights="yes")


class Snapshots(Callback):
    """Records the model's weights before and after every batch."""

    def __init__(self):
        self.before, self.after = {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before[trainer.global_step] = [p.detach().clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step - 1] = [p.detach().clone() for p in pl_module.parameters()]


@pytest.mark.parametrize("kwargs", [dict(), dict(master_weights=False, autocast=True), dict(master_weights=False)])
def test_injected_overflows_are_skipped_and_change_nothing(pl, kwargs):
    # SGD: Adam with eps=1e-8 is itself broken in pure FP16 (eps rounds to 0, v underflows).
    model = as_lightning(pl, TinyClassifier)(overflow_at=(2, 5, 6), optimizer="sgd")
    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**10), **kwargs)
    snaps = Snapshots()
    trainer = fit(pl, model, plugin, max_steps=8, callbacks=[snaps])
    assert plugin.scaler.skipped_steps == 3
    assert plugin.scaler.get_scale() == 2.0**7
    assert trainer.global_step == 8  # global_step counts attempted optimizer steps
    for step in range(8):
        same = all(torch.equal(a, b) for a, b in zip(snaps.before[step], snaps.after[step]))
        assert same == (step in (2, 5, 6)), step


def test_overflowing_parameter_is_named(pl):
    model = as_lightning(pl, TinyClassifier)(overflow_at=(3,))
    plugin = MixedPrecisionPlugin("fp16")
    names = {}

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            names[trainer.global_step - 1] = list(plugin.last_nonfinite_params)

    fit(pl, model, plugin, max_steps=5, callbacks=[Record()])
    assert names[3] == [("net.0.weight", 1)]
    assert names[2] == [] and names[4] == []


@pytest.mark.parametrize("skip_lr, expected", [(True, 0.5**7), (False, 0.5**10)])
def test_skipped_steps_hold_the_lr_schedule(pl, skip_lr, expected):
    model = as_lightning(pl, TinyClassifier)(overflow_at=(1, 4, 8), scheduler_gamma=0.5, lr=0.1)
    plugin = MixedPrecisionPlugin("fp16", skip_lr_on_overflow=skip_lr)
    trainer = fit(pl, model, plugin, max_steps=10)
    assert plugin.scaler.skipped_steps == 3
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * expected, rel=1e-12)


class CaptureGrads(Callback):
    """Master grads as hooks see them (before clipping) and as the optimizer sees them (after)."""

    def __init__(self):
        self.seen, self.stepped = [], []
        self.handle = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append([p.grad.clone() for g in optimizer.param_groups for p in g["params"]])
        if self.handle is None:
            inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
            inner = getattr(inner, "optimizer", inner)
            self.handle = inner.register_step_pre_hook(
                lambda opt, args, kwargs: self.stepped.append(
                    [p.grad.clone() for g in opt.param_groups for p in g["params"]]
                )
            )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("algorithm, clip", [("norm", 0.05), ("value", 0.01)])
def test_clipping_sees_unscaled_fp32_grads(pl, optimizer, algorithm, clip):
    model = as_lightning(pl, TinyClassifier)(optimizer=optimizer)
    capture = CaptureGrads()
    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=2.0**12))
    fit(pl, model, plugin, max_steps=3, callbacks=[capture], gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    assert len(capture.seen) == len(capture.stepped) == 3
    for before, after in zip(capture.seen, capture.stepped):
        assert all(g.dtype == torch.float32 for g in before)
        for e, a in zip(clipped(before, algorithm, clip), after):
            assert torch.equal(e, a)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in capture.seen[0]]))
    assert total > clip  # clipping really acted (unscaled grads are not tiny)


def clipped(grads, algorithm, clip):
    """Lightning's clipping applied by hand to FP32 unscaled grads."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    if algorithm == "norm":
        torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        torch.nn.utils.clip_grad_value_(params, clip)
    return [p.grad for p in params]


def test_accumulation_steps_once_per_optimizer_step_and_matches_fp32(pl):
    results = {}
    for precision in ("fp32", "fp16"):
        pl.seed_everything(0)
        model = as_lightning(pl, TinyClassifier)(lr=1e-2)
        plugin = MixedPrecisionPlugin(precision)
        trainer = fit(pl, model, plugin, max_steps=4, accumulate_grad_batches=2)
        assert trainer.global_step == 4
        assert plugin.scaler.update_count == (4 if precision == "fp16" else 0)  # fp32: a disabled scaler
        results[precision] = [p.detach().float() for p in model.parameters()]
    for a, b in zip(results["fp32"], results["fp16"]):
        torch.testing.assert_close(a, b, atol=4e-3, rtol=0)


def micro_batch_grads_summed_in_fp32(pl, plugin, **trainer_kwargs):
    """The FP32 master gradient of the first step over 3 micro-batches, and whether it holds FP32 digits."""
    seen = {}

    class Probe(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.setdefault("grad", unwrap(optimizer).master_params()[0].grad.clone())

    pl.seed_everything(0)
    model = as_lightning(pl, TinyClassifier)(lr=1e-2)
    callbacks = [Probe(), *trainer_kwargs.pop("callbacks", [])]
    fit(pl, model, plugin, max_steps=1, callbacks=callbacks, **trainer_kwargs)
    grad = seen["grad"]
    return grad, not torch.equal(grad, grad.bfloat16().float())


@pytest.mark.parametrize("preset", ["bf16", "bf16_lean"])
def test_a_scheduled_accumulation_sums_the_micro_batches_in_fp32_as_the_trainers(pl, preset):
    """Accumulation asked for with Lightning's ``GradientAccumulationScheduler`` (which sets
    ``accumulate_grad_batches`` at each epoch's start, after the plugin wrapped the optimizers) sums in FP32
    as ``Trainer(accumulate_grad_batches=3)`` does: the same master gradient, bit for bit. It was summed in
    the BF16 gradient: the master gradient held only BF16 values."""
    expected, digits = micro_batch_grads_summed_in_fp32(pl, MixedPrecisionPlugin(preset), accumulate_grad_batches=3)
    assert digits
    scheduler = pl.callbacks.GradientAccumulationScheduler({0: 3})
    got, _ = micro_batch_grads_summed_in_fp32(pl, MixedPrecisionPlugin(preset), callbacks=[scheduler])
    assert torch.equal(got, expected)


class TwoOptimizers:
    def __init__(self, overflow_at_iteration: int):
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(8, 2)
        self.b = torch.nn.Linear(8, 2)
        self.overflow_at_iteration = overflow_at_iteration
        self.iteration = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        for net, opt in ((self.a, opt_a), (self.b, opt_b)):
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(net(x).float(), y))
            if net is self.b and self.iteration == self.overflow_at_iteration:
                self.b.weight.grad[0, 0] = math.inf
            opt.step()
        self.iteration += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.AdamW(self.b.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(tiny_data(48), batch_size=8)


def test_manual_optimization_updates_the_scale_once_per_iteration(pl):
    model = as_lightning(pl, TwoOptimizers)(overflow_at_iteration=2)
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=2)
    fit(pl, model, MixedPrecisionPlugin("fp16", scaler=scaler), max_epochs=1)
    assert model.iteration == 6
    assert scaler.update_count == 6
    assert scaler.skipped_steps == 1
    # clean, grow, overflow (back off), clean, grow, clean
    assert scaler.get_scale() == 2.0**8 * 2 / 2 * 2


def test_nan_loss_is_skipped(pl):
    class NanLoss(TinyClassifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * math.nan if self.global_step == 1 else loss

    model = as_lightning(pl, NanLoss)()
    plugin = MixedPrecisionPlugin("fp16")
    fit(pl, model, plugin, max_steps=3)
    assert plugin.scaler.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


AVX2_ONLY = simulated_cpu(capability="AVX2", onednn_bf16=False)
AVX512_BF16 = simulated_cpu(avx512_bf16=True)


@pytest.mark.parametrize(
    "cpu, kwargs, emulating, path",
    [
        (AVX2_ONLY, dict(precision="fp16"), True, "fp16: emulated (no native FP16 GEMM"),
        (AVX2_ONLY, dict(precision="bf16_autocast"), True, "bf16: emulated (no native BF16 GEMM"),
        (AVX512_BF16, dict(precision="bf16_autocast"), False, "bf16: native (avx512_bf16)"),
        (AVX512_BF16, dict(precision="fp16"), True, "fp16: emulated (no native FP16 GEMM"),
        (AVX2_ONLY, dict(precision="fp16", emulate="off"), False, "fp16: native CPU kernels, forced by emulate='off'"),
        (
            AVX512_BF16,
            dict(precision="bf16", emulate="on"),
            True,
            "bf16: emulated (FP32 matmuls rounded once), forced by emulate='on' (auto: native (avx512_bf16))",
        ),
        (AVX2_ONLY, dict(precision="fp32", emulate="on"), False, "fp32"),
    ],
)
def test_the_cpu_path_is_chosen_per_dtype_and_logged_once(pl, simulate, cpu, kwargs, emulating, path, monkeypatch):
    # A handler on the rank-zero logger of the namespace whose Trainer runs (each keeps its own):
    # caplog sits on the root logger, which Lightning's loggers reach or not depending on what
    # configured logging before (test order).
    logger = logging.getLogger(f"{pl.__name__}.utilities.rank_zero")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    monkeypatch.setattr(logger, "level", logging.INFO)
    logger.addHandler(handler)
    simulate(cpu)
    plugin = MixedPrecisionPlugin(**kwargs)
    try:
        fit(pl, as_lightning(pl, TinyClassifier)(), plugin, max_steps=2)
    finally:
        logger.removeHandler(handler)
    assert plugin.emulating == emulating
    assert plugin.compute_path.startswith(path)
    lines = [r.getMessage() for r in records if r.getMessage().startswith("amp_plugin:")]
    assert len(lines) == 1 and plugin.compute_path in lines[0]


def test_norm_layers_are_never_rounded_through_half():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        model[1].weight.fill_(1 + 2**-20)  # not representable in FP16 or BF16
        model[2].running_var.fill_(1 + 2**-20)
    MixedPrecisionPlugin("bf16").convert_module(model)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == model[2].running_var.dtype == torch.float32
    assert model[1].weight[0].item() == model[2].running_var[0].item() == 1 + 2**-20
    out = model(torch.randn(3, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16  # the FP32 norms hand half-precision activations on


def test_scale_collapse_saves_the_last_good_state_then_raises(pl, tmp_path):
    class AlwaysOverflow(TinyClassifier):
        def on_after_backward(self):
            if self.global_step >= 2:
                self.net[0].weight.grad[0, 0] = math.inf

    model = as_lightning(pl, AlwaysOverflow)()
    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=4.0, min_scale=1.0))
    snaps = Snapshots()
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=20, default_root_dir=tmp_path, callbacks=[snaps])
    with pytest.raises(LossScaleCollapseError) as info:
        trainer.fit(model)
    err = info.value
    assert (err.scale, err.consecutive_skips) == (1.0, 3)  # 4 -> 2 -> 1 -> collapse
    assert err.checkpoint_path == str(tmp_path / "checkpoints" / "last-good.ckpt")
    assert err.checkpoint_path in str(err)
    saved = torch.load(err.checkpoint_path, weights_only=False)
    good = snaps.after[1]  # the state after the last real step
    for name, value in zip([n for n, _ in model.named_parameters()], good):
        assert torch.equal(saved["state_dict"][name], value)


def test_on_min_scale_skip_keeps_training(pl):
    class AlwaysOverflow(TinyClassifier):
        def on_after_backward(self):
            if self.global_step >= 2:
                self.net[0].weight.grad[0, 0] = math.inf

    plugin = MixedPrecisionPlugin("fp16", scaler=DynamicLossScaler(init_scale=4.0, on_min_scale="skip"))
    trainer = fit(pl, as_lightning(pl, AlwaysOverflow)(), plugin, max_steps=10)
    assert trainer.global_step == 10 and plugin.scaler.skipped_steps == 8


def test_refitting_a_module_holds_the_schedule_with_the_new_plugin(pl):
    model = as_lightning(pl, TinyClassifier)(overflow_at=(1,), scheduler_gamma=0.5, lr=0.1)
    fit(pl, model, MixedPrecisionPlugin("fp16"), max_steps=3)  # first plugin: one skip, two LR steps
    model.overflow_at = {1, 2}
    plugin = MixedPrecisionPlugin("fp16")
    trainer = fit(pl, model, plugin, max_steps=4)  # fresh optimizer and scheduler, 4 steps, 2 skipped
    assert plugin.scaler.skipped_steps == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2, rel=1e-12)


def test_after_fit_the_module_pickles_deep_copies_and_its_copy_still_holds_the_schedule(pl, tmp_path):
    model = as_lightning(pl, PicklableClassifier)(overflow_at=(1,), scheduler_gamma=0.5, lr=0.1)
    fit(pl, model, MixedPrecisionPlugin("fp16"), max_steps=3)
    assert "lr_scheduler_step" not in vars(model)  # nothing of the plugin's is left on the module
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))
    twin = copy.deepcopy(model)
    twin.overflow_at = {0, 2}
    plugin = MixedPrecisionPlugin("fp16")
    trainer = fit(pl, twin, plugin, max_steps=4)
    assert plugin.scaler.skipped_steps == 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2, rel=1e-12)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR  # the held class is gone after fit
    assert "step" not in vars(scheduler) and "step" not in scheduler.state_dict()


def test_a_user_lr_scheduler_step_is_held_too(pl):
    class OwnSchedulerStep(TinyClassifier):
        def lr_scheduler_step(self, scheduler, metric):
            scheduler.step()

    model = as_lightning(pl, OwnSchedulerStep)(overflow_at=(1, 4), scheduler_gamma=0.5, lr=0.1)
    trainer = fit(pl, model, MixedPrecisionPlugin("fp16"), max_steps=6)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4, rel=1e-12)


def test_assigning_another_scaler_replaces_it_everywhere(pl):
    model = as_lightning(pl, TinyClassifier)(overflow_at=(2,))
    plugin = MixedPrecisionPlugin("fp16")
    replacement = DynamicLossScaler(init_scale=2.0**6)
    plugin.scaler = replacement
    fit(pl, model, plugin, max_steps=4)
    assert plugin.scaler is replacement
    assert replacement.update_count == 4 and replacement.skipped_steps == 1 and replacement.get_scale() == 2.0**5
    with pytest.raises(ValueError, match="nothing to scale"):
        MixedPrecisionPlugin("fp32").scaler = DynamicLossScaler()
    plugin.scaler = None
    assert not plugin.scaler.is_enabled()


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_module_with_torchmetrics_trains_under_every_preset(pl, preset):
    torchmetrics = pytest.importorskip("torchmetrics")

    class WithMetrics(TinyClassifier):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.acc = torchmetrics.Accuracy(task="multiclass", num_classes=2)
            self.mean_loss = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.acc(self(batch[0].to(self.net[0].weight.dtype)).argmax(-1), batch[1])
            self.mean_loss(loss)
            return loss

    model = as_lightning(pl, WithMetrics)(optimizer="sgd")  # every preset takes any optimizer
    fit(pl, model, MixedPrecisionPlugin(preset), max_steps=4)
    assert model.mean_loss.mean_value.dtype == torch.float32  # metric states stay as torchmetrics keeps them
    assert 0.0 <= float(model.acc.compute()) <= 1.0
    assert torch.isfinite(model.mean_loss.compute())


@pytest.mark.parametrize("preset", ["fp16", "bf16_autocast", "fp16_pure"])
def test_lbfgs_is_refused_before_training_with_the_plugins_message(pl, preset):
    class WithLBFGS(TinyClassifier):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters(), lr=0.1)

    model = as_lightning(pl, WithLBFGS)()
    with pytest.raises(ValueError, match=r"LBFGS .* precision='fp32'"):
        fit(pl, model, MixedPrecisionPlugin(preset), max_steps=2)
    assert model.global_step == 0
