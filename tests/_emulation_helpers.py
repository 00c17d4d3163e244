"""Shared oracles of the emulation tests (their fixtures are in conftest.py)."""

from __future__ import annotations

import torch

from amp_plugin.emulation import CpuHalfEmulation

DTYPES = [torch.float16, torch.bfloat16]
ids = {torch.float16: "fp16", torch.bfloat16: "bf16"}
BACKENDS = ["kernel", "mode"]


def rnd(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def leaves(tensors):
    """Half leaves with grad and their FP32 upcast twins."""
    half = [t.detach().clone().requires_grad_(True) for t in tensors]
    full = [t.detach().float().requires_grad_(True) for t in tensors]
    return half, full


def assert_bitwise(actual, expected, what=""):
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    # equal() is False for NaN; compare bit patterns through a same-size integer view
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    ok = torch.equal(actual.contiguous().view(bits), expected.contiguous().view(bits))
    if not ok:
        diff = (actual.float() - expected.float()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal (max abs diff {diff})")


def check_against_fp32(fn, inputs, dtype, backend, grad=True, seed=0):
    """Run ``fn`` emulated on half leaves and in FP32 on upcast leaves; compare the
    rounded FP32 forward and rounded FP32 gradients bitwise. Returns the emulator."""
    half, full = leaves(inputs)
    emu = CpuHalfEmulation(backend=backend)
    with emu:
        out = fn(*half)
        if grad:
            g = rnd(*out.shape, dtype=dtype, seed=seed + 1)
            out.backward(g)
    ref = fn(*full)
    assert_bitwise(out, ref.to(dtype), "forward")
    if grad:
        ref.backward(g.float())
        for i, (h, f) in enumerate(zip(half, full)):
            if h.grad is None:
                assert f.grad is None
                continue
            assert_bitwise(h.grad, f.grad.to(dtype), f"grad of input {i}")
    return emu


def simulated_cpu(**flags):
    """CPU features to pretend to have (an AVX512 CPU without half-precision units, plus ``flags``);
    pass them to the ``simulate`` fixture of ``conftest.py``."""
    from amp_plugin.emulation import _cpu

    base = dict(
        model="simulated",
        capability="AVX512",
        avx512_bf16=False,
        amx_bf16=False,
        avx512_fp16=False,
        amx_fp16=False,
        onednn_bf16=True,
        onednn_fp16=False,
    )
    base.update(flags)
    return _cpu.CpuFeatures(**base)
