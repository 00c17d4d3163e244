"""What a hook does to the module's ``p.grad`` under master weights reaches the step as it would in
an FP32 run: a touch that changes no value changes nothing (Lightning's clipping stays, the FP32
master gradient stays), an edit is taken element by element, and ``p.grad = None`` leaves the
parameter out. The oracle is the same run without the hook, bit for bit, and the ``fp32`` preset.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import TinyClassifier, as_lightning, quiet_trainer
from _moments_oracle import on_a_bf16_neighbour

from amp_plugin import MixedPrecisionPlugin

MASTER_PRESETS = ["fp16", "bf16", "bf16_lean", "bf16_sr"]


class HookedClassifier(TinyClassifier):
    """TinyClassifier with plain SGD (lr=1: the update is the gradient), a loss multiplier, and
    a hook that does ``self.hook_action`` to the module's gradients; records the step's gradients."""

    def __init__(self, action=None, where="on_before_optimizer_step", loss_scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.action = action
        self.where = where
        self.loss_scale = loss_scale
        self.stepped: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).float(), y) * self.loss_scale

    def on_train_start(self):
        self.start = [p.detach().float().clone() for p in self.parameters()]
        inner = self.trainer.optimizers[0]
        inner = getattr(inner, "optimizer", inner)  # the wrapped SGD, over the masters
        inner.register_step_pre_hook(
            lambda opt, args, kwargs: self.stepped.append(
                [None if p.grad is None else p.grad.clone() for g in opt.param_groups for p in g["params"]]
            )
        )

    def on_before_optimizer_step(self, optimizer):
        if self.action is not None and self.where == "on_before_optimizer_step":
            self.action(self)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if self.action is not None and self.where == "after_clipping":
            self.action(self)
        self.module_grads = [None if p.grad is None else p.grad.clone() for p in self.parameters()]  # FP32: the step's

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def fit(pl, preset, max_steps=1, **kwargs):
    trainer_kwargs = {k: kwargs.pop(k) for k in ("gradient_clip_val", "gradient_clip_algorithm") if k in kwargs}
    pl.seed_everything(0)
    model = as_lightning(pl, HookedClassifier)(**kwargs)
    trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin(preset)], max_steps=max_steps, **trainer_kwargs)
    trainer.fit(model)
    return model, trained_values(trainer.optimizers[0], model)


def trained_values(opt, model):
    """The values the step trained, in parameter order: FP32 masters (joined from weight and remainder
    with ``bf16_split``; the BF16 weight itself with ``stochastic``, which keeps no master), or the
    module's own parameters."""
    if not hasattr(opt, "fp32_masters"):
        return [p.detach().float().clone() for p in model.parameters()]
    halves = iter(opt.fp32_masters())
    return [next(halves) if p.dtype in (torch.float16, torch.bfloat16) else p.detach().float().clone()
            for p in opt.model_params()]  # fmt: skip


def no_op_clip(module):
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1e9)  # multiplies every gradient by 1.0 in place


def update_norm(model, weights):
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w - s) for w, s in zip(weights, model.start)]))
    )


@pytest.mark.parametrize("preset", ["fp32", *MASTER_PRESETS])
def test_a_hook_that_touches_p_grad_in_place_keeps_lightnings_clipping(pl, preset):
    _, plain = fit(pl, preset, gradient_clip_val=1e-3)
    model, touched = fit(pl, preset, action=no_op_clip, gradient_clip_val=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(plain, touched))  # bit for bit the run without the hook
    if preset != "bf16_sr":
        assert update_norm(model, touched) == pytest.approx(1e-3, rel=1e-4)  # SGD lr=1: the clipped norm
        return
    # bf16_sr keeps no master: each BF16 weight lands on one of the two BF16 neighbours of start - grad (SGD
    # lr=1, the clipped FP32 gradient), rounded stochastically, so the norm of the update is not the clip's;
    # the FP32 (norm) parameters are their own masters
    for start, grad, weight, p in zip(model.start, model.stepped[0], touched, model.parameters(), strict=True):
        exact = start - grad
        if p.dtype == torch.float32:
            assert torch.equal(weight, exact)
            continue
        assert on_a_bf16_neighbour(weight, exact)
    clipped = torch.linalg.vector_norm(torch.cat([g.flatten() for g in model.stepped[0]]))
    assert float(clipped) == pytest.approx(1e-3, rel=1e-4)  # the step's gradients are clipped, as with a master


def test_a_hook_that_touches_p_grad_in_place_keeps_the_fp32_master_gradient(pl):
    # a loss of order 1e-6: the unscaled gradients are below FP16's normal range, where rounding
    # them to FP16 would lose most of their digits or flush them to zero
    reference_model, _ = fit(pl, "fp32", loss_scale=1e-6)
    plain_model, plain = fit(pl, "fp16", loss_scale=1e-6)
    model, touched = fit(pl, "fp16", action=no_op_clip, loss_scale=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(plain, touched))
    grad, expected = model.stepped[0][0], reference_model.module_grads[0]  # first layer's weight
    assert torch.equal(grad, plain_model.stepped[0][0])  # the step's FP32 gradient, as without the hook
    assert int(((grad == 0) & (expected != 0)).sum()) == 0  # none flushed to zero
    rel = torch.linalg.vector_norm(grad - expected) / torch.linalg.vector_norm(expected)
    assert rel < 1e-2  # the FP16 forward and backward's own error, not FP16 rounding of tiny values


def zero_first_row(module):
    module.net[0].weight.grad[0].zero_()


@pytest.mark.parametrize("preset", MASTER_PRESETS)
@pytest.mark.parametrize("where", ["on_before_optimizer_step", "after_clipping"])
def test_an_edit_is_taken_element_by_element(pl, preset, where):
    plain_model, _ = fit(pl, preset, gradient_clip_val=0.05)
    model, _ = fit(pl, preset, action=zero_first_row, where=where, gradient_clip_val=0.05)
    plain_grads, grads = plain_model.stepped[0], model.stepped[0]
    assert torch.all(grads[0][0] == 0)  # the edited row
    if where == "after_clipping":  # edited after the clip: every other element is the clipped FP32 gradient
        assert torch.equal(grads[0][1:], plain_grads[0][1:])
        assert all(torch.equal(a, b) for a, b in zip(grads[1:], plain_grads[1:]))
    else:  # edited before the clip: the clip then sees the edited gradients (as in an FP32 run)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        assert total.item() == pytest.approx(0.05, rel=1e-5)
        ratio = grads[0][1:] / plain_grads[0][1:]  # the rest is the FP32 gradient, with another clip factor
        finite = ratio[torch.isfinite(ratio)]
        torch.testing.assert_close(finite, torch.full_like(finite, float(finite[0])), rtol=1e-5, atol=0)


def drop_first_bias(module):
    module.net[0].bias.grad = None


@pytest.mark.parametrize("preset", ["fp32", *MASTER_PRESETS])
def test_p_grad_set_to_none_in_a_hook_leaves_the_parameter_out_of_the_step(pl, preset):
    model, weights = fit(pl, preset, action=drop_first_bias)
    assert torch.equal(weights[1], model.start[1])  # net[0].bias: not stepped
    assert not torch.equal(weights[0], model.start[0])  # the others trained


def clip_masters_in_fp32(module):
    masters = module.trainer.optimizers[0].master_params()
    torch.nn.utils.clip_grad_norm_(masters, 1e-3)
    module.clipped_masters = [m.grad.clone() for m in masters]


@pytest.mark.parametrize("preset", MASTER_PRESETS)
def test_a_hook_that_edits_the_master_grads_is_stepped_with_them_as_they_are(pl, preset):
    model, _ = fit(pl, preset, action=clip_masters_in_fp32)
    assert all(torch.equal(a, b) for a, b in zip(model.stepped[0], model.clipped_masters))
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in model.stepped[0]]))
    assert total.item() == pytest.approx(1e-3, rel=1e-5)
