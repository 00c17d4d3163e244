"""FP32 master weights: tiny updates survive, grads are unscaled into FP32, state round-trips."""

from __future__ import annotations

import math

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, StaticLossScaler

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
    "adam_forloop": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=False),
}


GRAD_SLOT = torch._C.TensorBase.grad  # a master's own slot, under its grad property


def test_tiny_updates_survive_only_through_master():
    lone = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    plain = torch.optim.SGD([lone], lr=1e-4)
    wrapped_param = torch.nn.Parameter(torch.ones(1, dtype=torch.float16))
    wrapped = MasterWeightOptimizer(torch.optim.SGD([wrapped_param], lr=1e-4))
    for _ in range(100):
        for p, opt in ((lone, plain), (wrapped_param, wrapped)):
            p.grad = torch.ones(1, dtype=torch.float16)
            opt.step()
            opt.zero_grad()
    assert lone.item() == 1.0  # every update was below half an ulp of 1.0 in FP16
    master = wrapped.master_params()[0]
    assert master.dtype == torch.float32
    assert master.item() == pytest.approx(0.99, abs=1e-5)
    assert wrapped_param.dtype == torch.float16
    assert torch.equal(wrapped_param.detach(), master.detach().half())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_masters_follow_the_fp32_optimizer_exactly(name):
    """Given the same (FP16-representable) gradients, the masters equal an FP32 run bit for bit."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 4).half().float()  # FP16-representable start
    half = torch.nn.Linear(6, 4)
    half.load_state_dict(ref.state_dict())
    half.half()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    opt = MasterWeightOptimizer(OPTIMIZERS[name](half.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for _ in range(6):
        grads = [torch.randn_like(p).half() for p in ref.parameters()]
        for p, g in zip(ref.parameters(), grads):
            p.grad = g.float()
        for p, g in zip(half.parameters(), grads):
            p.grad = g
        ref_opt.step()
        opt.step()
        sched.step()
        ref_sched.step()
        opt.zero_grad()
    for m, r, h in zip(opt.master_params(), ref.parameters(), half.parameters()):
        assert torch.equal(m, r.detach())
        assert torch.equal(h.detach(), r.detach().half())
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def test_scaler_unscales_half_grads_into_fp32_master_grads():
    model = torch.nn.Linear(3, 2).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = DynamicLossScaler(init_scale=2.0**12)
    scaler.scale(model(torch.randn(4, 3).half()).float().sum()).backward()
    half_grads = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)  # no "Attempting to unscale FP16 gradients"
    for master, g in zip(opt.master_params(), half_grads):
        assert master.grad.dtype == torch.float32
        assert torch.equal(master.grad, g.float() * 2.0**-12)
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())


def test_half_grad_overflow_is_found_and_nothing_is_copied():
    model = torch.nn.Linear(3, 2).half()
    opt = MasterWeightOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    scaler = StaticLossScaler(2.0)
    before = [p.detach().clone() for p in model.parameters()]
    masters_before = [m.detach().clone() for m in opt.master_params()]
    scaler.scale(model(torch.randn(4, 3).half()).float().sum()).backward()
    model.weight.grad[0, 0] = math.inf  # as FP16 overflow produces
    assert scaler.step(opt) is None
    scaler.update()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    for m, b in zip(opt.master_params(), masters_before):
        assert torch.equal(m, b)
    assert len(opt.state) == 0


def test_norm_params_kept_in_fp32_are_their_own_master():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3).half(), torch.nn.LayerNorm(3))
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    masters, params = opt.master_params(), list(model.parameters())
    assert [m is p for m, p in zip(masters, params)] == [False, False, True, True]
    assert all(m.dtype == torch.float32 for m in masters)


def test_small_gradients_underflow_without_scaling_and_match_fp32_with_it():
    """Gradients around 1e-7: FP16 flushes most to zero unless the loss is scaled."""
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    ref = torch.nn.Linear(32, 1, bias=False)
    w0 = ref.weight.detach().half().float()
    ref.weight.data.copy_(w0)

    def loss_fn(model, dtype):
        return (model(x.to(dtype)).float() * 1e-7).pow(2).sum() * 2e5  # grads ~ 1e-7 per element

    loss_fn(ref, torch.float32).backward()
    fp32_grad = ref.weight.grad.clone()
    assert 1e-9 < fp32_grad.abs().median().item() < 1e-6

    results = {}
    for scaler in (StaticLossScaler(1.0), DynamicLossScaler()):
        model = torch.nn.Linear(32, 1, bias=False).half()
        model.weight.data.copy_(w0)
        opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        scaler.scale(loss_fn(model, torch.float16)).backward()
        scaler.unscale_(opt)
        results[type(scaler).__name__] = opt.master_params()[0].grad.clone()
    unscaled = results["StaticLossScaler"]
    assert (unscaled == 0).float().mean().item() > 0.5
    scaled = results["DynamicLossScaler"]
    assert torch.linalg.vector_norm(scaled - fp32_grad) / torch.linalg.vector_norm(fp32_grad) < 0.01


@pytest.mark.parametrize("name", ["adamw_fused", "sgd"])
def test_state_dict_round_trip_continues_exactly(name):
    torch.manual_seed(0)
    grads = [[torch.randn(4, 3).half(), torch.randn(4).half()] for _ in range(6)]

    def make():
        torch.manual_seed(1)
        model = torch.nn.Linear(3, 4).half()
        return model, MasterWeightOptimizer(OPTIMIZERS[name](model.parameters()))

    def run(model, opt, steps):
        for gs in steps:
            for p, g in zip(model.parameters(), gs):
                p.grad = g
            opt.step()
            opt.zero_grad()

    model, opt = make()
    run(model, opt, grads)
    model2, opt2 = make()
    run(model2, opt2, grads[:3])
    saved_model, saved_opt = model2.state_dict(), opt2.state_dict()
    assert len(saved_opt["master_params"]) == 2
    model3, opt3 = make()
    model3.load_state_dict(saved_model)
    opt3.load_state_dict(saved_opt)
    run(model3, opt3, grads[3:])
    for a, b in zip(opt.master_params(), opt3.master_params()):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model3.parameters()):
        assert torch.equal(a, b)


def test_loads_a_plain_optimizer_state_dict():
    model = torch.nn.Linear(2, 2).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.7)
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["lr"] == 0.7
    assert torch.equal(opt.master_params()[0].half(), model.weight.detach())


def trained(master, seed, shapes=((4, 8), (8,), (2, 4), (2,))):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in shapes]
    opt = MasterWeightOptimizer(
        torch.optim.AdamW(params, lr=1e-2, fused=True),
        master=master,
        moments_dtype=torch.bfloat16 if master != "fp32" else None,
        sr_seed=1 if master == "stochastic" else None,
    )
    for p in params:
        p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    opt.zero_grad()
    return params, opt


def everything(params, opt):
    state = [t for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    return [t.clone() for t in [*params, *opt.fp32_masters(), *state]] + [opt.param_groups[0]["lr"]]


def unchanged(before, after):
    return all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(before, after, strict=True))


BAD_STATE_DICTS = {
    "a master of the wrong shape": (
        lambda sd: sd["master_params"].__setitem__(3, torch.zeros(3)),
        r"master_params\[3\] is shape \(3,\) torch.float32 but the half-precision parameter .* has shape \(2,\)",
    ),
    "a master transposed": (
        lambda sd: sd["master_params"].__setitem__(0, sd["master_params"][0].t()),
        r"master_params\[0\] is shape \(8, 4\)",
    ),
    "a master that is not a tensor": (
        lambda sd: sd["master_params"].__setitem__(1, [0.0] * 8),
        r"master_params\[1\] is list",
    ),
    "one master too few": (lambda sd: sd["master_params"].pop(), r"master_params has 3 tensors .* 4 half-precision"),
    "an unknown master kind": (
        lambda sd: sd.__setitem__("master_kind", "nonsense"),
        r"master_kind='nonsense' is not allowed: it must be one of \['bf16_split', 'fp32', 'stochastic'\]",
    ),
    "a generator without its counter": (
        lambda sd: sd["sr_generator"].pop("counter"),
        r"sr_generator=\{'seed': 1\} is not allowed: it must be a dict with the integers 'seed' and 'counter'",
    ),
    "a generator with a negative counter": (
        lambda sd: sd["sr_generator"].__setitem__("counter", -1),
        r"sr_generator=.* is not allowed",
    ),
    "a group of another size (torch's own check)": (
        lambda sd: sd["param_groups"][0]["params"].pop(),
        r"doesn't match the size of optimizer's group",
    ),
}


@pytest.mark.parametrize(
    ("master", "bad"),
    [  # only a kind that rounds stochastically keeps an sr_generator
        (master, bad)
        for master in ("fp32", "bf16_split", "stochastic")
        for bad in BAD_STATE_DICTS
        if master == "stochastic" or "generator" not in bad
    ],
)
def test_a_state_dict_that_does_not_fit_is_refused_by_name_and_loads_nothing(master, bad):
    """A checkpoint of another model (same count of tensors, other shapes) or a damaged one: one
    ``ValueError`` that names the key, and the weights, masters, moments and groups as they were. The
    masters were checked only by count: torch's ``load_state_dict`` and the moments went in, then a raw
    size error came from the copy of the masters, half of them loaded."""
    edit, message = BAD_STATE_DICTS[bad]
    params, opt = trained(master, seed=0)
    other = trained(master, seed=1)[1].state_dict()
    other["param_groups"][0]["lr"] = 0.5
    edit(other)
    before = everything(params, opt)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(other)
    assert unchanged(before, everything(params, opt))
    opt.load_state_dict(trained(master, seed=1)[1].state_dict())  # a good one still loads
    assert not unchanged(before, everything(params, opt))


def test_existing_state_moves_to_the_masters():
    model = torch.nn.Linear(2, 2).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    inner.step()
    opt = MasterWeightOptimizer(inner)
    assert all(state["momentum_buffer"].dtype == torch.float32 for state in opt.state.values())
    assert set(map(id, opt.state)) == set(map(id, opt.master_params()))


def test_rejects_non_optimizers_and_double_wrapping():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        MasterWeightOptimizer([torch.zeros(1)])
    opt = MasterWeightOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1).half())], lr=0.1))
    with pytest.raises(TypeError, match="already"):
        MasterWeightOptimizer(opt)


def test_master_grads_exist_from_sync_to_step_and_zero_grad_clears_the_model_grads():
    """A master's gradient is made when read between sync_grads()/unscale_ and the step, is
    the same tensor on every read, and is freed by the step; the model keeps its own."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3).half(), torch.nn.LayerNorm(3))
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 3, dtype=torch.float16)
    for _ in range(2):
        model(x).float().sum().backward()
        masters = opt.master_params()
        assert GRAD_SLOT.__get__(masters[0]) is None  # nothing stored before it is read
        opt.sync_grads()
        first = masters[0].grad
        assert first is masters[0].grad and torch.equal(first, model[0].weight.grad.float())
        opt.step()
        assert GRAD_SLOT.__get__(masters[0]) is None and GRAD_SLOT.__get__(masters[1]) is None  # freed
        assert masters[2].grad is model[1].weight.grad  # an FP32 parameter is its own master
        assert all(p.grad is not None for p in model.parameters())
        opt.zero_grad()
        assert all(p.grad is None for p in list(model.parameters()) + opt.master_params())
    model(x).float().sum().backward()
    opt.sync_grads()
    assert opt.master_params()[0].grad is not None
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert p.grad is not None and not p.grad.any() and not p.grad.requires_grad
    assert GRAD_SLOT.__get__(opt.master_params()[0]) is None  # dropped; a read gives the zeroed gradient
    assert not opt.master_params()[0].grad.any()


def test_a_parameter_without_a_gradient_is_left_alone():
    a, b = torch.nn.Linear(3, 3).half(), torch.nn.Linear(3, 3).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1))
    before = [p.detach().clone() for p in b.parameters()]
    a(torch.randn(2, 3, dtype=torch.float16)).float().sum().backward()
    opt.sync_grads()
    masters = opt.master_params()
    assert [m.grad is None for m in masters] == [False, False, True, True]
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before))
