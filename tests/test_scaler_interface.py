"""The GradScaler interface: skip semantics, stages, several optimizers, the static scaler."""

from __future__ import annotations

import math

import pytest
import torch

from amp_plugin import DynamicLossScaler, StaticLossScaler


def adam_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in enumerate(opt.state.values())}
    return params, state


def test_skipped_step_returns_none_and_changes_nothing():
    model, opt = adam_setup()
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    scaler.step(opt)  # a clean step populates Adam's state
    assert not scaler.last_step_skipped
    scaler.update()
    before = snapshot(model, opt)
    opt.zero_grad()
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    model.bias.grad[1] = math.nan
    assert scaler.step(opt) is None
    assert scaler.last_step_skipped
    scaler.update()
    after = snapshot(model, opt)
    for a, b in zip(before[0], after[0]):
        assert torch.equal(a, b)
    for k in before[1]:
        for n in before[1][k]:
            assert torch.equal(before[1][k][n], after[1][k][n])
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 4.0


def test_step_returns_what_the_optimizer_returns():
    class Returns(torch.optim.SGD):
        def step(self, closure=None):
            super().step()
            return "stepped"

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    scaler = StaticLossScaler(2.0)
    assert scaler.step(Returns([p], lr=0.1)) == "stepped"


def test_unscale_then_grads_are_true_grads():
    model, opt = adam_setup()
    x = torch.randn(5, 4)
    model(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.scale(model(x).pow(2).sum()).backward()
    scaler.unscale_(opt)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    scaler.update()


def test_update_without_step_is_an_error():
    with pytest.raises(RuntimeError, match="No inf checks"):
        DynamicLossScaler().update()


def test_scale_keeps_structure_and_shape():
    scaler = StaticLossScaler(4.0)
    out = scaler.scale([torch.tensor(1.0), (torch.tensor([2.0]),)])
    assert out[0].shape == () and out[0].item() == 4.0
    assert isinstance(out[1], tuple) and out[1][0].item() == 8.0
    with pytest.raises(TypeError):
        scaler.scale(3.0)


def test_several_optimizers_one_update_per_iteration():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=16.0, growth_interval=2)
    a_before = [p.detach().clone() for p in a.parameters()]
    b_before = [p.detach().clone() for p in b.parameters()]
    scaler.scale(a(torch.randn(1, 2)).sum() + b(torch.randn(1, 2)).sum()).backward()
    b.weight.grad[0, 0] = math.inf
    scaler.step(opt_a)  # a's own gradients are finite: GradScaler semantics, a steps
    assert not scaler.last_step_skipped
    assert scaler.step(opt_b) is None
    assert scaler.last_step_skipped
    scaler.update()
    # One iteration, one skip, one backoff, even with two optimizers.
    assert (scaler.skipped_steps, scaler.update_count, scaler.get_scale()) == (1, 1, 8.0)
    for p, q in zip(b.parameters(), b_before):
        assert torch.equal(p, q)
    assert not torch.equal(a.weight, a_before[0])


def test_static_scaler_skips_but_never_moves():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = StaticLossScaler(scale=128.0)
    for grad in (math.inf, 1.0, math.nan, 2.0):
        p.grad = torch.full((2,), grad * 128.0)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 128.0
    assert scaler.skipped_steps == 2
    assert torch.equal(p.detach(), torch.full((2,), -2.0))
    state = scaler.state_dict()
    other = StaticLossScaler(scale=1.0)
    other.load_state_dict(state)
    assert other.get_scale() == 128.0 and other.skipped_steps == 2


@pytest.mark.parametrize("scale", [0.0, -2.0, math.inf, math.nan])
def test_static_scale_must_be_positive_and_finite(scale):
    with pytest.raises(ValueError, match=r"^scale="):
        StaticLossScaler(scale)


def test_scale_change_record():
    scaler = DynamicLossScaler(init_scale=4.0, growth_interval=1)
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    scaler.step(torch.optim.SGD([p], lr=0.0))
    scaler.update()
    rec = scaler.last_update
    assert (rec.iteration, rec.old_scale, rec.new_scale, rec.reason, rec.found_inf) == (0, 4.0, 8.0, "growth", False)
    assert rec.changed


def test_manual_new_scale():
    scaler = DynamicLossScaler(init_scale=4.0)
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    scaler.step(torch.optim.SGD([p], lr=0.0))
    scaler.update(new_scale=32.0)
    assert scaler.get_scale() == 32.0 and scaler.last_update.reason == "manual"
    assert scaler.scale(torch.tensor(1.0)).item() == 32.0
