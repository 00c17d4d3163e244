"""Lightning's own clipping and AMP tests, run against MixedPrecisionPlugin's presets with
Lightning's own precision plugins as the control.

Ported from Lightning 2.6's ``tests_pytorch``:

- ``trainer/test_trainer.py::test_gradient_clipping_by_norm`` and ``::test_gradient_clipping_by_value``:
  a ``configure_gradient_clipping`` that calls ``super()`` and then reads the module's ``p.grad``
  sees clipped gradients;
- ``models/test_amp.py::test_amp_gradient_unscale`` (with its ``TestPrecisionModel`` and
  ``TestClippingOptimizer``): ``on_before_optimizer_step`` sees the unscaled gradients, the
  module's ``p.grad`` is value-clipped after ``super().configure_gradient_clipping``, and still
  at the optimizer's ``step``, with gradient accumulation 1 and 2.

Each case runs under both namespaces (``lightning.pytorch`` and ``pytorch_lightning``), with
``MixedPrecisionPlugin`` presets (``fp32``, ``fp16``, ``bf16``, ``bf16_split``) and with
Lightning's ``"32-true"``, ``"16-mixed"`` and ``"bf16-mixed"`` (the control: upstream runs
these tests with ``"32-true"`` and, on a GPU, ``"16-mixed"``).

What differs from upstream, each on purpose and checked as such (search for "Design difference"
and "Adapted"):

- Adapted: one CPU process instead of ``ddp_spawn`` on two GPUs, and the models' losses are
  computed in FP32 (``preds.float()``): under the master-weight presets the module computes in
  the half type, and a loss computed in FP16 receives a gradient equal to the loss scale, which
  overflows FP16 at the default ``2**16``. ``ClassificationModel``/``ClassifDataModule`` are
  rebuilt here without sklearn (the same layers and optimizer, a seeded three-class dataset).
  ``"16-mixed"`` is given as Lightning's ``MixedPrecision("16-mixed", "cpu")`` plugin (on a CPU,
  ``Trainer(precision="16-mixed")`` turns into ``"bf16-mixed"``). ``"32-true"`` and the ``fp32``
  preset (which is ``"32-true"``) run the closure inside the optimizer's ``step()``, so
  ``TestClippingOptimizer`` runs it before its check.
- Design difference: under the master-weight presets the module's parameters, so its ``p.grad``,
  are FP16/BF16: what a hook reads there is the FP32 run's value rounded to that type once. The
  tests compare in that type (``1e-10`` is ``0`` in FP16: below its smallest subnormal) and
  check the FP32 master gradients, which the step uses, against the upstream values themselves.
- Design difference: the plugin's loss scaler keeps its per-optimizer stage in
  ``_per_optimizer`` (``torch.amp.GradScaler``: ``_per_optimizer_states``); ``fp32`` has a
  disabled scaler (scale 1.0) and ``bf16`` none unless given one, so the unscale test gives
  ``bf16``/``bf16_split`` a ``DynamicLossScaler`` (``"bf16-mixed"`` takes no scaler: upstream
  runs that test with ``"16-mixed"`` only).
- ``bf16_split`` runs upstream's models as they are (the BoringModel's SGD, the test's own
  optimizer subclass with ``step(pl_module=...)``): without a fused kernel for them the wrapped
  optimizer's own step runs over the FP32 masters. Its gradients are BF16 and clipped in BF16
  (they are the step's).
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from _models import quiet_trainer

from amp_plugin import DynamicLossScaler, MixedPrecisionPlugin

PRESETS = ["fp32", "fp16", "bf16", "bf16_split", "bf16_lean", "bf16_sr"]
CONTROLS = ["32-true", "16-mixed", "bf16-mixed"]
HALF = (torch.float16, torch.bfloat16)


def precision_kwargs(pl: ModuleType, precision: str, scaler: bool = False) -> dict:
    """Trainer kwargs for a preset of ours or a Lightning precision (``"16-mixed"`` as its
    plugin: ``Trainer(precision="16-mixed")`` on a CPU turns into ``"bf16-mixed"``)."""
    if precision == "16-mixed":
        return {"plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu")]}
    if precision in CONTROLS:
        return {"precision": precision}
    if scaler and precision in ("bf16", "bf16_split", "bf16_lean", "bf16_sr"):
        return {"plugins": [MixedPrecisionPlugin(precision, scaler=DynamicLossScaler())]}
    return {"plugins": [MixedPrecisionPlugin(precision)]}


def masters_of(trainer) -> list[torch.Tensor]:
    """The parameters the step updates: FP32 masters with master weights, else the module's."""
    opt = trainer.optimizers[0]
    return list(opt.master_params()) if hasattr(opt, "master_params") else list(trainer.lightning_module.parameters())


def grads_are_half(trainer) -> bool:
    return any(p.dtype in HALF for p in trainer.lightning_module.parameters())


def norm_of(grads) -> torch.Tensor:
    """Upstream's total norm, in FP32 (a norm of FP16 values may overflow in FP16)."""
    return torch.norm(torch.stack([torch.norm(g.detach().float(), 2) for g in grads]), 2)


# ---------------------------------------------------------------- test_gradient_clipping_by_norm
class ClassificationModel:
    """Upstream's ``tests_pytorch.helpers.simple_models.ClassificationModel`` (without the
    torchmetrics accuracy, which these tests do not read), loss in FP32 (module docstring)."""

    def __init__(self, num_features: int = 32, num_classes: int = 3, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        for i in range(3):
            setattr(self, f"layer_{i}", torch.nn.Linear(num_features, num_features))
            setattr(self, f"layer_{i}a", torch.nn.ReLU())
        self.layer_end = torch.nn.Linear(num_features, num_classes)

    def forward(self, x):
        for i in range(3):
            x = getattr(self, f"layer_{i}a")(getattr(self, f"layer_{i}")(x))
        return F.softmax(self.layer_end(x), dim=1)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.parameters(), lr=self.lr)], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self(x).float(), y)}

    def train_dataloader(self):
        """``ClassifDataModule``'s shape: 800 samples of 32 features in 3 classes, batches of 10."""
        g = torch.Generator().manual_seed(42)
        centers = 3 * torch.randn(3, 32, generator=g)
        y = torch.randint(0, 3, (800,), generator=g)
        x = centers[y] + torch.randn(800, 32, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)


class ClipByNorm:
    """Upstream's ``TestModel`` of ``test_gradient_clipping_by_norm``; also records the
    masters' norm (the gradients the step uses)."""

    def configure_gradient_clipping(self, *args, **kwargs):
        super().configure_gradient_clipping(*args, **kwargs)
        grad_norm = norm_of(p.grad for p in self.parameters())
        if grads_are_half(self.trainer):
            # Design difference: the module's p.grad is the clipped FP32 gradient rounded once to
            # the half type; each element is off by at most half an ulp, so the norm too.
            dtype = next(p.grad.dtype for p in self.parameters() if p.dtype in HALF)
            rtol = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
            torch.testing.assert_close(grad_norm, torch.tensor(0.05), rtol=rtol, atol=0)
        else:
            torch.testing.assert_close(grad_norm, torch.tensor(0.05, device=self.device))
        self.master_norm = norm_of(m.grad for m in masters_of(self.trainer))
        self.assertion_called = True


class ClipByValue:
    """Upstream's ``TestModel`` of ``test_gradient_clipping_by_value`` (a BoringModel)."""

    def loss(self, preds, labels=None):
        return F.mse_loss(preds.float(), torch.ones_like(preds, dtype=torch.float32))  # Adapted: FP32 loss

    def configure_gradient_clipping(self, *args, **kwargs):
        super().configure_gradient_clipping(*args, **kwargs)
        grads = [p.grad for p in self.parameters()]
        grad_max = torch.max(torch.stack([torch.max(g.detach().abs()) for g in grads]))
        # Design difference: in a half-precision module the clip value shows rounded to its type
        # (1e-10 is 0 in FP16, 1.0004e-10 in BF16); in FP32 it is upstream's 1e-10.
        torch.testing.assert_close(grad_max, torch.tensor(1e-10, dtype=grad_max.dtype), rtol=0, atol=0)
        self.master_max = max(float(m.grad.abs().max()) for m in masters_of(self.trainer))
        self.assertion_called = True


@functools.cache
def lightning_class(pl: ModuleType, body: type, base: str) -> type:
    """``body`` over ``pl``'s ``LightningModule`` or its demo ``BoringModel``."""
    demos = importlib.import_module(f"{pl.__name__}.demos.boring_classes")
    parent = pl.LightningModule if base == "module" else demos.BoringModel
    return type(body.__name__, (body, parent), {"__module__": __name__})


def clipping_trainer(pl, precision, tmp_path, **kwargs):
    return quiet_trainer(
        pl, default_root_dir=tmp_path, max_steps=1, max_epochs=1, **precision_kwargs(pl, precision), **kwargs
    )


@pytest.mark.parametrize("precision", PRESETS + CONTROLS)
def test_gradient_clipping_by_norm(pl, tmp_path, precision):
    trainer = clipping_trainer(pl, precision, tmp_path, gradient_clip_algorithm="norm", gradient_clip_val=0.05)
    model = lightning_class(pl, type("TestModel", (ClipByNorm, ClassificationModel), {}), "module")()
    pl.seed_everything(0)
    trainer.fit(model)
    assert model.assertion_called
    # what the step uses is upstream's norm: the FP32 masters clipped in FP32 (every master kind)
    torch.testing.assert_close(model.master_norm, torch.tensor(0.05), rtol=1e-5, atol=0)


@pytest.mark.parametrize("precision", PRESETS + CONTROLS)
def test_gradient_clipping_by_value(pl, tmp_path, precision):
    trainer = clipping_trainer(pl, precision, tmp_path, gradient_clip_algorithm="value", gradient_clip_val=1e-10)
    model = lightning_class(pl, type("TestModel", (ClipByValue,), {}), "boring")()
    trainer.fit(model)
    assert model.assertion_called
    # the step's gradients hold upstream's 1e-10 (FP32 master gradients, with every master kind)
    expected = torch.tensor(1e-10, dtype=torch.float32)
    assert model.master_max == float(expected)


# ---------------------------------------------------------------- test_amp_gradient_unscale
def stage_name(scaler, optimizer) -> str:
    """The scaler's stage for ``optimizer`` (Design difference: where each scaler keeps it)."""
    if isinstance(scaler, torch.amp.GradScaler):
        return scaler._per_optimizer_states[id(optimizer)]["stage"].name
    return scaler._per_optimizer[id(optimizer)].stage.name


class TestClippingOptimizer(torch.optim.SGD):
    __test__ = False  # upstream's name; not a test class

    def step(self, closure=None, pl_module=None):
        if closure is not None:
            # Adapted: "32-true" (and the fp32 preset, which is it) runs the closure, so the
            # backward, the hooks and the clipping, inside step(): check after it
            with torch.enable_grad():
                loss = closure()
            pl_module.check_grads_clipped(at_step=True)
            super().step()
            return loss
        pl_module.check_grads_clipped(at_step=True)
        return super().step()


class TestPrecisionModel:
    """Upstream's ``TestPrecisionModel`` (a BoringModel), loss in FP32 (Adapted)."""

    __test__ = False

    # set per run: the scale check (fp32: a disabled scaler, 1.0)
    expect_scale = True

    def loss(self, preds, labels=None):
        return F.mse_loss(preds.float(), torch.ones_like(preds, dtype=torch.float32))

    def on_after_backward(self) -> None:
        # check grads are scaled
        scale = self.trainer.precision_plugin.scaler.get_scale()
        assert (scale != 1.0) if self.expect_scale else (scale == 1.0)
        grads = [p.grad for p in self.parameters()]
        inv_scale = 1 / scale
        self.original_grads = [p * inv_scale for p in grads]

    def check_grads_unscaled(self, optimizer=None):
        if optimizer is not None and self.expect_scale:
            assert stage_name(self.trainer.precision_plugin.scaler, optimizer) == "UNSCALED"
        grads = [p.grad for p in self.parameters()]
        assert len(grads) == len(self.original_grads)
        for actual, expected in zip(grads, self.original_grads):
            torch.testing.assert_close(actual, expected, equal_nan=True)

    def check_grads_clipped(self, at_step=False):
        parameters = list(self.parameters())
        assert len(parameters) == len(self.clipped_parameters)
        for actual, expected in zip(parameters, self.clipped_parameters):
            torch.testing.assert_close(actual.grad, expected.grad, equal_nan=True)
        self.checks["step" if at_step else "hook"] += 1

    def on_before_optimizer_step(self, optimizer, *_):
        self.check_grads_unscaled(optimizer)
        self.finite_steps += all(bool(torch.isfinite(p.grad).all()) for p in self.parameters())  # not skipped
        # manually clip
        self.clipped_parameters = []
        for p in self.parameters():
            copy = p.detach().clone()
            copy.grad = p.grad.clone()
            self.clipped_parameters.append(copy)
        clip_val = self.trainer.gradient_clip_val
        torch.nn.utils.clip_grad_value_(self.clipped_parameters, clip_val)

    def configure_gradient_clipping(self, *args, **kwargs):
        # let lightning clip
        super().configure_gradient_clipping(*args, **kwargs)
        # check clipping worked as expected
        self.check_grads_clipped()
        # the step's gradients are clipped too (the FP32 master gradients, with every master kind)
        clip = float(torch.tensor(1e-3, dtype=torch.float32))
        assert not any(bool((m.grad.abs() > clip).any()) for m in masters_of(self.trainer))  # NaN stays NaN

    def optimizer_step(self, epoch, batch_idx, optimizer, closure, **_):
        # pass self as a kwarg
        optimizer.step(closure, pl_module=self)

    def configure_optimizers(self):
        return TestClippingOptimizer(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("precision", [*PRESETS, "16-mixed"])
def test_amp_gradient_unscale(pl, tmp_path, precision, accum):
    model = lightning_class(pl, TestPrecisionModel, "boring")()
    model.expect_scale = precision != "fp32"
    model.checks = {"hook": 0, "step": 0}
    model.finite_steps = 0
    trainer = quiet_trainer(
        pl,
        max_epochs=2,
        default_root_dir=tmp_path,
        limit_train_batches=2,
        limit_val_batches=0,
        # use a tiny value to make sure it works
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        log_every_n_steps=1,
        accumulate_grad_batches=accum,
        **precision_kwargs(pl, precision, scaler=True),
    )
    trainer.fit(model)
    steps = 4 // accum
    assert trainer.global_step == steps
    # checked after super().configure_gradient_clipping at every step, overflowing ones included
    # (their module gradients held inf before the clip)...
    assert model.checks["hook"] == steps
    # ...and again inside every step the scaler did not skip
    assert model.checks["step"] == model.finite_steps
    scaler = trainer.precision_plugin.scaler
    if not isinstance(scaler, torch.amp.GradScaler):
        assert model.finite_steps == steps - scaler.skipped_steps
