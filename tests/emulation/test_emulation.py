"""CpuHalfEmulation: each covered op equals "upcast, FP32 op, round once", bit for bit.

Oracles. For a single covered op the emulated result is ``op(fp32 operands).to(dtype)``,
so the forward oracle is the same op on FP32 copies of the half inputs, rounded once. The
gradients of a covered op are computed by covered ops (the backward of ``mm`` is two
``mm`` calls on half tensors), each rounded once, so the gradient oracle is the FP32
autograd gradient on upcast leaf copies with the upcast half ``grad_output``, rounded
once: e.g. ``grad_a == (grad_out.float() @ b.float().t()).to(dtype)``. Where autograd
adds a non-matmul op (the bias gradient of ``linear`` is a ``sum``, a broadcast batch
dimension is summed away) that op runs natively in half, and the oracle mirrors it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _emulation_helpers import BACKENDS, DTYPES, assert_bitwise, check_against_fp32, leaves, rnd
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_plugin.emulation import CpuHalfEmulation

# ------------------------------------------------------------------ matmul family


def test_mm(dtype, backend):
    a, b = rnd(5, 7, dtype=dtype, seed=1), rnd(7, 3, dtype=dtype, seed=2)
    emu = check_against_fp32(torch.mm, [a, b], dtype, backend)
    # forward mm + two backward mm, nothing else
    assert emu.emulated_calls == {"aten.mm.default": 3}


def test_mm_gradient_oracle_explicit(dtype, backend):
    a = rnd(4, 6, dtype=dtype, seed=3).requires_grad_()
    b = rnd(6, 5, dtype=dtype, seed=4).requires_grad_()
    g = rnd(4, 5, dtype=dtype, seed=5)
    with CpuHalfEmulation(backend=backend):
        (a @ b).backward(g)
    assert_bitwise(a.grad, (g.float() @ b.detach().float().t()).to(dtype), "grad_a")
    assert_bitwise(b.grad, (a.detach().float().t() @ g.float()).to(dtype), "grad_b")


@pytest.mark.parametrize("beta,alpha", [(1.0, 1.0), (0.5, 2.0)])
def test_addmm(dtype, beta, alpha, backend):
    # beta/alpha powers of two: the backward's scalings are exact, so the FP32 autograd
    # oracle is still exact; the bias gradient (beta * grad_out) needs no reduction here.
    c, a, b = rnd(4, 3, dtype=dtype, seed=6), rnd(4, 5, dtype=dtype, seed=7), rnd(5, 3, dtype=dtype, seed=8)
    emu = check_against_fp32(lambda c, a, b: torch.addmm(c, a, b, beta=beta, alpha=alpha), [c, a, b], dtype, backend)
    assert emu.emulated_calls["aten.addmm.default"] == 1


def test_addmm_forward_arbitrary_scalars(dtype, backend):
    c, a, b = rnd(3, 4, dtype=dtype, seed=9), rnd(3, 6, dtype=dtype, seed=10), rnd(6, 4, dtype=dtype, seed=11)
    with CpuHalfEmulation(backend=backend):
        out = torch.addmm(c, a, b, beta=0.3, alpha=1.7)
    ref = 0.3 * c.float() + 1.7 * (a.float() @ b.float())
    expected = torch.addmm(c.float(), a.float(), b.float(), beta=0.3, alpha=1.7).to(dtype)
    assert_bitwise(out, expected, "addmm")
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_bmm(dtype, backend):
    a, b = rnd(3, 4, 6, dtype=dtype, seed=12), rnd(3, 6, 2, dtype=dtype, seed=13)
    emu = check_against_fp32(torch.bmm, [a, b], dtype, backend)
    assert emu.emulated_calls == {"aten.bmm.default": 3}


def test_baddbmm(dtype, backend):
    c, a, b = rnd(2, 3, 5, dtype=dtype, seed=14), rnd(2, 3, 4, dtype=dtype, seed=15), rnd(2, 4, 5, dtype=dtype, seed=16)
    check_against_fp32(lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0), [c, a, b], dtype, backend)
    with CpuHalfEmulation(backend=backend):
        out = torch.baddbmm(c, a, b, beta=0.7, alpha=1.3)
    assert_bitwise(out, torch.baddbmm(c.float(), a.float(), b.float(), beta=0.7, alpha=1.3).to(dtype))


def test_matmul_folds_batch_into_mm(dtype, backend):
    a, b = rnd(2, 4, 3, dtype=dtype, seed=17), rnd(3, 5, dtype=dtype, seed=18)
    emu = check_against_fp32(torch.matmul, [a, b], dtype, backend)
    assert set(emu.emulated_calls) == {"aten.mm.default"}


def test_matmul_broadcast_batch(dtype, backend):
    a, b = rnd(2, 1, 4, 3, dtype=dtype, seed=19), rnd(3, 3, 5, dtype=dtype, seed=20)
    g = rnd(2, 3, 4, 5, dtype=dtype, seed=21)
    ah, bh = a.clone().requires_grad_(), b.clone().requires_grad_()
    with CpuHalfEmulation(backend=backend) as emu:
        out = ah @ bh
        out.backward(g)
    assert_bitwise(out, (a.float() @ b.float()).to(dtype), "forward")
    assert set(emu.emulated_calls) == {"aten.bmm.default"}
    # autograd: bmm on the expanded, flattened operands (rounded once), then the broadcast
    # dimension is summed away by a native half sum
    a6 = a.expand(2, 3, 4, 3).reshape(6, 4, 3).float()
    b6 = b.expand(2, 3, 3, 5).reshape(6, 3, 5).float()
    g6 = g.reshape(6, 4, 5).float()
    grad_a = torch.bmm(g6, b6.transpose(1, 2)).to(dtype).view(2, 3, 4, 3).sum(1, keepdim=True)
    grad_b = torch.bmm(a6.transpose(1, 2), g6).to(dtype).view(2, 3, 3, 5).sum(0)
    assert_bitwise(ah.grad, grad_a, "grad_a")
    assert_bitwise(bh.grad, grad_b, "grad_b")


def test_matmul_vector_cases(dtype, backend):
    m, v, w = rnd(4, 6, dtype=dtype, seed=22), rnd(6, dtype=dtype, seed=23), rnd(6, dtype=dtype, seed=24)
    with CpuHalfEmulation(backend=backend) as emu:
        mv, dot = m @ v, v @ w
    assert_bitwise(mv, (m.float() @ v.float()).to(dtype), "mv")
    assert_bitwise(dot, (v.float() @ w.float()).to(dtype), "dot")
    assert emu.emulated_calls == {"aten.mv.default": 1, "aten.dot.default": 1}


@pytest.mark.parametrize(
    "backend,batch,bias",
    [("kernel", batch, bias) for batch in [(5,), (2, 3)] for bias in (True, False)]
    + [("mode", (5,), False), ("mode", (2, 3), True)],
)
def test_linear(dtype, backend, batch, bias):
    x = rnd(*batch, 6, dtype=dtype, seed=25)
    w = rnd(4, 6, dtype=dtype, seed=26)
    b = rnd(4, dtype=dtype, seed=27)
    g = rnd(*batch, 4, dtype=dtype, seed=28)
    inputs = [x, w, b] if bias else [x, w]
    half, full = leaves(inputs)
    with CpuHalfEmulation(backend=backend) as emu:
        out = F.linear(*half)
        out.backward(g)
    ref = F.linear(*full)
    ref.backward(g.float())
    assert_bitwise(out, ref.to(dtype), "forward")
    assert_bitwise(half[0].grad, full[0].grad.to(dtype), "grad_x")
    assert_bitwise(half[1].grad, full[1].grad.to(dtype), "grad_w")
    if bias:
        # the bias gradient is a plain (native, half) sum over the batch
        assert_bitwise(half[2].grad, g.reshape(-1, 4).sum(0), "grad_bias")
        assert emu.emulated_calls == {"aten.addmm.default": 1, "aten.mm.default": 2}
    else:
        assert emu.emulated_calls == {"aten.mm.default": 3}


def test_out_and_inplace_variants(dtype, backend):
    a, b, c = rnd(3, 4, dtype=dtype, seed=29), rnd(4, 5, dtype=dtype, seed=30), rnd(3, 5, dtype=dtype, seed=31)
    out = torch.empty(3, 5, dtype=dtype)
    c2 = c.clone()
    with CpuHalfEmulation(backend=backend) as emu:
        r = torch.mm(a, b, out=out)
        c2.addmm_(a, b, beta=0.5, alpha=0.25)
    assert r is out
    assert_bitwise(out, (a.float() @ b.float()).to(dtype), "mm.out")
    assert_bitwise(c2, torch.addmm(c.float(), a.float(), b.float(), beta=0.5, alpha=0.25).to(dtype), "addmm_")
    assert emu.emulated_calls == {"aten.mm.out": 1, "aten.addmm_.default": 1}


def test_large_operands_reuse_fp32_buffers(dtype, backend):
    # operands above the scratch threshold are upcast into reused FP32 buffers, with
    # their strides kept (w.t() stays a transposed view): still bitwise the oracle
    from amp_plugin.emulation import _backends
    from amp_plugin.emulation import _ops as emulation

    def buffers_held() -> int:
        held = len(emulation.thread_state.scratch)  # the Python kernels' buffers, then the C++ kernels'
        return held + (
            torch.ops.amp_plugin.emulation_sync(None)[-1] if hasattr(torch.ops.amp_plugin, "emulation_sync") else 0
        )

    x, w, b = rnd(200, 192, dtype=dtype, seed=80), rnd(176, 192, dtype=dtype, seed=81), rnd(176, dtype=dtype, seed=82)
    assert x.numel() >= emulation.SCRATCH_MIN_NUMEL and w.numel() >= emulation.SCRATCH_MIN_NUMEL
    half, full = leaves([x, w, b])
    g = rnd(200, 176, dtype=dtype, seed=83)
    with CpuHalfEmulation(backend=backend) as emu:
        out = F.linear(*half)
        out.backward(g)
        out2 = half[0].detach() @ half[1].detach().t()  # buffers reused by a second call
        _backends.native_sync()  # fold the C++ kernels' counts in before reading the buffers
        native = _backends.KernelOverrides.native is not None
        # held while the context is on: x's and w's (b is too small), and in C++ the FP32 result's
        assert buffers_held() == (3 if native else 2)
    assert buffers_held() == 0  # and dropped when it ends
    ref = F.linear(*full)
    ref.backward(g.float())
    assert_bitwise(out, ref.to(dtype), "forward")
    assert_bitwise(out2, (x.float() @ w.float().t()).to(dtype), "second call")
    assert_bitwise(half[0].grad, full[0].grad.to(dtype), "grad_x")
    assert_bitwise(half[1].grad, full[1].grad.to(dtype), "grad_w")
    assert emu.emulated_calls == {"aten.addmm.default": 1, "aten.mm.default": 3}


def test_reused_buffers_never_serve_stale_values(dtype, backend):
    # large operands go through reused FP32 buffers: in-place changes, new tensors (perhaps
    # at a freed tensor's address) and transposed views of the same tensors all upcast afresh
    a, w = rnd(256, 160, dtype=dtype, seed=88), rnd(160, 256, dtype=dtype, seed=89)
    a0 = a.clone()
    with CpuHalfEmulation(backend=backend):
        first = a @ w
        w.mul_(-2)
        second = a @ w
        a = rnd(256, 160, dtype=dtype, seed=90)
        third = a @ w
        fourth = (w.t() @ a.t()).t()
    assert_bitwise(second, (a0.float() @ w.float()).to(dtype), "after mul_")
    assert_bitwise(third, (a.float() @ w.float()).to(dtype), "new tensor")
    assert_bitwise(fourth, (w.float().t() @ a.float().t()).to(dtype).t(), "transposed views")
    assert not torch.equal(first, second)


def test_inference_mode(dtype, backend):
    # without autograd, composite ops (matmul, linear, conv2d) reach the interception
    # undecomposed; they are still emulated
    x, w = rnd(3, 5, dtype=dtype, seed=84), rnd(4, 5, dtype=dtype, seed=85)
    img, k = rnd(1, 2, 6, 6, dtype=dtype, seed=86), rnd(3, 2, 3, 3, dtype=dtype, seed=87)
    with CpuHalfEmulation(backend=backend) as emu, torch.inference_mode():
        lin, mat, conv = F.linear(x, w), x @ w.t(), F.conv2d(img, k)
    assert_bitwise(lin, F.linear(x.float(), w.float()).to(dtype), "linear")
    assert_bitwise(mat, (x.float() @ w.float().t()).to(dtype), "matmul")
    assert_bitwise(conv, F.conv2d(img.float(), k.float()).to(dtype), "conv2d")
    assert emu.emulated_calls == {"aten.mm.default": 2, "aten.convolution.default": 1}


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(1, 9),
    k=st.integers(1, 40),
    n=st.integers(1, 9),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    dt=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    backend=st.sampled_from(BACKENDS),
)
def test_mm_property(m, k, n, scale, dt, seed, backend):
    a, b = rnd(m, k, dtype=dt, scale=scale, seed=seed), rnd(k, n, dtype=dt, scale=scale, seed=seed + 1)
    with CpuHalfEmulation(backend=backend):
        out = a @ b
    assert_bitwise(out, (a.float() @ b.float()).to(dt))


# ------------------------------------------------------------------ convolution


CONV_CASES = {  # name: (fn, input shape, weight shape, kwargs, bias)
    "conv1d_bias": (F.conv1d, (2, 4, 9), (6, 4, 3), dict(stride=1, padding=1), True),
    "conv1d_stride_groups": (F.conv1d, (1, 4, 10), (4, 2, 3), dict(stride=2, padding=2, groups=2), False),
    "conv2d_bias": (F.conv2d, (2, 3, 6, 5), (4, 3, 3, 3), dict(stride=1, padding=1), True),
    "conv2d_nobias": (F.conv2d, (2, 3, 6, 5), (4, 3, 3, 3), dict(padding=0), False),
    "conv2d_stride_groups_bias": (
        F.conv2d,
        (1, 4, 7, 7),
        (6, 2, 3, 2),
        dict(stride=(2, 1), padding=(1, 0), groups=2),
        True,
    ),
    "conv2d_dilation": (F.conv2d, (1, 2, 7, 7), (3, 2, 3, 3), dict(dilation=2), False),
    "conv_transpose2d_bias": (F.conv_transpose2d, (1, 4, 4, 4), (4, 3, 3, 3), dict(stride=2, padding=1), True),
}


# every case with the default backend, a sample with the other one
CONV_PARAMS = [("kernel", case) for case in CONV_CASES] + [
    ("mode", case) for case in ("conv1d_stride_groups", "conv2d_stride_groups_bias", "conv_transpose2d_bias")
]


@pytest.mark.parametrize("backend,case", CONV_PARAMS)
def test_convolution(dtype, backend, case):
    """The convolution in FP32, rounded once; then, as cuDNN does, the bias added in the half
    dtype (a second rounding). Gradients: FP32 kernels rounded once (the bias gradient is an
    FP32 sum rounded once, as the GPU's reduction over a half gradient)."""
    fn, xs, ws, kw, bias = CONV_CASES[case]
    out_ch = ws[1] * kw.get("groups", 1) if fn is F.conv_transpose2d else ws[0]
    inputs = [rnd(*xs, dtype=dtype, seed=40), rnd(*ws, dtype=dtype, seed=41)]
    if bias:
        inputs.append(rnd(out_ch, dtype=dtype, seed=42))
    half, full = leaves(inputs)
    g = rnd(*fn(*full[:2], **kw).shape, dtype=dtype, seed=43)
    with CpuHalfEmulation(backend=backend) as emu:
        out = fn(*half, **kw)
        out.backward(g)
    expected = fn(*full[:2], **kw).to(dtype)
    if bias:
        expected = expected + inputs[2].view(1, -1, *([1] * (expected.dim() - 2)))  # a half add
    assert_bitwise(out, expected, "forward")
    ref = fn(*full, **kw)
    ref.backward(g.float())
    for i, (h, f) in enumerate(zip(half, full)):
        assert_bitwise(h.grad, f.grad.to(dtype), f"grad of input {i}")
    assert emu.emulated_calls == {"aten.convolution.default": 1, "aten.convolution_backward.default": 1}


@pytest.mark.parametrize("dtype_case", ["fp16", "bf16"])
def test_conv_bias_is_added_after_rounding_as_on_the_gpu(dtype_case, backend):
    # conv = 1 + u/2 (u: the half ulp at 1) is a tie and rounds to 1; adding the bias u/4
    # to the rounded 1 gives 1 again (cuDNN: round, then add in half), while one rounding
    # of 1 + u/2 + u/4 would give 1 + u.
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_case]
    u = torch.finfo(dt).eps
    x = torch.tensor([[[1.0], [u / 2]]], dtype=dt)  # (batch 1, 2 channels, length 1)
    w = torch.ones(1, 2, 1, dtype=dt)
    b = torch.tensor([u / 4], dtype=dt)
    assert F.conv1d(x.float(), w.float()).item() == 1 + u / 2  # exact in FP32
    with CpuHalfEmulation(backend=backend):
        out = F.conv1d(x, w, b)
    assert out.item() == 1.0
    assert F.conv1d(x.float(), w.float(), b.float()).to(dt).item() == 1 + u  # what one rounding gives


# ------------------------------------------------------------------ attention

SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def flash_reference(q, k, v, mask=None, causal=False, scale=None):
    """A GPU flash-attention kernel's numerics, written out: FP32 scores, the unnormalised
    probabilities exp(S - rowmax) rounded to the half dtype for the P @ V product, the
    FP32 result divided by the FP32 row sum and rounded once; logsumexp in FP32."""
    dt = q.dtype
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q.float() @ k.float().transpose(-2, -1) * scale
    if mask is not None:
        s = s + (torch.zeros(mask.shape).masked_fill(~mask, -math.inf) if mask.dtype is torch.bool else mask.float())
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    row_max = s.amax(-1, keepdim=True)
    e = torch.exp(s - row_max)
    row_sum = e.sum(-1, keepdim=True)
    out = (e.to(dt).float() @ v.float()) / row_sum
    return out.to(dt), (row_max + row_sum.log()).squeeze(-1)


def flash_backward_reference(g, q, k, v, out, lse, mask=None, causal=False, scale=None):
    """FlashAttention-2's backward numerics: P = exp(S - lse) rounded to half for dV = P^T dO,
    dS = P * (dP - rowsum(dO * O)) rounded to half for dQ = scale dS K and dK = scale dS^T Q;
    every GEMM accumulates in FP32 and each gradient is rounded once."""
    dt = q.dtype
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q32, k32, v32, g32 = q.float(), k.float(), v.float(), g.float()
    s = q32 @ k32.transpose(-2, -1) * scale
    if mask is not None:
        s = s + mask.float()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - lse.unsqueeze(-1))
    grad_v = p.to(dt).float().transpose(-2, -1) @ g32
    d = (g32 * out.float()).sum(-1, keepdim=True)
    ds = p * (g32 @ v32.transpose(-2, -1) - d)
    ds_half = ds.to(dt).float()
    grad_q = ds_half @ k32 * scale
    grad_k = ds_half.transpose(-2, -1) @ q32 * scale
    return grad_q.to(dt), grad_k.to(dt), grad_v.to(dt)


@pytest.mark.parametrize(
    "backend,variant",
    [
        ("kernel", "plain"),
        ("kernel", "causal"),
        ("kernel", "float_mask"),
        ("kernel", "bool_mask"),
        ("kernel", "scale"),
        ("mode", "float_mask"),
    ],
)
def test_sdpa(dtype, backend, variant):
    q, k, v = (rnd(2, 2, 5, 8, dtype=dtype, seed=50 + i) for i in range(3))
    mask = rnd(5, 5, dtype=dtype, seed=53) if variant == "float_mask" else None
    if variant == "bool_mask":
        mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(53)) > 0.3
        mask[:, 0] = True  # no fully masked row (see test_sdpa_fully_masked_rows)
    causal = variant == "causal"
    scale = 0.3 if variant == "scale" else None
    g = rnd(2, 2, 5, 8, dtype=dtype, seed=54)
    (qh, kh, vh), _ = leaves([q, k, v])
    with CpuHalfEmulation(backend=backend) as emu:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale)
        out.backward(g)
    assert emu.emulated_calls == {str(SDPA): 1, str(SDPA_BWD): 1}
    ref, lse = flash_reference(q, k, v, mask, causal, scale)
    assert_bitwise(out, ref, "forward")
    add_mask = None  # F.scaled_dot_product_attention makes a boolean mask additive before the kernel
    if mask is not None:
        add_mask = torch.zeros(mask.shape).masked_fill(~mask, -math.inf).to(dtype) if mask.dtype is torch.bool else mask
    with CpuHalfEmulation(backend=backend):
        _, emulated_lse = SDPA(q, k, v, 0.0, causal, attn_mask=add_mask, scale=scale)
    assert_bitwise(emulated_lse, lse, "logsumexp")
    grads = flash_backward_reference(g, q, k, v, out.detach(), lse, add_mask, causal, scale)
    for name, h, r in zip("qkv", (qh, kh, vh), grads):
        assert_bitwise(h.grad, r, f"grad_{name}")


def test_sdpa_rounds_the_probabilities_before_the_value_product(dtype, backend):
    # One query, two keys with scores 0 and -1 (scale 1): the unnormalised probabilities are
    # 1 and e = exp(-1). With v = (-8 * round(e), 8) the value product cancels exactly when e
    # is first rounded to the half dtype, as on the GPU: the output is exactly 0. Without
    # that rounding it is (8 * (e - round(e))) / (1 + e), hundreds of half ulps away from 0.
    e_half = torch.tensor(math.exp(-1.0)).to(dtype).item()
    q = torch.ones(1, 1, 1, 1, dtype=dtype)
    k = torch.tensor([0.0, -1.0], dtype=dtype).view(1, 1, 2, 1)
    v = torch.tensor([-8 * e_half, 8.0], dtype=dtype).view(1, 1, 2, 1)  # exact: 8 times a half value
    with CpuHalfEmulation(backend=backend):
        out = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    assert out.item() == 0.0
    unrounded = 8 * (math.exp(-1.0) - e_half) / (1 + math.exp(-1.0))
    assert abs(unrounded) > 1e-4  # some 400 (FP16) or 8000 (BF16) half ulps at this size
    fp32_kernel = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=1.0).item()
    assert fp32_kernel == pytest.approx(unrounded, rel=1e-3)  # what the FP32 kernel, rounded once, is near


def test_sdpa_fully_masked_rows(dtype, backend):
    # as the native CPU kernel: a row with every key masked gives output 0 and logsumexp 0
    q, k, v = (rnd(1, 2, 3, 4, dtype=dtype, seed=56 + i) for i in range(3))
    mask = torch.zeros(3, 3)
    mask[1] = -math.inf
    with CpuHalfEmulation(backend=backend):
        out, lse = SDPA(q, k, v, 0.0, False, attn_mask=mask.to(dtype))
    _native32, native_lse = SDPA(q.float(), k.float(), v.float(), 0.0, False, attn_mask=mask)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1])) and torch.equal(lse[:, :, 1], native_lse[:, :, 1])
    assert not out.isnan().any()


def test_sdpa_blocks_of_query_rows_agree(dtype, monkeypatch):
    # long sequences are processed a block of query rows at a time: the same roundings
    from amp_plugin.emulation import _attention

    q, k, v = (rnd(1, 2, 9, 8, dtype=dtype, seed=60 + i) for i in range(3))
    g = rnd(1, 2, 9, 8, dtype=dtype, seed=63)

    def run():
        (qh, kh, vh), _ = leaves([q, k, v])
        with CpuHalfEmulation():
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            out.backward(g)
        return [out.detach(), qh.grad, kh.grad, vh.grad]

    whole = run()
    monkeypatch.setattr(_attention, "_BLOCK_ELEMENTS", 2 * 9 * 2)  # two query rows per block
    blocks = run()
    for a, b in zip(whole, blocks):
        assert (a.float() - b.float()).abs().max() <= 2 * torch.finfo(dtype).eps * b.float().abs().max()


def test_sdpa_dropout_math_path_is_left_alone(backend):
    # with dropout, CPU SDPA takes the math path, which already upcasts half to FP32
    q = rnd(1, 1, 4, 8, dtype=torch.float16, seed=55)
    with CpuHalfEmulation(backend=backend) as emu:
        out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert out.dtype == torch.float16
    assert emu.emulated_calls == {}


# ------------------------------------------------------------------ recurrent layers

RNN_LAYER = torch.ops.aten.mkldnn_rnn_layer.default
RNN_LAYER_BWD = torch.ops.aten.mkldnn_rnn_layer_backward.default


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_rnn_modules_reach_covered_ops(dtype, backend, cls):
    """nn.LSTM/GRU/RNN in half: where torch does not hand them to oneDNN they are built from
    addmm/mm (emulated) and elementwise gate ops (native half); where it does (LSTM in BF16 on
    CPUs with oneDNN BF16), the oneDNN layer is emulated as a whole."""
    torch.manual_seed(0)
    rnn = cls(6, 5, batch_first=True).to(dtype)
    x = rnd(2, 4, 6, dtype=dtype, seed=90).requires_grad_()
    with CpuHalfEmulation(backend=backend) as emu:
        out = rnn(x)[0]
        out.backward(rnd(2, 4, 5, dtype=dtype, seed=91))
    calls = set(emu.emulated_calls)
    onednn = cls is torch.nn.LSTM and dtype is torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if onednn:
        assert calls == {str(RNN_LAYER), str(RNN_LAYER_BWD)}
    else:
        assert calls and calls <= {"aten.addmm.default", "aten.mm.default"}, calls
    assert x.grad is not None and x.grad.dtype is dtype


def test_onednn_lstm_layer_runs_in_fp32_and_rounds_once(dtype, backend):
    """mkldnn_rnn_layer (what nn.LSTM calls where torch routes half LSTMs to oneDNN), called
    directly: the FP32 layer on the upcast operands, outputs rounded once; the same for its
    backward, gradients rounded once."""
    seq, batch, inp, hid = 5, 2, 3, 4
    tensors = [
        rnd(seq, batch, inp, dtype=dtype, seed=92),
        rnd(4 * hid, inp, dtype=dtype, seed=93),
        rnd(4 * hid, hid, dtype=dtype, seed=94),
        rnd(4 * hid, dtype=dtype, seed=95),
        rnd(4 * hid, dtype=dtype, seed=96),
        rnd(batch, hid, dtype=dtype, seed=97),
        rnd(batch, hid, dtype=dtype, seed=98),
    ]
    flags = (False, [], 2, hid, 1, True, False, False, True)  # reverse, batch_sizes, mode=LSTM, ..., train
    with CpuHalfEmulation(backend=backend) as emu:
        out, hy, cy, workspace = RNN_LAYER(*tensors, *flags)
    ref = RNN_LAYER(*[t.float() for t in tensors], *flags)
    for name, got, want in zip(("output", "hy", "cy"), (out, hy, cy), ref[:3]):
        assert_bitwise(got, want.to(dtype), name)
    grads_out = [rnd(seq, batch, hid, dtype=dtype, seed=99), rnd(batch, hid, dtype=dtype, seed=100), None]
    bwd_flags = (False, 2, hid, 1, True, True, False, [], False)
    saved = [*tensors, out, hy, cy]
    with CpuHalfEmulation(backend=backend):
        grads = RNN_LAYER_BWD(*saved, *grads_out, *bwd_flags, workspace)
    ref_grads = RNN_LAYER_BWD(
        *[t.float() for t in saved], *[g if g is None else g.float() for g in grads_out], *bwd_flags, ref[3]
    )
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        assert_bitwise(got, want.to(dtype), f"gradient {i}")
    assert emu.emulated_calls == {str(RNN_LAYER): 1}


# ------------------------------------------------------------------ overflow and dtypes


def test_fp16_overflow_becomes_inf(backend):
    a = torch.tensor([[300.0]], dtype=torch.float16)
    with CpuHalfEmulation(backend=backend):
        assert torch.isinf(a @ a).all()  # 90000 > 65504
        # the accumulator is FP32: partial sums beyond 65504 are harmless
        x = torch.tensor([[300.0, 300.0]], dtype=torch.float16)
        y = torch.tensor([[300.0], [-300.0]], dtype=torch.float16)
        assert (x @ y).item() == 0.0
        # gradients overflow the same way
        w = torch.tensor([[300.0]], dtype=torch.float16, requires_grad=True)
        (w @ w).backward(torch.tensor([[300.0]], dtype=torch.float16))
    assert torch.isinf(w.grad).all()


def test_bf16_keeps_fp32_range(backend):
    a = torch.tensor([[300.0]], dtype=torch.bfloat16)
    with CpuHalfEmulation(backend=backend):
        out = a @ a
    assert out.item() == 90112.0  # 90000 rounded to bf16's 8-bit significand


def test_fp32_untouched(backend):
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    native = a @ b
    conv_native = F.conv1d(a[None], torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(0)))
    with CpuHalfEmulation(backend=backend) as emu:
        inside = a @ b
        conv_inside = F.conv1d(a[None], torch.randn(2, 4, 2, generator=torch.Generator().manual_seed(0)))
        d = torch.randn(3, 3, dtype=torch.float64) @ torch.randn(3, 3, dtype=torch.float64)
    assert torch.equal(native, inside) and torch.equal(conv_native, conv_inside)
    assert d.dtype == torch.float64
    assert emu.emulated_calls == {}


def test_mixed_dtypes_raise_like_native(backend):
    a, b = torch.randn(2, 2, dtype=torch.float16), torch.randn(2, 2)
    with pytest.raises(RuntimeError) as native:
        a @ b
    with CpuHalfEmulation(backend=backend), pytest.raises(RuntimeError) as inside:
        a @ b
    assert str(native.value) == str(inside.value)


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm"])
def test_wrong_shapes_raise_like_native(dtype, backend, op):
    v, m = torch.randn(4, dtype=dtype), torch.randn(4, 4, dtype=dtype)
    call = {
        "mm": lambda: torch.mm(v, m),
        "addmm": lambda: torch.addmm(m, v, m),
        "bmm": lambda: torch.bmm(m, m),
        "baddbmm": lambda: torch.baddbmm(m, m, m),
    }[op]
    with pytest.raises((RuntimeError, IndexError)) as native:
        call()
    with CpuHalfEmulation(backend=backend), pytest.raises((RuntimeError, IndexError)) as inside:
        call()
    assert type(native.value) is type(inside.value) and str(native.value) == str(inside.value)
