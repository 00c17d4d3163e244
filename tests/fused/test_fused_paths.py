"""When the fused CPU step runs and what it falls back to: the wrapper's choice of path, a failed build,
the environment switch, gradients and parameters a kernel cannot take, step hooks."""

from __future__ import annotations

import warnings

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, fused
from amp_plugin.fused import adam as fused_adam


def half_model(seed=0):
    torch.manual_seed(seed)
    return (
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
        .half()
        .apply(lambda m: m.float() if isinstance(m, torch.nn.LayerNorm) else None)
    )


def train(fused_mode, steps=8, inf_at=(3,), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)):
    model = half_model()
    opt = MasterWeightOptimizer(optimizer(model.parameters()), fused=fused_mode)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = DynamicLossScaler(init_scale=2.0**12, growth_interval=3)
    torch.manual_seed(1)
    for i in range(steps):
        x = torch.randn(16, 64).half()
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if i in inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.5)  # clipping sees (and edits) the FP32 grads
        if scaler.step(opt) is not None or not scaler.last_step_skipped:
            sched.step()
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


def test_the_fused_path_trains_like_the_stock_path():
    fast_model, fast_opt, fast_scaler = train(None)
    _stock_model, stock_opt, stock_scaler = train(False)
    assert fast_scaler.skipped_steps == stock_scaler.skipped_steps == 1
    assert fast_scaler.get_scale() == stock_scaler.get_scale()
    for a, b in zip(fast_opt.master_params(), stock_opt.master_params()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(fast_model.parameters(), fast_opt.master_params()):
        assert torch.equal(a.detach(), b.detach().to(a.dtype))
    assert fast_opt.param_groups[0]["lr"] == stock_opt.param_groups[0]["lr"]
    # The state has the layout of torch's fused Adam: it loads into the stock path and back.
    stock_opt.load_state_dict(fast_opt.state_dict())
    fast_opt.load_state_dict(stock_opt.state_dict())


def test_the_fused_path_is_taken_only_when_it_applies(monkeypatch):
    calls = []
    real = fused_adam.adam_step
    monkeypatch.setattr("amp_plugin.fused.adam.adam_step", lambda *a: (calls.append(1), real(*a))[1])
    train(None, steps=2, inf_at=())
    assert len(calls) == 2  # AdamW(fused=True)
    calls.clear()
    train(None, steps=2, inf_at=(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))  # the user chose for-loop
    train(None, steps=2, inf_at=(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-2))
    train(False, steps=2, inf_at=())
    assert calls == []
    train(True, steps=2, inf_at=(), optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))  # asked for explicitly
    assert len(calls) == 2


def test_fused_true_says_why_it_cannot_apply():
    with pytest.raises(ValueError, match="Adam and AdamW only, not SGD"):
        MasterWeightOptimizer(torch.optim.SGD(half_model().parameters(), lr=0.1), fused=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        MasterWeightOptimizer(torch.optim.Adam(half_model().parameters(), amsgrad=True), fused=True)
    with pytest.raises(TypeError, match="fused='yes'"):
        MasterWeightOptimizer(torch.optim.Adam(half_model().parameters()), fused="yes")


def test_a_failed_build_warns_once_and_the_stock_path_carries_on(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the broken build stays out of the real cache
    monkeypatch.setattr(fused, "_state", {"tried": False, "ops": None, "error": None})
    monkeypatch.setattr(fused, "_flags", lambda: ("amp_plugin_fused_broken", ["-this-flag-does-not-exist"]))
    monkeypatch.delattr(torch.ops.amp_plugin, "adam_step_", raising=False)
    monkeypatch.setattr(torch.ops, "amp_plugin", type("Empty", (), {})())
    with pytest.warns(RuntimeWarning, match="could not build its fused CPU kernels"):
        assert fused.kernels() is None
    assert "Error" in fused.unavailable_reason()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert fused.kernels() is None
        _model, _opt, scaler = train(None, steps=5)
    assert scaler.skipped_steps == 1
    with pytest.raises(ValueError, match="the kernels are unavailable"):
        MasterWeightOptimizer(torch.optim.AdamW(half_model().parameters(), fused=True), fused=True)


def test_the_environment_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "0")
    assert fused.kernels() is None
    assert fused.unavailable_reason() == f"{fused.ENV_SWITCH}=0 is set"


@pytest.mark.parametrize("contiguous", [True, False])
def test_every_gradient_is_unscaled_exactly_once_on_either_path(contiguous):
    """A non-contiguous half gradient is copied and unscaled by torch's multi-tensor ops; the
    FP32 parameters (their own master) must not be unscaled a second time on the way, and the
    model's half gradients are only read (``unscaled_model_grads=False``: by default an explicit
    ``unscale_`` writes the unscaled values into them)."""
    model = half_model()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), fused=True), unscaled_model_grads=False)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(model(torch.randn(4, 64).half()).float().sum()).backward()
    if not contiguous:
        model[0].weight.grad = model[0].weight.grad.t().contiguous().t()
    before = [p.grad.float().clone() for p in model.parameters()]
    half_before = [(p.grad, p.grad._version) for p in model.parameters() if p.dtype == torch.float16]
    scaler.unscale_(opt)
    for master, grad in zip(opt.master_params(), before):
        assert torch.equal(master.grad, grad * 2.0**-8)
    assert all(
        p.grad is g and g._version == v
        for p, (g, v) in zip([p for p in model.parameters() if p.dtype == torch.float16], half_before)
    )


def test_a_gradient_the_kernel_cannot_take_sends_the_step_the_stock_way():
    model = half_model()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    stock_model = half_model()
    stock = MasterWeightOptimizer(torch.optim.AdamW(stock_model.parameters(), lr=1e-2, fused=True), fused=False)
    x = torch.randn(4, 64).half()
    for net, o in ((model, opt), (stock_model, stock)):
        net(x).float().sum().backward()
        o.sync_grads()
        first = o.master_params()[0]
        first.grad = first.grad.t().contiguous().t()  # as a hook might leave it: not contiguous
        o.step()
    for a, b, p in zip(opt.master_params(), stock.master_params(), model.parameters()):
        assert torch.equal(a, b) and torch.equal(p.detach(), a.detach().to(p.dtype))


@pytest.mark.parametrize("fused_mode", [None, True])
def test_a_non_contiguous_parameter_takes_the_stock_way_for_itself(fused_mode, monkeypatch):
    """A transposed view made a Parameter: the fused unscale and step leave it (and its
    gradient) to stock ops instead of raising, and train exactly as the stock path."""
    calls = []
    real = fused_adam.adam_step
    monkeypatch.setattr("amp_plugin.fused.adam.adam_step", lambda *a: (calls.append(1), real(*a))[1])
    runs = {}
    for name, mode in (("fused", fused_mode), ("stock", False)):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(6, 4).half().t())  # (4, 6), not contiguous
        bias = torch.nn.Parameter(torch.randn(4).half())
        opt = MasterWeightOptimizer(torch.optim.AdamW([weight, bias], lr=1e-2, fused=True), fused=mode)
        scaler = DynamicLossScaler(init_scale=2.0**8)
        for i in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).half()
            scaler.scale((x @ weight.t() + bias).float().pow(2).mean()).backward()
            assert not weight.grad.is_contiguous()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs[name] = [
            weight.detach().clone(),
            bias.detach().clone(),
            *(m.detach().clone() for m in opt.master_params()),
        ]
    assert len(calls) == 3  # the fused run took the fused step, the non-contiguous weight included
    for a, b in zip(runs["fused"], runs["stock"]):
        assert torch.equal(a, b)
    assert torch.equal(runs["fused"][0], runs["fused"][2].half())


def test_step_hooks_on_the_wrapped_optimizer_pause_the_fused_step(monkeypatch):
    calls = []
    real = fused_adam.adam_step
    monkeypatch.setattr("amp_plugin.fused.adam.adam_step", lambda *a: (calls.append(1), real(*a))[1])
    model = half_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    opt = MasterWeightOptimizer(inner)
    hooked = []

    def one_step():
        model(torch.randn(4, 64).half()).float().sum().backward()
        opt.step()
        opt.zero_grad()

    one_step()
    handle = inner.register_step_post_hook(lambda *_: hooked.append(1))
    one_step()  # the hook must run, so torch's own step does
    handle.remove()
    one_step()
    assert calls == [1, 1] and hooked == [1]
    hooked_inner = torch.optim.AdamW(half_model().parameters(), fused=True)
    hooked_inner.register_step_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match="step hooks, which the fused step would bypass"):
        MasterWeightOptimizer(hooked_inner, fused=True)


def test_a_refused_fused_true_leaves_the_optimizer_as_it_was():
    model = half_model()
    inner = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        MasterWeightOptimizer(inner, fused=True)
    assert [p.dtype for p in inner.param_groups[0]["params"]] == [p.dtype for p in model.parameters()]
    MasterWeightOptimizer(inner)  # not half wrapped: wrapping it again works
