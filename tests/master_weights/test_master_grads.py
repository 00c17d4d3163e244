"""Transient FP32 master gradients: none is stored unless read; read (clipped, edited,
replaced) ones are what the step uses; all are freed by the step; the model's gradients
are only read. Every fused mode gives the same masters as an FP32 run, bit for bit.

Exactness: the data is FP16-representable and the scales are powers of two.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import MasterGradWarning, MasterParameter

GRAD_SLOT = torch._C.TensorBase.grad
MODES = [None, False, "torch"]  # amp_plugin's kernels, stock torch ops, torch's multi-tensor kernels


def half_values(*shape, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).half()


def twins(seed=0):
    """An FP32 reference and an FP16 model (FP32 LayerNorm) with the same weights."""
    torch.manual_seed(seed)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.half().float())
    half = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    half.load_state_dict(ref.state_dict())
    half[0].half()
    half[2].half()
    return ref, half


def adamw(params, **kw):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True, **kw)


def set_grads(ref, half, seed, scale):
    for i, (r, h) in enumerate(zip(ref.parameters(), half.parameters())):
        g = half_values(*r.shape, seed=1000 * seed + i)
        r.grad = g.float()
        h.grad = (g.float() * scale).to(h.dtype)


def assert_same(opt, ref, half):
    for m, r in zip(opt.master_params(), ref.parameters()):
        assert torch.equal(m.detach(), r.detach())
    for h, r in zip(half.parameters(), ref.parameters()):
        assert torch.equal(h.detach(), r.detach().to(h.dtype))


def half_masters(opt):
    return [m for m in opt.master_params() if isinstance(m, MasterParameter)]


@pytest.mark.parametrize("mode", [None, True])
def test_the_fused_step_never_stores_an_fp32_gradient(mode):
    """Unscale + step on the kernel path allocate nothing the size of a gradient (the base
    design kept an FP32 buffer per master: 4 bytes per parameter), and leave no master
    gradient behind. (With ``unscaled_model_grads=False``: by default an explicit ``unscale_``
    shows the unscaled gradients in the model, which needs them in FP32.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)).half()
    opt = MasterWeightOptimizer(adamw(model.parameters()), fused=mode, unscaled_model_grads=False)
    scaler = DynamicLossScaler(init_scale=4.0)
    for step in range(3):
        scaler.scale(model(torch.randn(4, 256).half()).float().sum()).backward()
        with torch.profiler.profile(profile_memory=True) as prof:
            scaler.unscale_(opt)
            assert all(GRAD_SLOT.__get__(m) is None for m in half_masters(opt))
            assert scaler.step(opt) is None and not scaler.last_step_skipped
            scaler.update()
        if step:  # (the first step allocates the moments)
            assert max((e.cpu_memory_usage for e in prof.events()), default=0) < 256 * 4  # a bias's worth
        names = [e.name for e in prof.events()]
        assert names.count("amp_plugin::nonfinite_check_") == 1 and names.count("amp_plugin::adam_step_") == 1
        assert all(GRAD_SLOT.__get__(m) is None for m in half_masters(opt))  # freed by the step
        assert all(p.grad is not None for p in model.parameters())  # the model's gradients stay
        opt.zero_grad()


@pytest.mark.parametrize("mode", MODES)
def test_master_grads_are_unscaled_fp32_from_unscale_to_step_then_freed(mode):
    ref, half = twins()
    opt = MasterWeightOptimizer(adamw(half.parameters()), fused=mode)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    set_grads(ref, half, 0, scaler.get_scale())
    model_grads = [(p.grad, p.grad._version) for p in half.parameters()]
    assert all(GRAD_SLOT.__get__(m) is None for m in half_masters(opt))  # nothing stored before unscale_
    scaler.unscale_(opt)
    for m, r in zip(opt.master_params(), ref.parameters()):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, r.grad)
        assert m.grad is m.grad  # one tensor, kept until the step
    for p, (g, _), m in zip(half.parameters(), model_grads, opt.master_params()):
        if p.dtype == torch.float16:  # the same tensor, showing the unscaled gradient rounded to FP16
            assert p.grad is g and torch.equal(g, m.grad.to(torch.float16))
    scaler.step(opt)
    scaler.update()
    assert all(GRAD_SLOT.__get__(m) is None for m in half_masters(opt))
    opt.zero_grad()
    assert all(m.grad is None for m in half_masters(opt))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("where", ["master_params", "param_groups"])
def test_clipping_the_masters_equals_clipping_fp32_params(mode, enabled, where):
    """``clip_grad_norm_(opt.master_params())`` (the documented recipe) and
    ``clip_grad_norm_`` over the param groups' tensors (Lightning's ``clip_gradients``, FP32
    LayerNorm included), after unscale_ or with a disabled scaler (sync_grads)."""
    ref, half = twins()
    ref_opt, opt = adamw(ref.parameters()), MasterWeightOptimizer(adamw(half.parameters()), fused=mode)
    scaler = DynamicLossScaler(init_scale=2.0**8, enabled=enabled)
    for step in range(3):
        set_grads(ref, half, step, scaler.get_scale())
        scaler.unscale_(opt)
        params = (
            opt.master_params()
            if where == "master_params"
            else [p for group in opt.param_groups for p in group["params"]]
        )
        norm = torch.nn.utils.clip_grad_norm_(params, 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert torch.equal(norm, ref_norm) and norm > 0.05  # it really clipped
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler.step(opt)
        scaler.update()
        ref_opt.step()
    assert_same(opt, ref, half)


@pytest.mark.parametrize("mode", MODES)
def test_read_and_unread_master_grads_mix_in_one_step(mode):
    """Some masters' gradients read and edited in place, one replaced, one removed, the rest
    never read: each takes effect, on every path, as on FP32 parameters."""
    ref, half = twins()
    ref_opt, opt = adamw(ref.parameters()), MasterWeightOptimizer(adamw(half.parameters()), fused=mode)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    before = half[2].bias.detach().clone()
    for step in range(3):
        set_grads(ref, half, step, scaler.get_scale())
        scaler.unscale_(opt)
        masters, refs = opt.master_params(), list(ref.parameters())
        masters[0].grad.mul_(0.5)  # read, edited in place (the first Linear's weight)
        refs[0].grad.mul_(0.5)
        masters[1].grad = torch.full_like(masters[1], 0.25)  # replaced
        refs[1].grad = torch.full_like(refs[1], 0.25)
        masters[5].grad = None  # left out of the step (the last Linear's bias)
        refs[5].grad = None
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_same(opt, ref, half)
    assert torch.equal(half[2].bias.detach(), before)


@pytest.mark.parametrize("mode", MODES)
def test_without_a_scaler_the_step_reads_the_model_grads(mode):
    """A plain loop (backward, step) and sync_grads() (read the masters' gradients first)."""
    ref, half = twins()
    ref_opt, opt = adamw(ref.parameters()), MasterWeightOptimizer(adamw(half.parameters()), fused=mode)
    for step in range(4):
        set_grads(ref, half, step, 1.0)
        if step % 2:
            opt.sync_grads()
            for m, r in zip(opt.master_params(), ref.parameters()):
                assert torch.equal(m.grad, r.grad)
        opt.step()
        ref_opt.step()
    assert_same(opt, ref, half)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_grad_changed_after_unscale_warns_and_is_used_unless_its_master_was_read(mode):
    """The documented rule with ``unscaled_model_grads=False``, the same on every path: a master
    gradient read before the change is used as read; otherwise the step reads the changed model
    gradient (still scaled)."""
    ref, half = twins()
    ref_opt = adamw(ref.parameters())
    opt = MasterWeightOptimizer(adamw(half.parameters()), fused=mode, unscaled_model_grads=False)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    set_grads(ref, half, 0, scaler.get_scale())
    scaler.unscale_(opt)
    masters, refs = opt.master_params(), list(ref.parameters())
    assert masters[0].grad is not None  # read: kept as it was
    with torch.no_grad():
        half[0].weight.grad.mul_(0.5)  # no effect: its master gradient was read
        half[2].weight.grad.mul_(0.5)  # read by the step: halves this gradient (scaled, then unscaled)
        refs[4].grad.mul_(0.5)
    with pytest.warns(MasterGradWarning, match=r"clip_grad_norm_\(optimizer.master_params\(\), max_norm\)"):
        scaler.step(opt)
    scaler.update()
    ref_opt.step()
    assert_same(opt, ref, half)


def test_a_master_parameter_copies_as_a_plain_parameter():
    import copy
    import pickle

    model = torch.nn.Linear(3, 2).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    master = opt.master_params()[0]
    assert isinstance(master, MasterParameter) and master.model_param() is model.weight
    for clone in (copy.deepcopy(master), pickle.loads(pickle.dumps(master))):
        assert type(clone) is torch.nn.Parameter and torch.equal(clone, master)
    assert repr(master).startswith("MasterParameter containing:")
