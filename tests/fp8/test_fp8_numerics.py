"""FP8 numerics against pure-Python references: casts, the scale rule, the delayed history,
the GEMMs, the guard rails, state dicts and the cross-rank amax reduction."""

from __future__ import annotations

import collections
import copy
import logging
import math
import random

import pytest
import torch
from torch import nn

from amp_plugin.fp8 import (
    E4M3,
    E5M2,
    Fp8Format,
    Fp8Linear,
    Fp8Recipe,
    compute_scale,
    convert_to_fp8,
    reference_scale,
    saturating_cast,
)


def ref_cast(v: float, fmt: Fp8Format) -> float:
    """Round ``v`` to ``fmt`` in plain Python: clamp to +-max, nearest, ties to even."""
    if math.isnan(v):
        return math.nan
    a = min(abs(v), fmt.max)
    if a == 0:
        return 0.0
    e = max(math.floor(math.log2(a)), 1 - fmt.bias)  # subnormals share the smallest normal exponent
    quantum = 2.0 ** (e - fmt.mantissa_bits)
    return math.copysign(round(a / quantum) * quantum, v)  # round(): ties to even


def cast(v: float, fmt: Fp8Format) -> float:
    return saturating_cast(torch.tensor([v], dtype=torch.float32), fmt).float().item()


E4M3_TABLE = [
    (448.0, 448.0),
    (464.0, 448.0),  # half an ulp past max: ties to even, stays 448
    (500.0, 448.0),
    (1e6, 448.0),
    (math.inf, 448.0),
    (-math.inf, -448.0),
    (2.0**-6, 2.0**-6),  # smallest normal
    (2.0**-9, 2.0**-9),  # smallest subnormal
    (3 * 2.0**-10, 2.0**-8),  # 1.5 quanta: tie to the even 2 quanta
    (2.0**-10, 0.0),  # half the smallest subnormal: tie to even 0
    (1.1 * 2.0**-10, 2.0**-9),
    (2.0**-11, 0.0),
    (1.0625, 1.0),  # tie between 1.0 and 1.125: even mantissa
    (1.1875, 1.25),
]
E5M2_TABLE = [
    (57344.0, 57344.0),
    (61440.0, 57344.0),  # would be inf by IEEE rounding; the saturating cast clamps first
    (1e6, 57344.0),
    (math.inf, 57344.0),
    (2.0**-14, 2.0**-14),  # smallest normal
    (2.0**-16, 2.0**-16),  # smallest subnormal
    (2.0**-17, 0.0),
    (1.5 * 2.0**-17, 2.0**-16),
    (3 * 2.0**-17, 2.0**-15),
    (1.125, 1.0),
    (1.375, 1.5),
]


@pytest.mark.parametrize(("fmt", "table"), [(E4M3, E4M3_TABLE), (E5M2, E5M2_TABLE)], ids=["e4m3", "e5m2"])
def test_saturation_and_subnormal_table(fmt: Fp8Format, table: list[tuple[float, float]]) -> None:
    for value, expected in table:
        assert ref_cast(value, fmt) == expected, value
        assert cast(value, fmt) == expected, value
        assert cast(-value, fmt) == -expected, value
    assert math.isnan(cast(math.nan, fmt))


def test_format_constants() -> None:
    assert (E4M3.max, E4M3.min_normal, E4M3.min_subnormal, E4M3.saturation_threshold) == (448, 2**-6, 2**-9, 464)
    assert (E5M2.max, E5M2.min_normal, E5M2.min_subnormal, E5M2.saturation_threshold) == (57344, 2**-14, 2**-16, 61440)
    for fmt in (E4M3, E5M2):
        assert torch.finfo(fmt.dtype).max == fmt.max
        assert torch.finfo(fmt.dtype).smallest_normal == fmt.min_normal


def test_e5m2_plain_cast_is_ieee() -> None:
    # Without the clamp, E5M2 rounds past its max to inf, as IEEE 754 does: why the cast clamps.
    assert torch.tensor([61440.0]).to(torch.float8_e5m2).float().item() == math.inf
    assert torch.tensor([61439.0]).to(torch.float8_e5m2).float().item() == 57344.0


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_cast_matches_reference_on_a_sweep(fmt: Fp8Format) -> None:
    rng = random.Random(0)
    values = [rng.choice([-1, 1]) * 2.0 ** rng.uniform(-22, 20) for _ in range(4000)]
    values = [float(torch.tensor(v, dtype=torch.float32)) for v in values]  # FP32 inputs
    got = saturating_cast(torch.tensor(values), fmt).float().tolist()
    assert got == [ref_cast(v, fmt) for v in values]


def test_scale_formula_against_reference() -> None:
    cases = [  # amax, previous, max, margin, floor
        (1.0, 1.0, 448.0, 0, 1e-12),
        (3.7, 1.0, 448.0, 0, 1e-12),
        (3.7, 1.0, 57344.0, 2, 1e-12),
        (1e-30, 1.0, 448.0, 0, 1e-12),  # below the floor: the floor
        (0.0, 5.0, 448.0, 0, 1e-12),  # all-zero tensor: the previous scale
        (math.inf, 5.0, 448.0, 0, 1e-12),
        (math.nan, 5.0, 448.0, 0, 1e-12),
        (1e-12, 1.0, 448.0, -120, 1e-12),  # beyond FP32's normal range: clamped to 2**126
        (1e30, 1.0, 448.0, 100, 1e-12),  # clamped to 2**-126
    ]
    for amax, prev, fmax, margin, floor in cases:
        got = compute_scale(torch.tensor(amax), torch.tensor(prev), fmax, margin, floor).item()
        expected = float(torch.tensor(reference_scale(amax, prev, fmax, margin, floor), dtype=torch.float32))
        assert got == expected, (amax, margin)
        assert math.isfinite(got) and got > 0
    assert compute_scale(torch.tensor(1e-12), torch.tensor(1.0), 448.0, -120, 1e-12).item() == 2.0**126
    rng = random.Random(0)  # one correctly rounded division (not 448 * (1 / amax))
    amaxes = [float(torch.tensor(2.0 ** rng.uniform(-30, 30), dtype=torch.float32)) for _ in range(2000)]
    got = compute_scale(torch.tensor(amaxes), torch.ones(len(amaxes)), 448.0, 0, 1e-12).tolist()
    assert got == [float(torch.tensor(reference_scale(a, 1.0, 448.0, 0, 1e-12))) for a in amaxes]
    assert compute_scale(torch.tensor(0.0), torch.tensor(1.0), 448.0, 0, 1e-12).item() == 1.0


def _layer(recipe: Fp8Recipe, k: int = 16, n: int = 16, dtype: torch.dtype = torch.float32) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_linear(nn.Linear(k, n, bias=False).to(dtype), recipe)


def _input_with_amax(amax: float, k: int = 16) -> torch.Tensor:
    x = torch.full((4, k), amax / 4)
    x[1, 3] = -amax
    return x


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_history_rules(algo: str) -> None:
    recipe = Fp8Recipe(amax_history_len=3, amax_compute_algo=algo, margin=1, fallback_steps=0)
    layer = _layer(recipe)
    fp8 = convert_to_fp8(nn.Sequential(layer), recipe)
    window: collections.deque[float] = collections.deque(maxlen=3)
    scale = 1.0
    for step, amax in enumerate([1.0, 4.0, 2.0, 0.5, 0.25, 0.0, 8.0, 0.125]):
        x = _input_with_amax(amax)
        assert layer.fp8_scale[0].item() == scale  # the forward uses the scale of earlier steps
        if step == 0:  # no history yet: the first cast uses its own amax
            scale = float(torch.tensor(reference_scale(amax, 1.0, 448.0, 1, 1e-12)))
        y = layer(x)
        assert layer.fp8_scale[0].item() == scale
        y.sum().backward()
        fp8.update()
        window.append(amax)
        used = max(window) if algo == "max" else window[-1]
        scale = float(torch.tensor(reference_scale(used, scale, 448.0, 1, 1e-12), dtype=torch.float32))
        assert layer.fp8_scale[0].item() == scale, (amax, list(window))
        assert layer.fp8_amax_history[0].tolist() == [0.0, 0.0, 0.0]  # rolled, row 0 cleared
    assert sorted(layer.fp8_amax_history[:, 0].tolist()[1:]) == sorted(list(window)[1:])


def _dequant(t8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return t8.float() * scale.float().reciprocal()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_gemms_equal_fp32_matmul_of_the_cast_operands(scaling: str, fmt: str) -> None:
    recipe = Fp8Recipe(scaling=scaling, fp8_format=fmt, fallback_steps=0)
    layer = _layer(recipe, k=32, n=48, dtype=torch.bfloat16)
    fp8 = convert_to_fp8(nn.Sequential(layer), recipe)
    grad_fmt = E5M2 if fmt == "hybrid" else E4M3
    torch.manual_seed(1)
    for _ in range(2):  # the second step uses the delayed scales of the first
        x = (torch.randn(24, 32) * 3).bfloat16().requires_grad_()
        g = (torch.randn(24, 48) * 1e-3).bfloat16()
        scales = layer.fp8_scale.clone()
        w = layer.weight.detach()

        sx, sw, sg = (
            scales[i]
            if scaling == "delayed" and fp8.steps > 0  # the first step has no history: its own amax
            else torch.tensor(reference_scale(t.abs().max().item(), scales[i].item(), max_, 0, 1e-12))
            for i, (t, max_) in enumerate([(x, 448.0), (w, 448.0), (g, grad_fmt.max)])
        )
        x8 = saturating_cast(x.detach().float() * sx, E4M3)
        w8 = saturating_cast(w.float() * sw, E4M3)
        g8 = saturating_cast(g.float() * sg, grad_fmt)
        y = layer(x)
        assert torch.equal(y, (_dequant(x8, sx) @ _dequant(w8, sw).T).bfloat16())
        layer.weight.grad = None
        y.backward(g)
        assert torch.equal(x.grad, (_dequant(g8, sg) @ _dequant(w8, sw)).bfloat16())
        assert torch.equal(layer.weight.grad, (_dequant(g8, sg).T @ _dequant(x8, sx)).bfloat16())
        fp8.update()


def test_rowwise_gemms_equal_reference() -> None:
    recipe = Fp8Recipe(scaling="rowwise", fallback_steps=0)
    layer = _layer(recipe, k=32, n=48, dtype=torch.bfloat16)
    torch.manual_seed(2)
    x = (torch.randn(24, 32) * torch.logspace(-2, 2, 24).unsqueeze(1)).bfloat16().requires_grad_()
    g = (torch.randn(24, 48) * 1e-2).bfloat16()
    w = layer.weight.detach().float()

    def rows(t: torch.Tensor, fmt: Fp8Format, dim: int) -> torch.Tensor:
        amax = t.float().abs().amax(dim=dim, keepdim=True)
        scale = torch.tensor([reference_scale(a, 1.0, fmt.max, 0, 1e-12) for a in amax.flatten().tolist()])
        scale = scale.reshape(amax.shape)
        return _dequant(saturating_cast(t.float() * scale, fmt), scale)

    y = layer(x)
    assert torch.equal(y, (rows(x, E4M3, 1) @ rows(w, E4M3, 1).T).bfloat16())
    y.backward(g)
    assert torch.equal(x.grad, (rows(g, E5M2, 1) @ rows(w, E4M3, 0)).bfloat16())
    assert torch.equal(layer.weight.grad, (rows(g.T, E5M2, 1) @ rows(x.detach(), E4M3, 0)).bfloat16())


def test_outlier_saturates_counts_and_falls_back_once(caplog: pytest.LogCaptureFixture) -> None:
    recipe = Fp8Recipe(amax_history_len=4, fallback_saturation=0.01, fallback_steps=2)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 16))
    fp8 = convert_to_fp8(model, recipe)
    assert list(fp8.layers) == ["1"]  # first and last stay BF16
    torch.manual_seed(0)
    first_stats = None
    with caplog.at_level(logging.WARNING, logger="amp_plugin.fp8"):
        for step in range(8):
            x = torch.randn(8, 16)
            x[0, 0] = 1.0
            out = model(x * 16.0**step)  # each step far beyond what the delayed scale has seen
            assert torch.isfinite(out).all()
            out.sum().backward()
            fp8.update()
            if step == 1:  # step 0 cast with the initial scale 1.0; step 1 with step 0's amax
                first_stats = {s.operand: s for s in fp8.read_stats()}
    assert first_stats is not None and first_stats["input"].saturated_frac > 0.01
    # above the bound from step 1 on; counters read every 2 steps: 2 in a row seen after the 4th update
    assert [(f.layer, f.step, f.steps_above) for f in fp8.fallbacks] == [("1", 4, 3)]
    assert not fp8.layers["1"].fp8_active
    assert len([r for r in caplog.records if "falls back to BF16" in r.getMessage()]) == 1
    assert fp8.read_stats() == []  # a fallen-back layer is a plain Linear


def test_all_zero_activation_keeps_a_finite_scale() -> None:
    recipe = Fp8Recipe(amax_history_len=2, amax_compute_algo="most_recent", fallback_steps=0)
    layer = _layer(recipe)
    fp8 = convert_to_fp8(nn.Sequential(layer), recipe)
    layer(_input_with_amax(2.0)).sum().backward()
    fp8.update()
    before = layer.fp8_scale.clone()
    x = torch.zeros(4, 16, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    fp8.update()
    assert torch.equal(y, torch.zeros_like(y)) and torch.isfinite(x.grad).all()
    assert layer.fp8_scale[0] == before[0]  # zero amax: the previous scale, not 448/0
    stats = {s.operand: s for s in fp8.read_stats()}
    assert stats["input"].amax == 2.0 and stats["input"].numel == 128  # both steps in the window
    assert torch.isfinite(layer.fp8_scale).all()


def test_nan_input_stays_nan_and_keeps_the_scale() -> None:
    recipe = Fp8Recipe(amax_history_len=1, fallback_steps=0)
    layer = _layer(recipe)
    fp8 = convert_to_fp8(nn.Sequential(layer), recipe)
    x = _input_with_amax(1.0)
    x[0, 0] = math.nan
    assert torch.isnan(layer(x)).any()  # a NaN reaches the loss (and the NaN checks)
    fp8.update()
    assert layer.fp8_scale[0].item() == 1.0


def _train(model: nn.Module, fp8, opt, steps: range) -> None:
    for step in steps:
        torch.manual_seed(100 + step)
        x = torch.randn(32, 32, dtype=torch.bfloat16) * (1 + step)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        fp8.update()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)).bfloat16()


def test_state_dict_resume_is_bit_for_bit() -> None:
    recipe = Fp8Recipe(amax_history_len=4, fallback_steps=3)
    full = _model()
    full_fp8 = convert_to_fp8(full, recipe)
    full_opt = torch.optim.SGD(full.parameters(), lr=0.1)
    _train(full, full_fp8, full_opt, range(6))

    first = _model()
    first_fp8 = convert_to_fp8(first, recipe)
    first_opt = torch.optim.SGD(first.parameters(), lr=0.1)
    _train(first, first_fp8, first_opt, range(3))
    saved = copy.deepcopy((first.state_dict(), first_opt.state_dict(), first_fp8.state_dict()))
    assert not any("fp8" in k for k in saved[0])  # the module's own state dict is unchanged

    resumed = _model()
    resumed.load_state_dict(saved[0])
    resumed_fp8 = convert_to_fp8(resumed, recipe)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed_opt.load_state_dict(saved[1])
    resumed_fp8.load_state_dict(saved[2])
    _train(resumed, resumed_fp8, resumed_opt, range(3, 6))

    assert resumed_fp8.steps == full_fp8.steps == 6
    for name, layer in full_fp8.layers.items():
        other = resumed_fp8.layers[name]
        assert torch.equal(layer.fp8_amax_history, other.fp8_amax_history)
        assert torch.equal(layer.fp8_scale, other.fp8_scale)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_dict_of_other_layers_is_refused() -> None:
    fp8 = convert_to_fp8(_model(), Fp8Recipe())
    other = convert_to_fp8(_model(), Fp8Recipe(keep_first_last=False))
    with pytest.raises(ValueError, match="not FP8 here"):
        fp8.load_state_dict(other.state_dict())


def test_amax_reduced_across_ranks_before_the_scale_update() -> None:
    # Two "ranks" in one process: each one's reduce hook maxes its amaxes with the other's, as an
    # all_reduce(MAX) over a 2-process group would; then both hold the same scales.
    recipe = Fp8Recipe(amax_history_len=2, fallback_steps=0)
    models = [_model(), _model()]
    ranks = [convert_to_fp8(m, recipe) for m in models]
    for rank, model in enumerate(models):
        torch.manual_seed(rank)
        model(torch.randn(16, 32, dtype=torch.bfloat16) * (1 + 7 * rank)).float().sum().backward()
    now = [torch.stack([m.fp8_amax_history[0] for m in r.layers.values()]).clone() for r in ranks]
    calls = []

    def hook(other: torch.Tensor):
        def reduce(t: torch.Tensor) -> None:
            calls.append(t.shape)
            t.copy_(torch.maximum(t, other))

        return reduce

    ranks[0].reduce, ranks[1].reduce = hook(now[1]), hook(now[0])
    for r in ranks:
        r.update()
    assert calls == [torch.Size([2, 3])] * 2  # one collective per step for all layers
    reduced = torch.maximum(now[0], now[1])
    for r in ranks:
        for row, layer in zip(reduced.tolist(), r.layers.values()):
            maxes = [448.0, 448.0, 57344.0]
            expected = [float(torch.tensor(reference_scale(a, 1.0, m, 0, 1e-12))) for a, m in zip(row, maxes)]
            assert layer.fp8_scale.tolist() == expected
    for a, b in zip(ranks[0].layers.values(), ranks[1].layers.values()):
        assert torch.equal(a.fp8_scale, b.fp8_scale)


def test_conversion_rules() -> None:
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(32, 64))
    model.add_module("small", nn.Linear(64, 8))
    model.add_module("odd", nn.Linear(8, 40))
    model.add_module("attn", nn.Linear(40, 64))
    model.add_module("mlp", nn.Linear(64, 64))
    model.add_module("head", nn.Linear(64, 10))
    recipe = Fp8Recipe(keep_bf16=("att*",), min_features=16)
    weight = model.mlp.weight
    fp8 = convert_to_fp8(model, recipe)
    assert list(fp8.layers) == ["mlp"]
    assert isinstance(model.mlp, Fp8Linear) and model.mlp.weight is weight  # same Parameter
    assert type(model.head) is nn.Linear and type(model.attn) is nn.Linear
    again = convert_to_fp8(model, recipe)  # idempotent
    assert list(again.layers) == ["mlp"] and again.layers["mlp"] is model.mlp


def test_fp8_state_stays_fp32_when_the_model_is_cast() -> None:
    layer = _layer(Fp8Recipe())
    layer.bfloat16()
    assert layer.weight.dtype == torch.bfloat16
    assert layer.fp8_scale.dtype == torch.float32 and layer.fp8_stats.dtype == torch.float64


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scaling": "tensor"}, ValueError, "scaling='tensor'"),
        ({"fp8_format": "e5m2"}, ValueError, "fp8_format='e5m2'"),
        ({"amax_compute_algo": "mean"}, ValueError, "amax_compute_algo"),
        ({"margin": 0.5}, TypeError, "margin=0.5"),
        ({"amax_history_len": 0}, ValueError, "amax_history_len=0"),
        ({"fallback_saturation": 1.0}, ValueError, "fallback_saturation"),
        ({"keep_bf16": "head"}, TypeError, "keep_bf16='head'"),
    ],
)
def test_recipe_rejects_bad_values(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Fp8Recipe(**kwargs)


def test_a_layer_whose_operand_flushes_to_zero_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    # A delayed scale set by one huge batch: every later input, 1e9 times smaller, casts to FP8 zeros
    # (E4M3's smallest subnormal is 2**-9), so the layer computes nothing from its input.
    recipe = Fp8Recipe(amax_history_len=16, fallback_steps=2)
    layer = _layer(recipe)
    fp8 = convert_to_fp8(nn.Sequential(layer), recipe)
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="amp_plugin.fp8"):
        layer(torch.randn(4, 16) * 1e4).sum().backward()
        fp8.update()
        tiny = torch.randn(4, 16) * 1e-5
        for _ in range(3):
            out = layer(tiny)
            out.sum().backward()
            fp8.update()
            if layer.fp8_active:
                assert torch.count_nonzero(out) == 0  # the input flushed to zero: nothing got through
    assert [(f.layer, f.step) for f in fp8.fallbacks] == [("0", 4)]
    assert not layer.fp8_active
    assert len([r for r in caplog.records if "all of them flushed to zero" in r.getMessage()]) == 1
    assert torch.equal(layer(tiny), torch.nn.functional.linear(tiny, layer.weight))  # as the layer it replaced


def test_a_cast_that_keeps_some_values_does_not_count_against_the_layer() -> None:
    recipe = Fp8Recipe(amax_history_len=16, fallback_steps=2)
    layer = _layer(recipe)
    fp8 = convert_to_fp8(nn.Sequential(layer), recipe)
    torch.manual_seed(0)
    layer(torch.randn(4, 16) * 1e4).sum().backward()
    fp8.update()
    for _ in range(4):
        x = torch.randn(4, 16) * 1e-5
        x[0, 0] = 1e3  # one value the scale still represents
        layer(x).sum().backward()
        fp8.update()
    assert fp8.fallbacks == [] and layer.fp8_active
