"""The dynamic loss-scale rule: exact trajectories, against torch.amp.GradScaler as an oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_plugin import DynamicLossScaler, LossScaleCollapseError

F32_MAX = torch.finfo(torch.float32).max
F32_TINY = torch.finfo(torch.float32).tiny  # the smallest scale allowed: 1/scale is still finite


def run_pattern(scaler, pattern):
    """Drive ``scaler`` through an overflow pattern (True = inf gradient); return the scales."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scales = []
    for overflow in pattern:
        scaler.scale(torch.tensor(1.0))  # GradScaler creates its scale tensor lazily here
        p.grad = torch.full((3,), math.inf if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@settings(max_examples=60, deadline=None)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=300),
    growth_factor=st.sampled_from([2.0, 1.7, 3.0, 1.001]),
    backoff_factor=st.sampled_from([0.5, 0.3, 0.25, 0.999]),
    growth_interval=st.integers(1, 6),
    init_scale=st.sampled_from([2.0**16, 1.0, 3.3, 2.0**120]),
)
def test_hysteresis_1_trajectory_equals_grad_scaler(
    pattern, growth_factor, backoff_factor, growth_interval, init_scale
):
    kwargs = dict(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    ours = DynamicLossScaler(**kwargs, min_scale=F32_TINY, max_scale=F32_MAX)
    torch_scaler = torch.amp.GradScaler("cpu", **kwargs)
    assert run_pattern(ours, pattern) == run_pattern(torch_scaler, pattern)


def test_sgd_params_end_equal_to_grad_scaler_run():
    torch.manual_seed(0)
    data = [(torch.randn(16, 8), torch.randn(16, 2)) for _ in range(60)]
    overflow_at = {3, 4, 5, 17, 30, 31, 50}
    finals = []
    for scaler in (
        DynamicLossScaler(init_scale=2.0**10, growth_interval=4),
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4),
    ):
        torch.manual_seed(1)
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if i in overflow_at:
                model.weight.grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
        finals.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    assert finals[0][0] == finals[1][0]
    for a, b in zip(finals[0][1], finals[1][1]):
        assert torch.equal(a, b)


def test_worked_trajectory_growth_and_backoff():
    scaler = DynamicLossScaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    assert run_pattern(scaler, [False, False, True]) == [4.0, 8.0, 2.0]
    assert [scaler.last_update.reason] == ["overflow"]


def test_hysteresis_refills_on_growth():
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=2, growth_interval=3)
    pattern = [True, True, True, False, False, False, True, True]
    assert run_pattern(scaler, pattern) == [1024, 512, 256, 256, 256, 512, 512, 256]
    assert scaler.skipped_steps == 5


def test_hysteresis_is_not_refilled_by_clean_steps_in_growth_mode():
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=2, growth_interval=100)
    assert run_pattern(scaler, [True, False, True, False, True]) == [1024, 1024, 512, 512, 256]


def test_hysteresis_refills_after_every_clean_step_in_finite_mode():
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=2, hysteresis_reset="finite", growth_interval=100)
    assert run_pattern(scaler, [True, False, True, True, False, True, True, True]) == [
        1024,
        1024,
        1024,
        512,
        512,
        512,
        256,
        128,
    ]


def test_hysteresis_reasons():
    scaler = DynamicLossScaler(init_scale=8.0, hysteresis=3, growth_interval=1)
    reasons = []
    for overflow in [True, True, True, False]:
        run_pattern(scaler, [overflow])
        reasons.append(scaler.last_update.reason)
    assert reasons == ["hysteresis", "hysteresis", "overflow", "growth"]


def test_backoff_stops_at_min_scale_then_collapse_raises():
    scaler = DynamicLossScaler(init_scale=3.0, min_scale=2.0, backoff_factor=0.5)
    assert run_pattern(scaler, [True]) == [2.0]
    with pytest.raises(LossScaleCollapseError) as info:
        run_pattern(scaler, [True])
    err = info.value
    assert isinstance(err, FloatingPointError)
    assert (err.scale, err.iteration, err.consecutive_skips) == (2.0, 1, 2)
    message = str(err)
    for needle in ("minimum scale 2", "step 1", "2 steps skipped in a row", "learning rate", "NaN", "bf16"):
        assert needle in message
    # State stays consistent: the skipped step was counted before raising.
    assert scaler.skipped_steps == 2 and scaler.last_step_skipped


def test_collapse_waits_for_hysteresis():
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, hysteresis=3)
    run_pattern(scaler, [True, True])
    with pytest.raises(LossScaleCollapseError):
        run_pattern(scaler, [True])


def test_on_min_scale_skip_keeps_skipping():
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=1.0, on_min_scale="skip", growth_interval=2)
    assert run_pattern(scaler, [True, True, True, False, False]) == [1.0, 1.0, 1.0, 1.0, 2.0]
    assert scaler.skipped_steps == 3


def test_max_scale_caps_growth_and_capped_growth_counts():
    scaler = DynamicLossScaler(init_scale=2.0**23, max_scale=2.0**24, growth_interval=1, hysteresis=2)
    assert run_pattern(scaler, [False, False]) == [2.0**24, 2.0**24]
    assert scaler.last_update.reason == "growth" and not scaler.last_update.changed
    # The capped growth refilled the hysteresis: one overflow is absorbed again.
    run_pattern(scaler, [True])
    assert scaler.last_update.reason == "hysteresis"


def test_growth_never_reaches_inf():
    scaler = DynamicLossScaler(init_scale=2.0**127, max_scale=F32_MAX, growth_interval=1)
    assert run_pattern(scaler, [False] * 3) == [2.0**127] * 3


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=float("nan")), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(init_scale=0.0), "init_scale"),
        (dict(init_scale=-1.0), "init_scale"),
        (dict(init_scale=math.inf), "init_scale"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(max_scale=math.inf), "max_scale"),
        (dict(min_scale=4.0, max_scale=2.0, init_scale=3.0), "min_scale"),
        (dict(init_scale=2.0**30), "init_scale"),
        (dict(init_scale=0.5), "init_scale"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(hysteresis_reset="always"), "hysteresis_reset"),
        (dict(on_min_scale="ignore"), "on_min_scale"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError) as info:
        DynamicLossScaler(**kwargs)
    assert str(info.value).startswith(name + "=")
    assert "must" in str(info.value)


@pytest.mark.parametrize("kwargs", [dict(growth_interval=2.5), dict(init_scale="abc"), dict(hysteresis=True)])
def test_wrong_types_are_type_errors(kwargs):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        DynamicLossScaler(**kwargs)


def test_state_dict_round_trips_every_tracker():
    pattern = [True, False, False, True, True, False, False, False, True, False]
    kwargs = dict(init_scale=256.0, growth_interval=3, hysteresis=2, hysteresis_reset="growth", min_scale=2.0)
    reference = DynamicLossScaler(**kwargs)
    run_pattern(reference, pattern[:5])
    state = reference.state_dict()
    resumed = DynamicLossScaler()  # defaults differ: everything must come from the state
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert run_pattern(resumed, pattern[5:]) == run_pattern(reference, pattern[5:])
    assert resumed.state_dict() == reference.state_dict()


def test_loads_a_grad_scaler_state_dict():
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=3)
    run_pattern(torch_scaler, [False, True, False])
    ours = DynamicLossScaler()
    ours.load_state_dict(torch_scaler.state_dict())
    assert ours.get_scale() == 256.0
    assert ours.growth_interval == 3 and ours._growth_tracker == 1
    assert run_pattern(ours, [False, False, True]) == run_pattern(torch_scaler, [False, False, True])


def test_grad_scaler_loads_our_state_dict():
    ours = DynamicLossScaler(init_scale=64.0, growth_interval=2)
    run_pattern(ours, [False])
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(ours.state_dict())
    assert run_pattern(torch_scaler, [False, True]) == run_pattern(ours, [False, True])


def test_disabled_scaler_is_a_pass_through():
    scaler = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), math.inf)
    scaler.step(torch.optim.SGD([p], lr=1.0))  # not checked, not skipped
    scaler.update()
    assert torch.isinf(p).all()


def test_with_the_defaults_the_trajectory_equals_grad_scaler_while_it_stays_in_1_to_2_24():
    """The documented condition, both ways: equal scale after every update while
    GradScaler's scale stays inside [min_scale, max_scale] = [1, 2**24]; then ours caps
    (or floors, or raises) where GradScaler keeps going."""
    up = [False] * 12  # growth_interval=1: 2**16 -> 2**28 for GradScaler
    ours, theirs = DynamicLossScaler(growth_interval=1), torch.amp.GradScaler("cpu", growth_interval=1)
    a, b = run_pattern(ours, up), run_pattern(theirs, up)
    inside = [i for i, s in enumerate(b) if 1.0 <= s <= 2.0**24]
    assert a[: len(inside)] == b[: len(inside)] and len(inside) == 8
    assert a[8:] == [2.0**24] * 4 and b[8:] == [2.0**25, 2.0**26, 2.0**27, 2.0**28]
    down = [True] * 18  # 2**16 -> 2**-2 for GradScaler
    ours = DynamicLossScaler(on_min_scale="skip")
    theirs = torch.amp.GradScaler("cpu")
    a, b = run_pattern(ours, down), run_pattern(theirs, down)
    assert a[:16] == b[:16] and b[15] == 1.0
    assert a[16:] == [1.0, 1.0] and b[16:] == [0.5, 0.25]


def test_capped_and_floored_scales_are_float32_values_inside_the_limits():
    scaler = DynamicLossScaler(
        init_scale=1.0,
        min_scale=0.3,
        max_scale=1e30,
        growth_factor=1e10,
        growth_interval=1,
        backoff_factor=0.01,
        on_min_scale="skip",
    )
    scales = run_pattern(scaler, [False] * 4 + [True] * 20)
    for s in scales:
        assert 0.3 <= s <= 1e30 and s == float(torch.tensor(s, dtype=torch.float32))
    nearest = torch.tensor(1e30, dtype=torch.float32)
    assert nearest.item() > 1e30  # so the cap is the float32 below it
    assert max(scales) == nearest.nextafter(torch.tensor(0.0)).item()
    assert min(scales) == torch.tensor(0.3, dtype=torch.float32).item()  # >= 0.3
