"""The GradScaler interface: skip semantics, stages, several optimizers, the static scaler."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from amp_plugin import DynamicLossScaler, HalfLossWarning, StaticLossScaler

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny


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


# ---------------------------------------------------------------- float16 losses
@pytest.mark.parametrize("shape", [(), (4,)])
def test_a_float16_loss_warns_once_and_is_scaled_exactly_like_grad_scaler(shape):
    loss = torch.full(shape, 3.0, dtype=torch.float16)
    ours, theirs = DynamicLossScaler(init_scale=2.0**4), torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with pytest.warns(HalfLossWarning, match=r"float16 loss.*scaler.scale\(loss.float\(\)\)"):
        scaled = ours.scale(loss)
    expected = theirs.scale(loss)
    # GradScaler's product: a 0-dim float16 loss promotes to float32, a batch of losses stays float16
    assert scaled.dtype == expected.dtype == (torch.float32 if shape == () else torch.float16)
    assert torch.equal(scaled, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.scale(loss)  # once per scaler
        ours.scale(loss.float())
        DynamicLossScaler().scale(torch.tensor(3.0, dtype=torch.bfloat16))  # bf16 has float32's range
        DynamicLossScaler(enabled=False).scale(loss)
    with pytest.warns(HalfLossWarning):
        StaticLossScaler(4.0).scale([torch.ones(2), (loss,)])


def test_why_a_float16_loss_is_a_problem():
    """Even a 0-dim float16 loss, whose product is float32, sends the scale into its backward
    pass in float16: at the default 2**16 that is inf."""
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float16))
    with pytest.warns(HalfLossWarning):
        DynamicLossScaler().scale((w * 1e-3).sum()).backward()
    assert torch.isinf(w.grad).all()


# ---------------------------------------------------------------- GradScaler's getters and setters
def test_grad_scaler_getters_and_setters():
    kwargs = dict(init_scale=8.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    ours, theirs = DynamicLossScaler(**kwargs, max_scale=2.0**30), torch.amp.GradScaler("cpu", **kwargs)
    for name in ("growth_factor", "backoff_factor", "growth_interval"):
        assert getattr(ours, f"get_{name}")() == getattr(theirs, f"get_{name}")()
    assert ours.is_enabled() and ours.get_scale() == theirs.get_scale() == 8.0
    for scaler in (ours, theirs):
        scaler.set_growth_factor(4.0)
        scaler.set_backoff_factor(0.5)
        scaler.set_growth_interval(1)
    assert (ours.get_growth_factor(), ours.get_backoff_factor(), ours.get_growth_interval()) == (4.0, 0.5, 1)
    p = torch.nn.Parameter(torch.ones(2))
    for scaler in (ours, theirs):
        scaler.scale(torch.ones(()))
        p.grad = torch.ones(2)
        scaler.step(torch.optim.SGD([p], lr=0.0))
        scaler.update()
    assert ours.get_scale() == theirs.get_scale() == 32.0
    assert not DynamicLossScaler(enabled=False).is_enabled()


@pytest.mark.parametrize(
    "setter, value, error, text",
    [
        ("set_growth_factor", 1.0, ValueError, "new_factor=1.0 is not allowed: new_factor must be a finite number > 1"),
        ("set_growth_factor", float("nan"), ValueError, "new_factor=nan"),
        (
            "set_backoff_factor",
            1.5,
            ValueError,
            "new_factor=1.5 is not allowed: new_factor must be a finite number > 0 and < 1",
        ),
        ("set_backoff_factor", "half", TypeError, "new_factor='half'"),
        ("set_growth_interval", 0, ValueError, "new_interval=0 is not allowed: new_interval must be an integer >= 1"),
        ("set_growth_interval", 2.5, TypeError, "new_interval=2.5"),
    ],
)
def test_setters_check_like_the_constructor(setter, value, error, text):
    scaler = DynamicLossScaler()
    before = scaler.state_dict()
    with pytest.raises(error) as info:
        getattr(scaler, setter)(value)
    assert text in str(info.value)
    assert scaler.state_dict() == before


# ---------------------------------------------------------------- optimizers that take the scale themselves
class ScaleAware(torch.optim.SGD):
    """Records what GradScaler's protocol hands it; does not update."""

    _step_supports_amp_scaling = True

    def __init__(self, params, seen):
        super().__init__(params, lr=0.1)
        self.seen = seen

    def step(self, closure=None):
        grad_scale = self.grad_scale
        self.seen.append(
            (
                None if grad_scale is None else grad_scale.item(),
                self.found_inf.item(),
                [p.grad.clone() for p in self.param_groups[0]["params"]],
            )
        )
        return "stepped"


class ScaleAwareKwarg(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):
        self.given = grad_scaler
        return "stepped"


@pytest.mark.parametrize("separate_unscale", [False, True])
def test_an_optimizer_that_handles_the_scale_gets_it_as_from_grad_scaler(separate_unscale):
    results = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=8.0), DynamicLossScaler(init_scale=8.0)):
        seen = []
        p = torch.nn.Parameter(torch.ones(3))
        opt = ScaleAware([p], seen)
        returned = []
        for grad in (2.0, math.inf, 4.0):
            scaler.scale(torch.ones(()))
            p.grad = torch.full((3,), grad * scaler.get_scale())
            if separate_unscale:
                scaler.unscale_(opt)
            returned.append(scaler.step(opt))  # stepped even on inf: the optimizer skips by itself
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            scaler.update()
        results.append((seen, returned, scaler.get_scale()))
    (theirs, their_returns, their_scale), (ours, our_returns, our_scale) = results
    assert our_returns == their_returns == ["stepped"] * 3 and our_scale == their_scale
    for (s1, f1, g1), (s2, f2, g2) in zip(theirs, ours):
        assert (s1, f1) == (s2, f2)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert [f for _, f, _ in ours] == [0.0, 1.0, 0.0]
    assert [s for s, _, _ in ours] == ([None] * 3 if separate_unscale else [8.0, 8.0, 4.0])


def test_an_optimizer_taking_grad_scaler_gets_the_scaler():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = ScaleAwareKwarg([p], lr=0.1)
    scaler = DynamicLossScaler()
    with pytest.warns(FutureWarning, match="itself as a keyword argument"):  # as GradScaler warns
        assert scaler.step(opt) == "stepped" and opt.given is scaler
    scaler._check_inf_per_device(opt)  # what such an optimizer may call
    assert scaler._found_inf_per_device(opt)[torch.device("cpu")].item() == 0.0
    scaler.update()


def test_fused_adamw_steps_as_under_grad_scaler():
    """torch's AdamW(fused=True) unscales and skips inside its kernel when given the scale."""
    finals = []
    for scaler in (torch.amp.GradScaler("cpu", init_scale=2.0**10), DynamicLossScaler(init_scale=2.0**10)):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for i in range(4):
            opt.zero_grad()
            scaler.scale(model(torch.randn(5, 4)).pow(2).mean()).backward()
            if i == 1:
                model.weight.grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
        finals.append(
            (
                [p.detach().clone() for p in model.parameters()],
                [s["exp_avg_sq"].clone() for s in opt.state.values()],
                scaler.get_scale(),
            )
        )
    assert finals[0][2] == finals[1][2]
    for a, b in zip(finals[0][0] + finals[0][1], finals[1][0] + finals[1][1]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- state dicts
@pytest.mark.parametrize(
    "key, value",
    [
        ("scale", math.nan),
        ("scale", math.inf),
        ("scale", 0.0),
        ("scale", -2.0),
        ("scale", 1e39),
        ("scale", 2.0**30),
        ("growth_factor", 0.5),
        ("backoff_factor", 1.5),
        ("growth_interval", 0),
        ("growth_interval", 2.5),
        ("hysteresis", 0),
        ("hysteresis_reset", "always"),
        ("on_min_scale", "ignore"),
        ("min_scale", 0.0),
        ("min_scale", 1e-50),
        ("max_scale", math.inf),
        ("_growth_tracker", -1),
        ("skipped_steps", "3"),
        ("last_step_skipped", 1),
        ("scale", "big"),  # a TypeError before: the docstring promises a ValueError for a bad entry
        ("scale", torch.tensor([1.0, 2.0])),
    ],
)
def test_load_state_dict_checks_like_the_constructor(key, value):
    state = DynamicLossScaler().state_dict()
    state[key] = value
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=5)
    before = scaler.state_dict()
    with pytest.raises(ValueError) as info:
        scaler.load_state_dict(state)
    assert str(info.value).startswith(f"{key}=")
    assert scaler.state_dict() == before  # nothing changed


@pytest.mark.parametrize("scaler", [DynamicLossScaler(), StaticLossScaler()], ids=["dynamic", "static"])
def test_a_state_dict_without_a_scale_names_the_key(scaler):
    with pytest.raises(ValueError, match="no 'scale' entry"):
        scaler.load_state_dict({"growth_factor": 2.0})
    with pytest.raises(ValueError, match="^scale=nan"):
        scaler.load_state_dict({"scale": math.nan})


@pytest.mark.parametrize("scaler", [DynamicLossScaler(), StaticLossScaler()], ids=["dynamic", "static"])
def test_a_one_element_tensor_scale_loads_as_torchs_grad_scaler_takes_it(scaler):
    """``torch.amp.GradScaler.load_state_dict`` takes a 0-dim tensor scale (its own ``state_dict`` holds a
    float); so do ours, as the integer trackers already took one-element tensors."""
    reference = torch.amp.GradScaler("cpu")
    reference.load_state_dict({**reference.state_dict(), "scale": torch.tensor(1024.0)})
    scaler.load_state_dict({**scaler.state_dict(), "scale": torch.tensor(1024.0)})
    assert scaler.get_scale() == reference.get_scale() == 1024.0


def test_static_and_dynamic_state_dicts_load_into_each_other():
    p = torch.nn.Parameter(torch.ones(1))
    static = StaticLossScaler(128.0)
    p.grad = torch.full((1,), math.inf)
    static.step(torch.optim.SGD([p], lr=0.1))
    static.update()
    dynamic = DynamicLossScaler(init_scale=4.0, growth_interval=3, hysteresis=2)
    dynamic.load_state_dict(static.state_dict())
    # the static dict's scale and counters; this scaler's own settings; trackers start afresh
    assert dynamic.get_scale() == 128.0 and dynamic.skipped_steps == 1 and dynamic.update_count == 1
    assert (dynamic.growth_interval, dynamic._growth_tracker, dynamic._hysteresis_tracker) == (3, 0, 2)
    static_again = StaticLossScaler(1.0)
    static_again.load_state_dict(dynamic.state_dict())  # the dynamic settings are ignored
    assert static_again.state_dict() == static.state_dict()
    for _ in range(3):
        p.grad = torch.ones(1)
        static_again.step(torch.optim.SGD([p], lr=0.0))
        static_again.update()
    assert static_again.get_scale() == 128.0


# ---------------------------------------------------------------- scales float32 cannot hold
@pytest.mark.parametrize(
    "make",
    [
        lambda: DynamicLossScaler(init_scale=1e39, max_scale=1e39),
        lambda: DynamicLossScaler(max_scale=1e39),
        lambda: DynamicLossScaler(min_scale=1e-50, init_scale=1.0),
        lambda: DynamicLossScaler(min_scale=1e-40, init_scale=1.0),  # a float32 subnormal: 1/scale is inf
        lambda: StaticLossScaler(1e39),
        lambda: StaticLossScaler(1e-45),
    ],
    ids=["init", "max", "min_underflows", "min_subnormal", "static_big", "static_tiny"],
)
def test_scales_outside_float32_normal_range_are_refused(make):
    with pytest.raises(ValueError, match="float32's normal range"):
        make()


def test_the_largest_and_smallest_float32_scales_work():
    big = DynamicLossScaler(init_scale=F32_MAX, max_scale=F32_MAX, growth_interval=1)
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    big.step(torch.optim.SGD([p], lr=0.0))
    big.update()  # growth would overflow float32: the scale stays
    assert big.get_scale() == F32_MAX and math.isfinite(big.scale(torch.ones(())).item())
    small = DynamicLossScaler(init_scale=F32_TINY, min_scale=F32_TINY)
    p.grad = torch.ones(2)
    small.unscale_(torch.optim.SGD([p], lr=0.0))
    assert torch.isfinite(p.grad).all()


@pytest.mark.parametrize("new_scale", [1e39, math.inf, 0.0, 1e-50, 2.0**30, torch.tensor([2.0, 4.0])])
def test_update_new_scale_is_checked(new_scale):
    scaler = DynamicLossScaler(init_scale=4.0)
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    scaler.step(torch.optim.SGD([p], lr=0.0))
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale)
    scaler.update(torch.tensor(8.0))  # still in the iteration: nothing changed
    assert scaler.get_scale() == 8.0


# ---------------------------------------------------------------- the settings table
@pytest.mark.parametrize("make", [DynamicLossScaler, StaticLossScaler], ids=["dynamic", "static"])
@pytest.mark.parametrize("enabled", ["no", 1, None])
def test_enabled_must_be_a_bool(make, enabled):
    with pytest.raises(TypeError, match=rf"^enabled={enabled!r} is not allowed: enabled must be True or False"):
        make(enabled=enabled)


def test_every_setting_is_in_settings_state_dict_and_repr():
    import inspect

    arguments = set(inspect.signature(DynamicLossScaler).parameters) - {"init_scale", "enabled"}
    scaler = DynamicLossScaler(growth_interval=7, hysteresis=3, retries=2, min_scale=0.5, on_min_scale="skip")
    assert set(scaler.settings()) == arguments
    state = scaler.state_dict()
    assert {k: state[k] for k in arguments} == scaler.settings()
    assert repr(scaler) == (
        "DynamicLossScaler(scale=65536, growth_factor=2, backoff_factor=0.5, growth_interval=7, hysteresis=3, "
        "hysteresis_reset='growth', min_scale=0.5, max_scale=1.67772e+07, on_min_scale='skip', retries=2, "
        "early_growth_interval=0, early_growth_margin=4, enabled=True)"
    )
    assert repr(StaticLossScaler(8.0, enabled=False)) == "StaticLossScaler(scale=8, enabled=False)"
    assert StaticLossScaler(8.0).settings() == {"scale": 8.0}


@pytest.mark.parametrize("key, value", [("retries", -1), ("retries", 1.5), ("retries", True)])
def test_the_retries_setting_is_checked_in_the_constructor_and_on_load(key, value):
    with pytest.raises((TypeError, ValueError), match=f"^{key}="):
        DynamicLossScaler(**{key: value})
    state = DynamicLossScaler().state_dict()
    state[key] = value
    with pytest.raises(ValueError, match=f"^{key}="):
        DynamicLossScaler().load_state_dict(state)


def test_restarted_keeps_the_counters_and_restarts_what_drives_the_scale():
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    saved_run = DynamicLossScaler(init_scale=64.0, growth_interval=5, hysteresis=3)
    for grad in (math.inf, 1.0, 1.0, math.inf):
        p.grad = torch.full((1,), grad)
        saved_run.step(opt)
        saved_run.update()
    saved = saved_run.state_dict()
    assert (saved["_growth_tracker"], saved["_hysteresis_tracker"], saved["consecutive_skips"]) == (0, 1, 1)
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=5, hysteresis=2)
    restarted = scaler.restarted(saved)
    assert saved == saved_run.state_dict()  # not changed in place
    scaler.load_state_dict(restarted)
    fresh = DynamicLossScaler(init_scale=8.0, growth_interval=5, hysteresis=2)
    assert (scaler.skipped_steps, scaler.update_count) == (2, 4)
    for key in ("scale", "_growth_tracker", "_hysteresis_tracker", "consecutive_skips", "last_step_skipped"):
        assert scaler.state_dict()[key] == fresh.state_dict()[key], key
    static = StaticLossScaler(4.0)
    static.load_state_dict(static.restarted(saved))
    assert static.get_scale() == 4.0 and static.skipped_steps == 2
