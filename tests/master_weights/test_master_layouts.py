"""Strided parameters (a channels_last convolution's weight and gradient): every step path and master kind
gives the bits of the same run on contiguous tensors, and the weight keeps its layout.

The oracle is the run without strides: the same values in logical order, where every path agrees
(``test_master_compiled.py``, ``test_master_lean.py``). A step that paired elements by their place in
memory (a channels_last FP32 value beside contiguous moments, in torch's fused Adam) updated each weight
with another element's moments and gradient."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
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


def scalar_run(fused, master, shape, scaled, steps=3):
    """A learnable scalar (``shape`` ``()``, or ``(1,)`` for the oracle) beside a vector, stepped as the
    user's loop steps it: with a dynamic scaler, ``unscale_`` and clipping on the FP32 masters, or plainly."""
    gen = torch.Generator().manual_seed(0)
    scalar = torch.nn.Parameter(torch.tensor(1.5).reshape(shape).to(BF16))
    vector = torch.nn.Parameter(torch.randn(5, generator=gen).to(BF16))
    opt = MasterWeightOptimizer(
        ADAMW([scalar, vector]), master=master, fused=fused, sr_seed=3 if master == "stochastic" else None
    )
    scaler = DynamicLossScaler(init_scale=4.0) if scaled else None
    for _ in range(steps):
        loss = (scalar * vector * torch.randn(5, generator=gen).to(BF16)).sum().float()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    assert scalar.shape == shape
    return [t.reshape(-1) for t in [scalar.detach(), vector.detach(), *opt.fp32_masters()]]


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("master", ["stochastic", "bf16_split", "fp32"])
def test_a_0_dim_parameter_steps_as_a_one_element_one(fused, master, scaled):
    """A 0-dim weight (a learnable temperature or gate) on every path: the torch-ops paths upcast
    gradients by a ``(1,)``-shaped one, whose broadcast made a 0-dim gradient's FP32 copy ``(1,)`` and
    failed the step ("attempting to assign a gradient of size '[1]' to a tensor of size '[]'")."""
    if fused == "triton":
        pytest.importorskip("triton")
    expected = scalar_run("torch", master, (1,), scaled)
    got = scalar_run(fused, master, (), scaled)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
