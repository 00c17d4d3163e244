"""Preflight checks: each planted setup problem is reported with its fix; clean setups are silent."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _models import as_lightning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from amp_plugin.callbacks import PreflightChecks
from amp_plugin.lightning.plugin import MixedPrecisionPlugin
from amp_plugin.preflight import (
    PreflightError,
    PreflightWarning,
    check_loss_dtype,
    check_optimizer_eps,
    check_weight_range,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]


class Net:
    def __init__(self, half=False, half_loss=False, optimizer="sgd", eps=1e-8, grad_scaler=False, init=None):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))
        if init is not None:
            init(self.body)
        if half:
            self.half()
        if grad_scaler:
            self.grad_scaler = torch.amp.GradScaler("cpu")
        self.half_loss, self.optimizer, self.eps = half_loss, optimizer, eps

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.body(x)
        return F.cross_entropy(logits if self.half_loss else logits.float(), y)

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-3, eps=self.eps)
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(
            TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)), batch_size=4
        )


def run(pl, model, plugin, checks=None, max_steps=2, tmp_path=None, **trainer_kwargs):
    """Fit and return the preflight messages that were warned."""
    checks = checks or PreflightChecks()
    trainer = pl.Trainer(
        max_steps=max_steps,
        plugins=[plugin] if plugin is not None else None,
        callbacks=[checks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return [str(w.message) for w in caught if issubclass(w.category, PreflightWarning)]


def huge_weight(body):
    with torch.no_grad():
        body[0].weight[0, 0] = 1.0e5


def tiny_weights(body):
    with torch.no_grad():
        body[0].weight.uniform_(1e-7, 1e-6)


def test_weights_beyond_fp16_range_suggest_bf16(pl, tmp_path):
    [message] = run(pl, as_lightning(pl, Net)(init=huge_weight), MixedPrecisionPlugin("fp16"), tmp_path=tmp_path)
    assert message.startswith("amp_plugin preflight [weight_range]")
    assert "1 weight value(s) exceed FP16's maximum 65504" in message and "body.0.weight" in message
    assert "Fix: train in bf16" in message


def test_weights_below_fp16_normal_range_suggest_bf16(pl, tmp_path):
    [message] = run(pl, as_lightning(pl, Net)(init=tiny_weights), MixedPrecisionPlugin("fp16"), tmp_path=tmp_path)
    assert "below FP16's smallest normal value 6.1e-05" in message and "body.0.weight" in message
    assert "precision='bf16'" in message


def test_weight_range_is_only_checked_for_fp16(pl, tmp_path):
    assert run(pl, as_lightning(pl, Net)(init=huge_weight), MixedPrecisionPlugin("bf16"), tmp_path=tmp_path) == []


def test_weight_range_skips_norm_layers_kept_in_fp32(pl, tmp_path):
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    with torch.no_grad():
        model[1].weight.fill_(1e5)
    assert check_weight_range(model.named_parameters())  # the plain function sees it
    norm_huge = as_lightning(pl, Net)(init=lambda body: body[1].weight.data.fill_(1e5))
    assert run(pl, norm_huge, MixedPrecisionPlugin("fp16"), tmp_path=tmp_path) == []


def test_eps_that_is_zero_in_fp16_state(pl, tmp_path):
    plugin = MixedPrecisionPlugin("fp16", master_weights=False, autocast=False, scaler=None)
    [message] = run(pl, as_lightning(pl, Net)(optimizer="adam"), plugin, tmp_path=tmp_path)
    assert message.startswith("amp_plugin preflight [optimizer_eps]")
    assert "eps=1e-08, which is 0 in torch.float16" in message
    assert "master_weights=True" in message and "eps=1e-4" in message


def test_eps_is_fine_with_fp32_master_state(pl, tmp_path):
    assert run(pl, as_lightning(pl, Net)(optimizer="adam"), MixedPrecisionPlugin("fp16"), tmp_path=tmp_path) == []
    adam = torch.optim.Adam(nn.Linear(2, 2).half().parameters(), eps=1e-4)
    assert check_optimizer_eps(adam) == []


def test_half_model_under_autocast(pl, tmp_path):
    plugin = MixedPrecisionPlugin("fp16", master_weights=False, autocast=True)
    messages = run(pl, as_lightning(pl, Net)(half=True), plugin, max_steps=1, tmp_path=tmp_path)
    [message] = [m for m in messages if "[half_params_autocast]" in m]
    assert "autocast is on, but 6 parameter(s) are already torch.float16" in message
    assert "keep the model in FP32" in message and "master_weights=True" in message


def test_grad_scaler_attribute_with_fp16_parameters(pl, tmp_path):
    plugin = MixedPrecisionPlugin("fp16", master_weights=False, autocast=False, scaler=None)
    messages = run(pl, as_lightning(pl, Net)(grad_scaler=True), plugin, tmp_path=tmp_path)
    [message] = [m for m in messages if "[grad_scaler_half_grads]" in m]
    assert "torch.amp.GradScaler (pl_module.grad_scaler)" in message
    assert "Attempting to unscale FP16 gradients" in message
    assert "MixedPrecisionPlugin('fp16', master_weights=True)" in message


def test_lightning_16_mixed_with_a_half_model_is_stopped_before_it_fails(pl, tmp_path):
    """Lightning's own GradScaler would raise 'Attempting to unscale FP16 gradients' at step 0."""
    plugin = pl.plugins.precision.MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    checks = PreflightChecks(on_problem="raise", skip=["half_params_autocast"])
    with pytest.raises(PreflightError, match=r"\[grad_scaler_half_grads\].*MixedPrecision precision plugin"):
        run(pl, as_lightning(pl, Net)(half=True), plugin, checks=checks, tmp_path=tmp_path)


@pytest.mark.parametrize(
    "plugin",
    [
        pytest.param(lambda: MixedPrecisionPlugin("fp16"), id="scaled"),  # the hook sees the scaled FP32 loss
        pytest.param(lambda: MixedPrecisionPlugin("fp16", scaler=None), id="unscaled"),
    ],
)
def test_half_loss(pl, tmp_path, plugin):
    [message] = run(pl, as_lightning(pl, Net)(half_loss=True), plugin(), tmp_path=tmp_path)
    assert message.startswith("amp_plugin preflight [half_loss]: the training loss is torch.float16")
    assert "logits.float()" in message


def test_half_loss_message_explains_the_scale():
    [problem] = check_loss_dtype(torch.ones((), dtype=torch.float16), scale=65536.0)
    assert "the gradient reaching the FP16 loss is 65536, which is inf in FP16" in problem.message
    [problem] = check_loss_dtype(torch.ones((), dtype=torch.bfloat16))
    assert "overflow" not in problem.message
    assert check_loss_dtype(torch.ones(())) == []


@pytest.mark.parametrize(
    "plugin",
    [
        pytest.param(lambda: MixedPrecisionPlugin("fp16"), id="fp16"),
        pytest.param(lambda: MixedPrecisionPlugin("fp16", master_weights=False, autocast=True), id="fp16-autocast"),
        pytest.param(lambda: MixedPrecisionPlugin("bf16", master_weights=False, autocast=False), id="bf16-pure"),
        pytest.param(lambda: None, id="lightning-32"),
    ],
)
def test_clean_setups_are_silent(pl, tmp_path, plugin):
    assert run(pl, as_lightning(pl, Net)(optimizer="adam"), plugin(), tmp_path=tmp_path) == []


def test_strict_mode_raises_with_the_same_text(pl, tmp_path):
    with pytest.raises(PreflightError, match=r"\[weight_range\].*Fix: train in bf16"):
        run(
            pl,
            as_lightning(pl, Net)(init=huge_weight),
            MixedPrecisionPlugin("fp16"),
            PreflightChecks(on_problem="raise"),
            tmp_path=tmp_path,
        )


def test_skipped_checks_do_not_run(pl, tmp_path):
    checks = PreflightChecks(skip=["weight_range"])
    assert (
        run(pl, as_lightning(pl, Net)(init=huge_weight), MixedPrecisionPlugin("fp16"), checks, tmp_path=tmp_path) == []
    )
    assert checks.problems == []


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="on_problem"):
        PreflightChecks(on_problem="ignore")
    with pytest.raises(ValueError, match="skip"):
        PreflightChecks(skip=["eps"])


@pytest.mark.parametrize("how", ["trainer_flag", "torch_context"])
def test_anomaly_detection_with_dynamic_scaling_is_reported(pl, tmp_path, how):
    model = as_lightning(pl, Net)(optimizer="adam")
    if how == "trainer_flag":
        messages = run(pl, model, MixedPrecisionPlugin("fp16"), tmp_path=tmp_path, detect_anomaly=True)
    else:
        with torch.autograd.set_detect_anomaly(True):
            messages = run(pl, model, MixedPrecisionPlugin("fp16"), tmp_path=tmp_path)
    assert [m for m in messages if "[anomaly_detection]" in m and "Fix: turn anomaly detection off" in m]


def test_anomaly_detection_without_dynamic_scaling_is_fine(pl, tmp_path):
    model = as_lightning(pl, Net)(optimizer="adam")
    assert run(pl, model, MixedPrecisionPlugin("bf16"), tmp_path=tmp_path, detect_anomaly=True) == []


def test_why_anomaly_detection_and_dynamic_scaling_do_not_mix():
    """An overflow the scaler would skip raises inside backward under anomaly detection."""
    from amp_plugin import DynamicLossScaler, MasterWeightOptimizer

    def overflowing_step(model, opt, scaler):
        opt.zero_grad()
        loss = (model(torch.full((2, 4), 30.0, dtype=torch.float16)).float() * 1000).sum()
        scaler.scale(loss).backward()  # the gradient times 2**16 overflows FP16; LayerNorm's backward makes NaN
        return scaler.step(opt)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = DynamicLossScaler()
    assert overflowing_step(model, opt, scaler) is None  # skipped, as it should be
    scaler.update()
    with (
        torch.autograd.set_detect_anomaly(True),
        pytest.warns(UserWarning, match="Error detected"),
        pytest.raises(RuntimeError, match="returned nan values"),
    ):
        overflowing_step(model, opt, scaler)
