"""cast_module: half-precision model, normalisation layers kept in FP32 with exact casts."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_plugin import cast_module
from amp_plugin.half_module import KeepFP32Forward


class PairNorm(nn.Module):
    """A custom module returning a tuple, taking a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.dtype == shift.dtype == torch.float32  # inputs arrive upcast, keywords too
        return x * self.weight + shift, x.sum()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.GroupNorm(2, 4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_layers_compute_in_fp32_and_hand_back_half(dtype):
    m = cast_module(model(), dtype)
    assert [p.dtype for p in m.parameters()] == [
        dtype,
        dtype,
        torch.float32,
        torch.float32,
        dtype,
        dtype,
        torch.float32,
        torch.float32,
    ]
    x = torch.randn(3, 4).to(dtype)
    h = m[0](x)
    ln = m[1]
    expected = F.layer_norm(h.float(), (4,), ln.weight, ln.bias, ln.eps).to(dtype)  # upcast, FP32, one rounding
    assert torch.equal(ln(h), expected)
    assert m(x).dtype == dtype


def test_gradients_reach_fp32_norm_params_and_half_inputs():
    m = cast_module(model(), torch.float16)
    x = torch.randn(3, 4, dtype=torch.float16, requires_grad=True)
    m(x).float().sum().backward()
    assert x.grad.dtype == torch.float16
    assert m[1].weight.grad.dtype == torch.float32 and m[0].weight.grad.dtype == torch.float16


def test_casts_live_in_forward_not_in_hooks():
    """Hooks would send every call through nn.Module's slow path."""
    m = cast_module(model(), torch.float16)
    for norm in (m[1], m[3]):
        assert isinstance(norm.forward, KeepFP32Forward)
        assert not norm._forward_hooks and not norm._forward_pre_hooks


def test_casting_again_rewraps_nothing_and_follows_the_new_dtype():
    m = cast_module(model(), torch.float16)
    wrapper = m[1].forward
    cast_module(m, torch.bfloat16)
    assert m[1].forward is wrapper and m(torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    cast_module(m, torch.float32)
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert m(torch.randn(2, 4)).dtype == torch.float32


def test_keyword_arguments_and_tuple_outputs_are_cast():
    m = cast_module(nn.Sequential(PairNorm()), torch.float16, keep_fp32=(PairNorm,))[0]
    out, total = m(torch.randn(2, 4, dtype=torch.float16), shift=torch.ones(4, dtype=torch.float16))
    assert out.dtype == total.dtype == torch.float16
    assert m.weight.dtype == torch.float32


def test_an_instance_forward_set_before_is_kept():
    ln = nn.LayerNorm(4)
    calls = []

    def traced(x):
        calls.append(x.dtype)
        return nn.LayerNorm.forward(ln, x)

    ln.forward = traced
    m = cast_module(nn.Sequential(nn.Linear(4, 4), ln), torch.float16)
    assert m(torch.randn(2, 4, dtype=torch.float16)).dtype == torch.float16
    assert calls == [torch.float32]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_keep_their_own_wrapper(how):
    m = cast_module(model(), torch.float16)
    if how == "deepcopy":
        c = copy.deepcopy(m)
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    assert c[1].forward.module is c[1] and c[1] is not m[1]
    x = torch.randn(3, 4, dtype=torch.float16)
    assert torch.equal(c(x), m(x))
