"""emulate="auto" per dtype and per CPU: what it picks, and proof that what it picks is faithful.

"Faithful" means the products are exact, summed in FP32 and rounded once to the half dtype
(a Tensor Core's error model). For a result ``r`` of a dot product of length ``k`` that is
checked element by element against the exact (FP64) value::

    |r - exact| <= ulp(r) / 2 + gamma_k * sum(|terms|),   gamma_k = k u / (1 - k u),  u = 2**-24

i.e. one rounding to the half dtype plus what an FP32 sum in any order may lose. A kernel that
rounds partial sums to the half dtype, or accumulates in it, breaks this bound. Next to it
the difference to the oracle ``op(fp32 operands).to(dtype)`` is reported in half ulps (it
comes only from the order of the FP32 sums).

The native paths are checked on CPUs where ``auto`` picks them (avx512_bf16/AMX for BF16,
avx512_fp16/AMX-FP16 for FP16) and skipped elsewhere; the emulated paths are tested bit for
bit in test_emulation.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _emulation_helpers import DTYPES, ids, rnd
from _emulation_helpers import simulated_cpu as _features

from amp_plugin.emulation import CpuHalfEmulation, CpuPath, _cpu, cpu_features, cpu_half_path, should_emulate

U32 = 2.0**-24


# ------------------------------------------------------------------ the faithfulness check


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Half values mapped to integers that count representable values (+0 and -0 both 0)."""
    bits = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a) - ordered(b)).abs()


def ulp_above(r: torch.Tensor) -> torch.Tensor:
    """The spacing of the half dtype just above |r|, in FP64."""
    mag = r.abs()
    up = torch.nextafter(mag, torch.full_like(mag, float("inf")))
    return up.double() - mag.double()


def faithfulness(r: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, k: int, oracle: torch.Tensor) -> dict:
    """Check ``r`` (half) against the bound above; return the ulp statistics against ``oracle``."""
    assert r.shape == exact.shape == oracle.shape
    finite = torch.isfinite(r)
    assert torch.equal(finite, torch.isfinite(oracle)), "inf/NaN where the oracle has none, or the reverse"
    gamma = k * U32 / (1 - k * U32)
    err = (r.double() - exact).abs()
    allowed = ulp_above(r) / 2 + gamma * magnitude
    excess = (err - allowed)[finite]
    dist = ulp_distance(r, oracle)[finite]
    stats = {
        "violations": int((excess > 0).sum()),
        "max_ulp": int(dist.max()) if dist.numel() else 0,
        "over_1_ulp": float((dist > 1).double().mean()) if dist.numel() else 0.0,
    }
    return stats


def assert_faithful(name: str, r, exact, magnitude, k, oracle) -> dict:
    stats = faithfulness(r, exact, magnitude, k, oracle)
    assert stats["violations"] == 0, (
        f"{name}: {stats['violations']} elements beyond one rounding of an FP32 sum ({stats})"
    )
    # different FP32 summation orders round to different half values only near ties
    assert stats["over_1_ulp"] <= 0.01, f"{name}: {stats}"
    return stats


def _mm_terms(a, b):
    """exact and sum(|terms|) of a @ b, in FP64."""
    return a.double() @ b.double(), a.double().abs() @ b.double().abs()


# ------------------------------------------------------------------ the check can fail


def _blocked_half_accumulation(a, b, block):
    """a @ b with the running sum rounded to the half dtype after every ``block`` terms."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
    for k0 in range(0, a.shape[1], block):
        acc = (acc.float() + a[:, k0 : k0 + block].float() @ b[k0 : k0 + block].float()).to(a.dtype)
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=ids.get)
def test_the_check_accepts_one_rounding_and_rejects_half_accumulation(dtype):
    a, b = rnd(64, 256, dtype=dtype, seed=1), rnd(256, 48, dtype=dtype, seed=2)
    exact, magnitude = _mm_terms(a, b)
    oracle = (a.float() @ b.float()).to(dtype)
    assert faithfulness(oracle, exact, magnitude, 256, oracle) == {"violations": 0, "max_ulp": 0, "over_1_ulp": 0.0}
    # the FP32 sum in another order (reversed k) rounded once: still faithful, rarely 1 ulp off
    reordered = (a.float().flip(1) @ b.float().flip(0)).to(dtype)
    assert faithfulness(reordered, exact, magnitude, 256, oracle)["violations"] == 0
    # partial sums rounded to half every 32 or every 1 terms: caught
    for block in (32, 1):
        stats = faithfulness(_blocked_half_accumulation(a, b, block), exact, magnitude, 256, oracle)
        assert stats["violations"] > 0 and stats["max_ulp"] > 1, (block, stats)
    # products rounded to half before an FP32 sum: caught as well (BF16 products need 16 bits)
    if dtype is torch.bfloat16:
        rounded_products = (a.float().unsqueeze(2) * b.float().unsqueeze(0)).to(dtype).float().sum(1).to(dtype)
        assert faithfulness(rounded_products, exact, magnitude, 256, oracle)["violations"] > 0


# ------------------------------------------------------------------ native paths


def _native_or_skip(dtype) -> CpuPath:
    path = cpu_half_path(dtype)
    if not path.native:
        pytest.skip(
            f"auto runs {ids[dtype].upper()} {path.reason} on this CPU ({cpu_features().model}); "
            "the emulated path is tested bit for bit in test_emulation.py"
        )
    return path


def _grads_native_and_oracle(fn, inputs, g):
    """Native half forward and gradients, and the FP32-rounded-once oracle of each."""
    dt = inputs[0].dtype
    half = [t.detach().clone().requires_grad_(True) for t in inputs]
    full = [t.detach().float().requires_grad_(True) for t in inputs]
    out = fn(*half)
    out.backward(g)
    ref = fn(*full)
    ref.backward(g.float())
    return [out.detach()] + [t.grad for t in half], [ref.detach().to(dt)] + [t.grad.to(dt) for t in full]


@pytest.mark.parametrize("dtype", DTYPES, ids=ids.get)
@pytest.mark.parametrize("op", ["mm", "linear", "bmm"])
def test_native_matmuls_are_faithful(dtype, op):
    _native_or_skip(dtype)
    assert not CpuHalfEmulation.is_active()
    m, k, n = 96, 320, 80
    if op == "bmm":
        a, b = rnd(3, m, k, dtype=dtype, seed=3), rnd(3, k, n, dtype=dtype, seed=4)
        inputs, fn = [a, b], torch.bmm
    elif op == "mm":
        a, b = rnd(m, k, dtype=dtype, seed=3), rnd(k, n, dtype=dtype, seed=4)
        inputs, fn = [a, b], torch.mm
    else:  # x @ w.T + bias
        a, b, c = rnd(m, k, dtype=dtype, seed=3), rnd(n, k, dtype=dtype, seed=4), rnd(n, dtype=dtype, seed=5)
        inputs, fn = [a, b, c], F.linear
    out_shape = fn(*[t.float() for t in inputs]).shape
    g = rnd(*out_shape, dtype=dtype, seed=6)
    native, oracle = _grads_native_and_oracle(fn, inputs, g)
    a64, b64, g64 = inputs[0].double(), inputs[1].double(), g.double()

    def t(x):
        return x.transpose(-2, -1)

    if op == "linear":
        c64 = inputs[2].double()
        checks = [
            ("forward", a64 @ t(b64) + c64, a64.abs() @ t(b64).abs() + c64.abs(), k + 1),
            ("grad x", g64 @ b64, g64.abs() @ b64.abs(), n),
            ("grad w", t(g64) @ a64, t(g64).abs() @ a64.abs(), m),
            ("grad bias", g64.sum(0), g64.abs().sum(0), m),
        ]
    else:
        checks = [
            ("forward", a64 @ b64, a64.abs() @ b64.abs(), k),
            ("grad a", g64 @ t(b64), g64.abs() @ t(b64).abs(), n),
            ("grad b", t(a64) @ g64, t(a64).abs() @ g64.abs(), m),
        ]
    for (name, exact, magnitude, terms), r, o in zip(checks, native, oracle):
        stats = assert_faithful(f"{op} {name}", r, exact, magnitude, terms, o)
        print(f"{op} {name}: max {stats['max_ulp']} ulp from the oracle, {100 * stats['over_1_ulp']:.3f}% > 1 ulp")


@pytest.mark.parametrize("dtype", DTYPES, ids=ids.get)
def test_native_conv2d_is_faithful(dtype):
    _native_or_skip(dtype)
    x, w, bias = (
        rnd(4, 16, 12, 12, dtype=dtype, seed=7),
        rnd(24, 16, 3, 3, dtype=dtype, seed=8),
        rnd(24, dtype=dtype, seed=9),
    )
    kw = dict(padding=1)
    g = rnd(4, 24, 12, 12, dtype=dtype, seed=10)
    native, oracle = _grads_native_and_oracle(lambda x, w, b: F.conv2d(x, w, b, **kw), [x, w, bias], g)

    def conv64(x, w, b):
        return F.conv2d(x, w, b, **kw)

    x64, w64, b64, g64 = x.double(), w.double(), bias.double(), g.double()
    exact = conv64(x64, w64, b64)
    magnitude = conv64(x64.abs(), w64.abs(), b64.abs())
    # gradients: the exact ones, and the same with every operand replaced by its magnitude
    xs, ws = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    gx, gw = torch.autograd.grad(conv64(xs, ws, b64), (xs, ws), g64)
    xa, wa = x64.abs().requires_grad_(), w64.abs().requires_grad_()
    mx, mw = torch.autograd.grad(conv64(xa, wa, None), (xa, wa), g64.abs())
    checks = [
        ("forward", exact, magnitude, 16 * 9 + 1),
        ("grad x", gx, mx, 24 * 9),
        ("grad w", gw, mw, 4 * 12 * 12),
        ("grad bias", g64.sum((0, 2, 3)), g64.abs().sum((0, 2, 3)), 4 * 12 * 12),
    ]
    for (name, ex, mag, terms), r, o in zip(checks, native, oracle):
        stats = assert_faithful(f"conv2d {name}", r, ex, mag, terms, o)
        print(f"conv2d {name}: max {stats['max_ulp']} ulp from the oracle, {100 * stats['over_1_ulp']:.3f}% > 1 ulp")


# ------------------------------------------------------------------ what auto picks


F16, BF16 = torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "name,features,bf16_native,fp16_native",
    [
        ("AVX2 (this project's AMD EPYC)", _features(capability="AVX2", onednn_bf16=False), False, False),
        ("AVX512 without BF16 units (Ice Lake)", _features(), False, False),
        ("avx512_bf16 (Cooper Lake, Zen 4)", _features(avx512_bf16=True), True, False),
        (
            "AMX-BF16 + avx512_fp16 (Sapphire Rapids): FP16 emulated, native FP16 is no faster",
            _features(avx512_bf16=True, amx_bf16=True, avx512_fp16=True, onednn_fp16=True),
            True,
            False,
        ),
        (
            "AMX-FP16 (Granite Rapids)",
            _features(avx512_bf16=True, amx_bf16=True, avx512_fp16=True, amx_fp16=True, onednn_fp16=True),
            True,
            True,
        ),
        ("avx512_bf16, torch without oneDNN BF16", _features(avx512_bf16=True, onednn_bf16=False), False, False),
    ],
)
def test_auto_picks_per_dtype_and_cpu(simulate, name, features, bf16_native, fp16_native):
    simulate(features)
    bf16, fp16 = cpu_half_path(BF16), cpu_half_path("fp16")
    assert (bf16.native, fp16.native) == (bf16_native, fp16_native), (name, bf16, fp16)
    assert bf16.dtype is BF16 and fp16.dtype is F16
    for path in (bf16, fp16):
        assert path.reason.startswith("native (" if path.native else "emulated (")
    assert should_emulate("cpu", "bf16-mixed") is (not bf16_native)
    assert should_emulate("cpu", torch.float16) is (not fp16_native)
    assert should_emulate("cuda", torch.bfloat16) is False and should_emulate("cpu", "fp32") is False
    expected = {dt for dt, native in ((BF16, bf16_native), (F16, fp16_native)) if not native}
    assert CpuHalfEmulation(dtypes="auto").dtypes == expected


def test_reasons_name_the_unit(simulate):
    simulate(_features(avx512_bf16=True))
    assert cpu_half_path(BF16).reason == "native (avx512_bf16)"
    assert cpu_half_path(F16).reason.startswith("emulated (no native FP16 GEMM")
    simulate(_features(avx512_bf16=True, amx_bf16=True, avx512_fp16=True, onednn_fp16=True))
    assert cpu_half_path(BF16).reason == "native (AMX-BF16)"
    assert cpu_half_path(F16).reason.startswith("emulated (avx512_fp16 without AMX-FP16")
    simulate(_features(avx512_bf16=True, amx_bf16=True, amx_fp16=True, onednn_fp16=True))
    assert cpu_half_path(BF16).reason == "native (AMX-BF16)"
    assert cpu_half_path(F16).reason == "native (AMX-FP16)"


def test_disabling_onednn_falls_back_to_emulation(simulate, monkeypatch):
    simulate(_features(avx512_bf16=True))
    assert cpu_half_path(BF16).native
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not cpu_half_path(BF16).native and "disabled" in cpu_half_path(BF16).reason


def test_this_cpu(capsys):
    """What the probe sees here agrees with torch's own probes; without BF16/FP16 units both
    dtypes are emulated (this project's AMD EPYC: AVX2, FMA, F16C; no avx512)."""
    f = cpu_features()
    assert f is cpu_features()  # probed once
    assert f.capability == torch.backends.cpu.get_cpu_capability()
    assert f.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert f.amx_fp16 == torch.cpu._is_amx_fp16_supported()
    assert f.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if not (f.avx512_bf16 or f.amx_bf16):
        assert not cpu_half_path(BF16).native and should_emulate("cpu", BF16)
    if not (f.avx512_fp16 or f.amx_fp16):
        assert not cpu_half_path(F16).native and should_emulate("cpu", F16)
    with capsys.disabled():
        print(
            f"\n{f.model} ({f.capability}; half units: {f.flags()}): "
            f"BF16 {cpu_half_path(BF16).reason}, FP16 {cpu_half_path(F16).reason}"
        )


def test_the_decision_is_cached(simulate, monkeypatch):
    calls = []

    def detect():
        calls.append(1)
        return _features(avx512_bf16=True)

    monkeypatch.setattr(_cpu, "_detect", detect)
    _cpu._clear_cache()
    for _ in range(3):
        cpu_half_path(BF16), cpu_half_path(F16), should_emulate("cpu", "bf16")
    assert len(calls) == 1


def test_bad_dtype_is_named():
    with pytest.raises(
        ValueError, match=r"dtype=torch.float32 is not allowed: expected torch.float16 or torch.bfloat16"
    ):
        cpu_half_path(torch.float32)
    with pytest.raises(ValueError, match=r"dtype='fp8'"):
        cpu_half_path("fp8")
