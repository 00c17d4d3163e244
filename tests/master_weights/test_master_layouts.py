"""Strided parameters (a channels_last convolution's weight and gradient): every step path and master kind
gives the bits of the same run on contiguous tensors, and the weight keeps its layout.

The oracle is the run without strides: the same values in logical order, where every path agrees
(``test_master_compiled.py``, ``test_master_lean.py``). A step that paired elements by their place in
memory (a channels_last FP32 value beside contiguous moments, in torch's fused Adam) updated each weight
with another element's moments and gradient."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import MasterWeightOptimizer
from amp_plugin.master_weights._step import step_kernels

BF16 = torch.bfloat16
SHAPE = (8, 4, 3, 3)
PATHS = [
    None,  # the CPU kernel
    "torch",
    False,  # the general path: the optimizer's own step on FP32 copies
    "compiled",
    pytest.param("triton", marks=pytest.mark.slow),
]


def run(fused, master, optimizer, channels_last, steps=3, device="cpu"):
    torch.manual_seed(0)
    weight = torch.randn(SHAPE).to(device, BF16)
    if channels_last:
        weight = weight.to(memory_format=torch.channels_last)
    p = torch.nn.Parameter(weight)
    opt = MasterWeightOptimizer(
        optimizer([p]), master=master, moments_dtype=BF16, fused=fused, sr_seed=3 if master == "stochastic" else None
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grad = torch.randn(SHAPE, generator=gen).to(device, BF16)
        p.grad = grad.to(memory_format=torch.channels_last) if channels_last else grad
        opt.step()
        opt.zero_grad()
    assert p.is_contiguous(memory_format=torch.channels_last) == channels_last
    tensors = [p.detach()] + [r.remainder for r in opt._records if r.remainder is not None]
    tensors += [t for s in opt.state_dict()["state"].values() for t in s.values() if t.dim() > 0]
    return [t.cpu().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32) for t in tensors], opt


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)  # noqa: E731
SGD = lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)  # noqa: E731


@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("master", ["stochastic", "bf16_split", "fp32"])
def test_a_channels_last_weight_steps_as_a_contiguous_one(fused, master):
    if fused == "triton":
        pytest.importorskip("triton")
    expected, _ = run("torch", master, ADAMW, channels_last=False)
    got, opt = run(fused, master, ADAMW, channels_last=True)
    if fused in ("compiled", "triton", "torch"):
        assert [k.name for k in step_kernels(opt, {})] == [fused]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), a.shape


@pytest.mark.parametrize("master", ["stochastic", "bf16_split"])
def test_another_optimizer_steps_a_channels_last_weight_as_a_contiguous_one(master):
    expected, _ = run(None, master, SGD, channels_last=False)
    got, _ = run(None, master, SGD, channels_last=True)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), a.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fused", ["torch", False, "compiled", "triton"])
@pytest.mark.parametrize("master", ["stochastic", "bf16_split"])
def test_on_cuda_a_channels_last_weight_steps_as_a_contiguous_one(fused, master):
    if fused == "triton":
        pytest.importorskip("triton")
    expected, _ = run("torch", master, ADAMW, channels_last=False, device="cuda")
    got, _ = run(fused, master, ADAMW, channels_last=True, device="cuda")
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), a.shape
