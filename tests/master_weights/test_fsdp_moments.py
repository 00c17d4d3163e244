"""``Bf16MomentsAdam``: BF16 Adam moments for FP32 parameters (what ``bf16_lean``/``bf16_sr`` use
under FSDP2), against ``MasterWeightOptimizer(moments_dtype=torch.bfloat16)`` and an oracle."""

from __future__ import annotations

import warnings

import pytest
import torch
from _moments_oracle import MomentStore

from amp_plugin import MasterWeightOptimizer
from amp_plugin.fsdp_moments import Bf16MomentsAdam
from amp_plugin.master_weights import FrozenMomentWarning

BF16 = torch.bfloat16


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    # BF16-representable values, so that MasterWeightOptimizer's masters (upcast BF16 weights) start equal
    return [torch.randn(shape, generator=g).to(BF16).float() for shape in ((24, 16), (24,), (5, 24))]


def grad(step, i, shape):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i)) * 1e-2).to(BF16).float()


def oracle(values, steps, opt_class, seed=None, **hyper):
    """torch's fused kernel on FP32 copies; BF16 moments: upcast for each step, rounded after it
    (stochastically with ``seed``'s keys, to nearest without)."""
    kernel = torch._fused_adamw_ if opt_class is torch.optim.AdamW else torch._fused_adam_
    params = [v.clone() for v in values]
    state = [(torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())) for p in params]
    store = MomentStore(seed)
    for step in range(steps):
        store.next_step(len(params))
        for i, (p, (m, v, t)) in enumerate(zip(params, state)):
            t += 1
            kernel(
                [p], [grad(step, i, p.shape)], [m], [v], [], [t], amsgrad=False, lr=hyper["lr"], beta1=0.9,
                beta2=0.999, weight_decay=hyper["weight_decay"], eps=1e-8, maximize=False, grad_scale=None,
                found_inf=None,
            )  # fmt: skip
            store.store(m, v, i)
    return params


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("opt_class", [torch.optim.AdamW, torch.optim.Adam])
def test_bf16_moments_of_fp32_parameters_equal_master_weight_optimizer_bit_for_bit(opt_class, rounding):
    hyper = dict(lr=1e-2, weight_decay=0.1)
    seeds = dict(sr_seed=11) if rounding == "stochastic" else {}
    params = [torch.nn.Parameter(v) for v in weights()]
    inner = opt_class(params, **hyper)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)  # built before the wrapper, as in Lightning
    halves = [torch.nn.Parameter(v.to(BF16)) for v in weights()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FrozenMomentWarning)
        opt = Bf16MomentsAdam(inner, moments_rounding=rounding, **seeds)
        ref = MasterWeightOptimizer(opt_class(halves, **hyper), moments_dtype=BF16, moments_rounding=rounding, **seeds)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    for step in range(5):
        for i, (p, h) in enumerate(zip(params, halves)):
            p.grad = grad(step, i, p.shape)
            h.grad = p.grad.to(BF16)
        opt.step()
        ref.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
            sched.step()
        ref_sched.step()
    for ours, theirs in zip(params, ref.fp32_masters()):
        assert torch.equal(ours, theirs)
    for p, h in zip(params, ref.master_params()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][key].dtype is BF16 and torch.equal(opt.state[p][key], ref.state[h][key])
    assert opt.param_groups[0]["lr"] == 1e-2 * 0.5**5


def test_bf16_moments_give_the_oracle_and_resume_bit_for_bit():
    hyper = dict(lr=1e-2, weight_decay=0.1)

    def build():
        params = [torch.nn.Parameter(v) for v in weights()]
        return params, Bf16MomentsAdam(torch.optim.AdamW(params, **hyper), sr_seed=4)

    def run(params, opt, steps):
        for step in steps:
            for i, p in enumerate(params):
                p.grad = grad(step, i, p.shape)
            opt.step()

    params, opt = build()
    run(params, opt, range(6))
    for ours, ref in zip(params, oracle(weights(), 6, torch.optim.AdamW, seed=4, **hyper)):
        assert torch.equal(ours, ref)
    half, saved = build()
    run(half, saved, range(3))
    state = saved.state_dict()
    resumed_params, resumed = build()
    with torch.no_grad():
        for p, q in zip(resumed_params, half):
            p.copy_(q)
    resumed.load_state_dict(state)  # torch's load casts the moments to FP32: stored in BF16 again
    assert all(s["exp_avg"].dtype is BF16 and s["exp_avg_sq"].dtype is BF16 for s in resumed.state.values())
    run(resumed_params, resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(params, resumed_params))


def test_fp32_moments_where_asked_and_non_fp32_parameters_refused():
    params = [torch.nn.Parameter(v) for v in weights()]
    opt = Bf16MomentsAdam(torch.optim.Adam(params), bf16_params=params[:1])
    calls = []
    opt.optimizer.register_step_post_hook(lambda o, args, kwargs: calls.append(o))
    for i, p in enumerate(params):
        p.grad = grad(0, i, p.shape)
    opt.step()
    assert [opt.state[p]["exp_avg"].dtype for p in params] == [BF16, torch.float32, torch.float32]
    assert len(calls) == 1  # the wrapped optimizer's step hooks run
    with pytest.raises(ValueError, match=r"a parameter of shape \(2,\) is torch.bfloat16, not FP32"):
        Bf16MomentsAdam(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, dtype=BF16))], lr=0.1))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    ],
    ids=["sgd", "rmsprop", "adamw_foreach", "adam_amsgrad"],
)
def test_any_optimizer_keeps_bf16_state_as_master_weight_optimizer_does_bit_for_bit(make):
    """Optimizers torch's fused Adam rule cannot run take their own step, with their per-element
    state in BF16: the same bits as MasterWeightOptimizer's general path with the same seed, and
    the wrapped optimizer's step hooks run once per step."""
    params = [torch.nn.Parameter(v) for v in weights()]
    inner = make(params)
    calls = []
    inner.register_step_post_hook(lambda o, args, kwargs: calls.append(1))
    opt = Bf16MomentsAdam(inner, sr_seed=6)
    halves = [torch.nn.Parameter(v.to(BF16)) for v in weights()]
    ref = MasterWeightOptimizer(make(halves), moments_dtype=BF16, sr_seed=6)
    for step in range(5):
        for i, (p, h) in enumerate(zip(params, halves)):
            p.grad = grad(step, i, p.shape)
            h.grad = p.grad.to(BF16)
        opt.step()
        ref.step()
    assert calls == [1] * 5
    for ours, theirs, master in zip(params, ref.fp32_masters(), ref.master_params()):
        assert torch.equal(ours, theirs)
        for key, value in opt.state[ours].items():
            if torch.is_tensor(value) and value.dim() > 0:
                assert value.dtype is BF16 and torch.equal(value, ref.state[master][key]), key


def test_a_plain_adam_state_dict_keeps_the_rounding_seed_and_counter():
    params = [torch.nn.Parameter(v) for v in weights()]
    opt = Bf16MomentsAdam(torch.optim.AdamW(params), sr_seed=9)
    for i, p in enumerate(params):
        p.grad = grad(0, i, p.shape)
    opt.step()
    assert (opt.param_groups[0]["sr_seed"], opt.param_groups[0]["sr_counter"]) == (9, 1)
    plain = torch.optim.AdamW([torch.nn.Parameter(v) for v in weights()])
    opt.load_state_dict(plain.state_dict())  # saved without a seed: this optimizer's stays
    assert (opt.param_groups[0]["sr_seed"], opt.param_groups[0]["sr_counter"]) == (9, 1)


def test_rounding_to_nearest_warns_where_it_freezes_a_moment():
    params = [torch.nn.Parameter(v) for v in weights()]
    with pytest.warns(
        FrozenMomentWarning, match=r"beta2=0.999.*1 - 2\*\*-9 = 0.998046875.*moments_rounding='stochastic'"
    ):
        Bf16MomentsAdam(torch.optim.AdamW(params), moments_rounding="nearest")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FrozenMomentWarning)
        Bf16MomentsAdam(torch.optim.AdamW(params, betas=(0.9, 0.99)), moments_rounding="nearest")
    with pytest.raises(ValueError, match="moments_rounding='up' is not allowed.*'stochastic'.*'nearest'"):
        Bf16MomentsAdam(torch.optim.AdamW(params), moments_rounding="up")
