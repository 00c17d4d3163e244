"""PyTorch's GradScaler test cases (``test_grad_scaling_*`` in ``test/test_torch.py`` and
``test/test_cuda.py``, with their ``_run_scaling_case`` harness), run on the CPU against
``torch.amp.GradScaler`` (the control) and ``DynamicLossScaler`` alike.

Every case runs both scalers through the same code and the same expectations. Where our
scaler is designed to differ, the test says so and checks both behaviours (search for
"Design difference"). The last section runs the cases again with an FP16 model under
``MasterWeightOptimizer`` against an FP32 model under GradScaler: the data are FP16-exact and
each model is one linear layer under a loss linear in its output, so its gradients do not
depend on the weights and are computed exactly in FP16; the FP32 masters must then equal the
FP32 run's weights bit for bit.
"""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, StaticLossScaler


def grad_scaler(**kwargs):
    return torch.amp.GradScaler("cpu", **kwargs)


def dynamic_scaler(**kwargs):
    return DynamicLossScaler(**kwargs)


SCALERS = pytest.mark.parametrize("make_scaler", [grad_scaler, dynamic_scaler], ids=["GradScaler", "ours"])


# ---------------------------------------------------------------- the harness
def scaling_models(optimizer=torch.optim.SGD, **optimizer_kwargs):
    """A control model/optimizer and an identical one for the scaled run (upstream's pair)."""
    control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    scaling.load_state_dict(control.state_dict())
    kwargs = {"lr": 1.0, **optimizer_kwargs}
    return control, scaling, optimizer(control.parameters(), **kwargs), optimizer(scaling.parameters(), **kwargs)


def scaling_data(n=4):
    return [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(n)]


SKIP_ITER = 2


def run_scaling_case(make_scaler, run, unskipped, skipped, atol=1e-7, optimizer=torch.optim.SGD, **optimizer_kwargs):
    """Upstream's ``_run_scaling_case``: the run without scaling (skipping by hand the step
    the scaled run skips) against the scaled run, with scaling enabled and disabled."""
    for enabled in (True, False):
        torch.manual_seed(0)
        control, scaling, opt_control, opt_scaling = scaling_models(optimizer, **optimizer_kwargs)
        data, loss_fn = scaling_data(), torch.nn.MSELoss()
        # a modest scale and a large growth factor, so growth handling errors show
        scaler = make_scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(data, control, opt_control, scaler, loss_fn, False)
        scaler = run(data, scaling, opt_scaling, scaler, loss_fn, True) or scaler
        if enabled:
            expected = 128.0 * scaler.get_growth_factor() ** unskipped * scaler.get_backoff_factor() ** skipped
            assert scaler.get_scale() == expected
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(control.parameters(), scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-5)
            for key, value in opt_control.state[c].items():
                torch.testing.assert_close(value, opt_scaling.state[s][key], atol=atol, rtol=1e-5)
            torch.testing.assert_close(c, s, atol=atol, rtol=1e-5)


def inject_inf(model):
    with torch.no_grad():
        model[1].weight.grad.fill_(math.inf)


# ---------------------------------------------------------------- unscale_ and the inf check
@SCALERS
@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_grad_scaling_unscale(make_scaler, bad):
    """Contiguous, transposed (dense, not contiguous) and sliced (not dense) gradients are
    unscaled and checked, wherever the inf/NaN is."""
    g = torch.full((10, 10), 4.0)
    layouts = [lambda t: t.clone(), lambda t: t.clone().t(), lambda t: t.clone()[:, :5]]
    for where in range(len(layouts)):
        scaler = make_scaler(init_scale=4.0)
        scaler.scale(torch.ones(()))
        params = [torch.nn.Parameter(layout(torch.zeros(10, 10))) for layout in layouts]
        opt = torch.optim.SGD(params, lr=1.0)
        for i, (p, layout) in enumerate(zip(params, layouts)):
            grad = g.clone()
            if bad is not None and i == where:
                grad[2, 2] = bad
            p.grad = layout(grad)
        scaler.unscale_(opt)
        result = scaler.step(opt)
        if bad is not None:
            assert result is None
        else:
            for p in params:
                assert torch.equal(p.grad, torch.ones_like(p.grad))
        scaler.update()
        assert scaler.get_scale() == (2.0 if bad is not None else 4.0)


@SCALERS
def test_grad_scaling_unscale_fp16_gradients(make_scaler):
    """Design difference: GradScaler refuses to unscale FP16 gradients; ours unscales them in
    place (to keep FP32 precision, wrap the optimizer in MasterWeightOptimizer)."""
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.full((4,), 8.0, dtype=torch.float16)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = make_scaler(init_scale=4.0)
    scaler.scale(torch.ones(()))
    if make_scaler is grad_scaler:
        with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
            scaler.unscale_(opt)
    else:
        scaler.unscale_(opt)
        assert torch.equal(p.grad, torch.full((4,), 2.0, dtype=torch.float16))


@SCALERS
def test_grad_scaling_update_scale(make_scaler):
    scaler = make_scaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for grad in (1.0, 1.0, math.inf):  # two clean iterations, then a skipped one
        scaler.scale(torch.ones(()))
        p.grad = torch.full((2,), grad)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [4.0, 8.0, 2.0]


def sparse_grad(values, indices=((0, 1, 1), (2, 0, 2)), dtype=torch.float32):
    return torch.sparse_coo_tensor(
        torch.tensor(indices), torch.tensor(values), (2, 3), dtype=dtype, check_invariants=True
    )


@SCALERS
def test_grad_scaling_unscale_sparse(make_scaler):
    dense_ref = sparse_grad([16.0, 32.0, 64.0])
    for values, found in (([16.0, 32.0, 64.0], 0.0), ([16.0, 32.0, math.inf], 1.0), ([16.0, 32.0, math.nan], 1.0)):
        scaler = make_scaler(init_scale=4.0)
        scaler.scale(torch.ones(()))
        p = torch.nn.Parameter(torch.zeros(2, 3))
        p.grad = sparse_grad(values)
        opt = torch.optim.SGD([p], lr=0.0)
        scaler.unscale_(opt)
        scaler.step(opt)
        assert scaler._found_inf_per_device(opt)[torch.device("cpu")].item() == found
        if not found:
            assert torch.equal(p.grad.to_dense(), (dense_ref / 4).to_dense())
        scaler.update()


def test_grad_scaling_unscale_sparse_fp16_duplicates():
    """Uncoalesced FP16 duplicates whose sum (128000) overflows FP16. GradScaler coalesces in
    FP16 and reports the overflow (upstream checks this through its private
    ``_unscale_grads_(allow_fp16=True)``), and so does our scaler on a plain optimizer.
    Design difference: under MasterWeightOptimizer the duplicates are summed in FP32, so the
    master gradient is the finite true sum and nothing is skipped."""
    grad = sparse_grad([64000.0, 32.0, 64000.0], indices=((0, 1, 0), (2, 0, 2)), dtype=torch.float16)
    torch_scaler = grad_scaler(init_scale=4.0)
    torch_scaler.scale(torch.ones(()))
    p = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
    p.grad = grad.clone()
    found = torch_scaler._unscale_grads_(torch.optim.SGD([p], lr=0.0), torch.tensor(0.25), torch.zeros(()), True)
    assert found[torch.device("cpu")].item() == 1.0
    plain = torch.optim.SGD([p], lr=0.0)
    ours = DynamicLossScaler(init_scale=4.0)
    p.grad = grad.clone()
    assert ours.step(plain) is None  # the FP16 sum overflowed: skipped, as GradScaler does
    ours.update()
    q = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))
    q.grad = grad.clone()
    opt = MasterWeightOptimizer(torch.optim.SGD([q], lr=0.0))
    ours = DynamicLossScaler(init_scale=4.0)
    ours.unscale_(opt)
    master_grad = opt.master_params()[0].grad
    assert master_grad.dtype == torch.float32 and master_grad.to_dense()[0, 2].item() == 32000.0
    ours.step(opt)
    assert not ours.last_step_skipped


# ---------------------------------------------------------------- state dicts, scale(), pickling
@pytest.mark.parametrize("source", [grad_scaler, dynamic_scaler], ids=["from GradScaler", "from ours"])
@pytest.mark.parametrize("target", [grad_scaler, dynamic_scaler], ids=["into GradScaler", "into ours"])
@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(source, target, lazy_init_scale):
    s0 = source(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = target(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    if lazy_init_scale:
        s1.scale(torch.full((1,), 4.0))
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert (s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval()) == (4.0, 0.5, 2)
    assert s1.state_dict()["_growth_tracker"] == 0


@SCALERS
def test_grad_scaler_pass_itself(make_scaler):
    """Upstream's ``test_grad_scaler_pass_itself``: an optimizer whose ``step`` takes
    ``grad_scaler=`` is handed the scaler, with a ``FutureWarning`` (the deprecated protocol);
    one without it gets ``grad_scale`` and ``found_inf`` for the call, and no warning."""
    scaler = make_scaler(init_scale=2.0)
    seen = {}

    class Placeholder(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self._step_supports_amp_scaling = True

    class Optimizer1(Placeholder):
        def step(self, closure=None, *, grad_scaler=None):
            seen["given"] = grad_scaler
            seen["attrs1"] = hasattr(self, "grad_scale") or hasattr(self, "found_inf")

    class Optimizer2(Placeholder):
        def step(self, closure=None):
            seen["attrs2"] = (type(self.grad_scale), type(self.found_inf))

    x = torch.randn(4, 4)
    m = torch.nn.Linear(4, 1)
    o1, o2 = Optimizer1(m.parameters()), Optimizer2(m.parameters())
    with torch.autocast("cpu", dtype=torch.half):
        loss = m(x).mean().float()  # upstream scales the FP16 loss; ours would warn HalfLossWarning
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning, match="itself as a keyword argument"):
        scaler.step(o1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.step(o2)
    scaler.update()
    assert seen == {"given": scaler, "attrs1": False, "attrs2": (torch.Tensor, torch.Tensor)}


def test_a_static_scaler_state_dict_loads_into_grad_scaler():
    """A ``StaticLossScaler``'s state dict loads into ``torch.amp.GradScaler``, which then
    keeps the scale fixed and skips the same steps: the static run goes on there."""
    static = StaticLossScaler(scale=512.0)
    run_overflow_pattern(static, [False, True, False])
    torch_scaler = grad_scaler(init_scale=2.0)
    torch_scaler.load_state_dict(static.state_dict())
    pattern = [True, False, True, True] + [False] * 5
    assert run_overflow_pattern(torch_scaler, pattern) == run_overflow_pattern(static, pattern) == [512.0] * 9


def run_overflow_pattern(scaler, pattern):
    """Scales after each update, for an inf gradient where ``pattern`` is True."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scales = []
    for overflow in pattern:
        scaler.scale(torch.ones(()))
        p.grad = torch.full((2,), math.inf if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@SCALERS
def test_grad_scaling_scale(make_scaler):
    scaler = make_scaler(init_scale=2.0)
    t = torch.full((1,), 4.0)
    outputs = scaler.scale((t.clone(), (t.clone(), t.clone()), [t.clone(), (t.clone(), t.clone())]))
    flat = [outputs[0], outputs[1][0], outputs[1][1], outputs[2][0], outputs[2][1][0], outputs[2][1][1]]
    assert all(o.item() == 8.0 for o in flat)
    assert isinstance(outputs[1], tuple) and isinstance(outputs[2], list)


# ---------------------------------------------------------------- training cases
def autocast_run(try_pickle):
    def run(data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaled):
                loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                if i == SKIP_ITER and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()
        return scaler

    return run


@SCALERS
@pytest.mark.parametrize("try_pickle", [False, True])
@pytest.mark.parametrize("optimizer_kwargs", [{}, {"foreach": True}], ids=["for-loop", "foreach"])
def test_grad_scaling_autocast(make_scaler, try_pickle, optimizer_kwargs):
    """Scaling + float16 autocast against neither (atol 1e-3: FP16 arithmetic against FP32).
    Upstream runs Adam/AdamW here too and expects them to fail this comparison; SGD only."""
    run_scaling_case(make_scaler, autocast_run(try_pickle), unskipped=3, skipped=1, atol=1e-3, **optimizer_kwargs)


@SCALERS
def test_grad_scaling_clipping(make_scaler):
    """Clip the still-scaled gradients with a threshold scaled the same way."""
    max_norm = 0.2

    def run(data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == SKIP_ITER and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-5)


@SCALERS
def test_grad_scaling_clipping_separate_unscale(make_scaler):
    max_norm = 0.2

    def run(data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                if i == SKIP_ITER and scaler.is_enabled():
                    inject_inf(model)
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


@SCALERS
def test_grad_scaling_penalty(make_scaler):
    """A gradient penalty: ``autograd.grad`` of the scaled loss, unscaled by hand."""

    def run(data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
                grads = [g * (1.0 / scaler.get_scale()) for g in grads]
            else:
                grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            loss = loss + sum(g.pow(2).sum() for g in grads).sqrt()
            if scaled:
                scaler.scale(loss).backward()
                if i == SKIP_ITER and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != SKIP_ITER:
                    optimizer.step()

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


@SCALERS
def test_grad_scaling_accumulation(make_scaler):
    def run(data, model, optimizer, scaler, loss_fn, scaled):
        for i, (x, y) in enumerate(data):
            loss = loss_fn(model(x), y) / 2
            (scaler.scale(loss) if scaled else loss).backward()
            if (i + 1) % 2 == 0:
                if scaled:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(make_scaler, run, unskipped=2, skipped=0)


@SCALERS
def test_grad_scaling_multiple(make_scaler):
    """Two models, two optimizers, two losses through both models; one optimizer unscaled
    separately; one update per iteration."""
    for enabled in (True, False):
        torch.manual_seed(0)
        control0, scaling0, opt_control0, opt_scaling0 = scaling_models()
        control1, scaling1, opt_control1, opt_scaling1 = scaling_models()
        data, loss_fn = scaling_data(), torch.nn.MSELoss()
        scaler = make_scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        def run(model0, model1, opt0, opt1, scaled, data=data, loss_fn=loss_fn, scaler=scaler):
            for i, (x, y) in enumerate(data):
                opt0.zero_grad()
                opt1.zero_grad()
                out0, out1 = model0(x), model1(x)
                loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
                loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
                if scaled:
                    scaler.scale(loss0).backward(retain_graph=True)
                    scaler.scale(loss1).backward()
                    if i == SKIP_ITER and scaler.is_enabled():
                        inject_inf(model1)
                    scaler.unscale_(opt0)
                    scaler.step(opt0)
                    scaler.step(opt1)
                    scaler.update()
                else:
                    loss0.backward(retain_graph=True)
                    loss1.backward()
                    opt0.step()
                    if not scaler.is_enabled() or i != SKIP_ITER:
                        opt1.step()

        run(control0, control1, opt_control0, opt_control1, False)
        run(scaling0, scaling1, opt_scaling0, opt_scaling1, True)
        expected = 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() if enabled else 1.0
        assert scaler.get_scale() == expected
        for c, s in zip(
            [*control0.parameters(), *control1.parameters()], [*scaling0.parameters(), *scaling1.parameters()]
        ):
            torch.testing.assert_close(c, s, atol=1e-7, rtol=1e-5)


@SCALERS
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("separate_unscale", [False, True])
def test_grad_scaling_autocast_fused_optimizers(make_scaler, optimizer, amsgrad, separate_unscale):
    """A fused Adam takes the scale itself (``_step_supports_amp_scaling``) and unscales
    inside its kernel; the for-loop one is unscaled by the scaler. Same results."""
    torch.manual_seed(0)
    control, scaling, _, opt_scaling = scaling_models(optimizer, fused=True, amsgrad=amsgrad)
    opt_control = optimizer(control.parameters(), lr=1.0, fused=False, amsgrad=amsgrad)
    data, loss_fn = scaling_data(), torch.nn.MSELoss()
    scaler = make_scaler(init_scale=128.0)
    for x, y in data:
        for model, opt, separate in ((control, opt_control, False), (scaling, opt_scaling, separate_unscale)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            if separate:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        for c, s in zip(control.parameters(), scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad)
            torch.testing.assert_close(c, s)
            for key, value in opt_control.state[c].items():
                torch.testing.assert_close(value, opt_scaling.state[s][key].reshape(value.shape))


@SCALERS
@pytest.mark.parametrize(
    "optimizer_kwargs", [{"foreach": False}, {"foreach": True}, {"fused": True}], ids=["for-loop", "foreach", "fused"]
)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(make_scaler, optimizer_kwargs):
    """The inf check happens at unscale_: gradients broken after it are stepped with."""
    torch.manual_seed(0)
    model = scaling_models(torch.optim.Adam, **optimizer_kwargs)[1]
    opt = torch.optim.Adam(model.parameters(), lr=1.0, **optimizer_kwargs)
    scaler = make_scaler(init_scale=128.0)
    for x, y in scaling_data():
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        for j, p in enumerate(model.parameters()):
            p.grad.copy_(torch.full_like(p.grad, math.inf if j % 2 else math.nan))
        scaler.step(opt)
        scaler.update()
    assert all(not torch.isfinite(p).all() for p in model.parameters())


@SCALERS
def test_grad_scale_will_not_overflow(make_scaler):
    """Design difference: ours requires every scale to lie in [min_scale, max_scale], 2**24
    by default, so an init_scale of 1e38 needs max_scale raised."""
    kwargs = dict(growth_interval=1, growth_factor=2.0**4, init_scale=1e38)
    if make_scaler is dynamic_scaler:
        with pytest.raises(ValueError, match="init_scale must lie in"):
            make_scaler(**kwargs)
        kwargs["max_scale"] = torch.finfo(torch.float32).max
    scaler = make_scaler(**kwargs)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters())
    loss = ((model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert math.isfinite(scaler.get_scale()) and scaler.get_scale() == pytest.approx(1e38, rel=1e-6)


# ---------------------------------------------------------------- API behaviours around the cases
@SCALERS
def test_step_returns_none_on_a_skip_and_rejects_closures(make_scaler):
    """Both scalers return ``None`` from a skipped step and refuse a closure."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = make_scaler(init_scale=2.0)
    scaler.scale(torch.ones(()))
    p.grad = torch.full((2,), math.inf)
    assert scaler.step(opt) is None
    scaler.update()
    with pytest.raises(RuntimeError, match="Closure use is not"):
        scaler.step(opt, closure=lambda: 0.0)


@pytest.mark.parametrize("scaler_class", [DynamicLossScaler, StaticLossScaler])
@pytest.mark.parametrize("earlier_backward", [False, True])
def test_a_closure_passed_by_position_is_refused_as_one_by_name(scaler_class, earlier_backward):
    """``scaler.step(opt, closure)``: the closure would run inside ``opt.step()``, after the unscale and the inf
    check, so its backward's scaled gradients were stepped (65536 times the update at the default scale),
    with or without gradients of an earlier backward. Refused, as a closure given by name is (torch's
    GradScaler fails too: "No inf checks were recorded"), and nothing changes."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = scaler_class(2.0**16) if scaler_class is StaticLossScaler else scaler_class()
    if earlier_backward:
        scaler.scale((p * 2).sum()).backward()

    def closure():
        opt.zero_grad()
        loss = scaler.scale((p * 2).sum())
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="Closure use is not supported"):
        scaler.step(opt, closure)
    assert torch.equal(p.detach(), torch.ones(3))


@SCALERS
def test_update_with_a_new_scale(make_scaler):
    """Both set a manual scale. Design difference: ours requires it to lie in
    [min_scale, max_scale] (GradScaler takes any float, even inf)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = make_scaler(init_scale=2.0)
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(2)
    scaler.step(opt)
    scaler.update(new_scale=64.0)
    assert scaler.get_scale() == 64.0
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(2)
    scaler.step(opt)
    if make_scaler is grad_scaler:
        scaler.update(new_scale=math.inf)
        assert scaler.get_scale() == math.inf
    else:
        with pytest.raises(ValueError, match="new_scale"):
            scaler.update(new_scale=math.inf)
        scaler.update(torch.tensor(32.0))
        assert scaler.get_scale() == 32.0


@SCALERS
def test_unscale_before_any_scale_call(make_scaler):
    """Design difference: GradScaler creates its scale tensor in ``scale()`` and asserts in
    ``unscale_``/``step`` without it; ours holds the scale from the start."""
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.full((2,), 4.0)
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = make_scaler(init_scale=4.0)
    if make_scaler is grad_scaler:
        with pytest.raises(AssertionError, match="_scale is None"):
            scaler.unscale_(opt)
    else:
        scaler.unscale_(opt)
        assert torch.equal(p.grad, torch.ones(2))


# ---------------------------------------------------------------- the same cases with FP16 + master weights
def exact_data(n=4, seed=0):
    """FP16-exact inputs and output weights: multiples of 1/4 in [-1, 1], so every gradient
    (a sum of 8 products, scaled by a power of two) needs at most 9 significant bits."""
    g = torch.Generator().manual_seed(seed)
    return [
        ((torch.randint(-4, 5, (8, 8), generator=g) / 4.0), (torch.randint(-4, 5, (8, 8), generator=g) / 4.0))
        for _ in range(n)
    ]


def exact_pair(optimizer, n_models=1, **optimizer_kwargs):
    """An FP32 model (GradScaler's run) and its FP16 copy under MasterWeightOptimizer."""
    pairs = []
    for _ in range(n_models):
        fp32 = torch.nn.Sequential(torch.nn.Linear(8, 8))
        with torch.no_grad():
            for p in fp32.parameters():
                p.copy_(p.half().float())
        half = torch.nn.Sequential(torch.nn.Linear(8, 8)).half()
        with torch.no_grad():
            for h, f in zip(half.parameters(), fp32.parameters()):
                h.copy_(f)
        kwargs = {"lr": 0.5, **optimizer_kwargs}
        pairs.append(
            (
                fp32,
                half,
                optimizer(fp32.parameters(), **kwargs),
                MasterWeightOptimizer(optimizer(half.parameters(), **kwargs)),
            )
        )
    return pairs


def linear_loss(model, x, w):
    """Linear in the output: the weight gradient is ``w.T @ x``, exact in FP16 for this data."""
    out = model(x.to(next(model.parameters()).dtype))
    return (out.float() * w).sum() / 64


def run_exact(make_case, unskipped, skipped, optimizer=torch.optim.SGD, n_models=1, exact=True, **optimizer_kwargs):
    torch.manual_seed(0)
    pairs = exact_pair(optimizer, n_models, **optimizer_kwargs)
    data = exact_data()
    runs = {}
    for side in ("fp32", "half"):
        scaler = (grad_scaler if side == "fp32" else dynamic_scaler)(
            init_scale=128.0, growth_factor=2.0, growth_interval=1
        )
        models = [p[0] if side == "fp32" else p[1] for p in pairs]
        opts = [p[2] if side == "fp32" else p[3] for p in pairs]
        make_case(data, models, opts, scaler, side == "half")
        runs[side] = scaler.get_scale()
    assert runs["fp32"] == runs["half"] == 128.0 * 2.0**unskipped * 0.5**skipped
    for fp32, half, _, opt in pairs:
        for master, ref, h in zip(opt.master_params(), fp32.parameters(), half.parameters()):
            if exact:
                assert torch.equal(master, ref.detach())
                assert torch.equal(h.detach(), ref.detach().half())
            else:
                torch.testing.assert_close(master, ref.detach(), rtol=1e-3, atol=1e-4)
            assert torch.equal(h.detach(), master.detach().half())


@pytest.mark.parametrize(
    "optimizer,kwargs",
    [
        (torch.optim.SGD, {}),
        (torch.optim.SGD, {"momentum": 0.9}),
        (torch.optim.AdamW, {"fused": True}),
        (torch.optim.Adam, {"foreach": True}),
    ],
    ids=["sgd", "sgd_momentum", "adamw_fused", "adam_foreach"],
)
def test_masters_equal_the_fp32_grad_scaler_run_plain(optimizer, kwargs):
    def case(data, models, opts, scaler, half):
        (model,), (opt,) = models, opts
        for i, (x, w) in enumerate(data):
            opt.zero_grad()
            scaler.scale(linear_loss(model, x, w)).backward()
            if i == SKIP_ITER:
                with torch.no_grad():
                    model[0].weight.grad.fill_(math.inf)
            scaler.step(opt)
            scaler.update()

    run_exact(case, unskipped=3, skipped=1, optimizer=optimizer, **kwargs)


def test_masters_equal_the_fp32_grad_scaler_run_clipping_separate_unscale():
    """Design difference: with master weights, clip ``opt.master_params()`` (the gradients
    the step uses), not ``model.parameters()``."""

    def case(data, models, opts, scaler, half):
        (model,), (opt,) = models, opts
        for i, (x, w) in enumerate(data):
            opt.zero_grad()
            scaler.scale(linear_loss(model, x, w)).backward()
            if i == SKIP_ITER:
                with torch.no_grad():
                    model[0].weight.grad.fill_(math.inf)
            scaler.unscale_(opt)
            params = opt.master_params() if half else model.parameters()
            torch.nn.utils.clip_grad_norm_(params, 0.2, error_if_nonfinite=False)
            scaler.step(opt)
            scaler.update()

    run_exact(case, unskipped=3, skipped=1)


def test_masters_follow_the_fp32_grad_scaler_run_clipping_scaled_grads():
    """Clipping the still-scaled gradients works with master weights (the step unscales what
    the clip left). Not bit for bit: the clip itself computes its norm and coefficient in FP16
    on the half model's gradients."""

    def case(data, models, opts, scaler, half):
        (model,), (opt,) = models, opts
        for x, w in data:
            opt.zero_grad()
            scaler.scale(linear_loss(model, x, w)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25 * scaler.get_scale())
            scaler.step(opt)
            scaler.update()

    run_exact(case, unskipped=4, skipped=0, exact=False)


def test_masters_equal_the_fp32_grad_scaler_run_accumulation():
    def case(data, models, opts, scaler, half):
        (model,), (opt,) = models, opts
        for i, (x, w) in enumerate(data):
            scaler.scale(linear_loss(model, x, w) / 2).backward()
            if (i + 1) % 2 == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()

    run_exact(case, unskipped=2, skipped=0)


def test_masters_equal_the_fp32_grad_scaler_run_multiple():
    def case(data, models, opts, scaler, half):
        (model0, model1), (opt0, opt1) = models, opts
        for i, (x, w) in enumerate(data):
            opt0.zero_grad()
            opt1.zero_grad()
            # accumulated in FP16 over two backward passes: sums chosen to stay exact
            loss0 = linear_loss(model0, x, w) + linear_loss(model1, x, w) / 2
            loss1 = linear_loss(model0, x, -w) / 2 + linear_loss(model1, x, w)
            scaler.scale(loss0).backward()
            scaler.scale(loss1).backward()
            if i == SKIP_ITER:
                with torch.no_grad():
                    model1[0].weight.grad.fill_(math.inf)
            scaler.unscale_(opt0)
            scaler.step(opt0)
            scaler.step(opt1)
            scaler.update()

    run_exact(case, unskipped=3, skipped=1, n_models=2)
