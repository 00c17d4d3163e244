"""Which layers convert to FP8, and saying so (issue #31, item 5; issue #34, items 8 and 9).

GPT-2's projections are ``transformers``' ``Conv1D`` (a linear layer with its weight stored
transposed); a ResNet's only linear layer is its head, kept BF16 as the last layer. Both ran
zero FP8 GEMMs under ``precision=fp8`` without a word. Now ``Conv1D`` converts (the same bits as
the ``nn.Linear`` with the transposed weight), the layers are counted with the reasons, a model
of which nothing converts warns, and a ``keep_bf16`` pattern that matches nothing is an error.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from amp_plugin import MixedPrecisionPlugin
from amp_plugin.fp8 import (
    E4M3,
    E5M2,
    Fp8Conv1D,
    Fp8Linear,
    Fp8NothingConvertedWarning,
    Fp8Recipe,
    convert_to_fp8,
    eligible,
    is_conv1d,
    max_margin,
    reference_scale,
    saturating_cast,
)


class Conv1D(nn.Module):
    """``transformers.pytorch_utils.Conv1D``, line for line (GPT-2's projections): weight ``[nx, nf]``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


ALL = {"keep_first_last": False}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (``torch.equal`` takes -0.0 for 0.0)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A BF16 ``Conv1D(48, 32)`` and the ``nn.Linear(32, 48)`` holding its transposed weight."""
    torch.manual_seed(seed)
    conv = Conv1D(48, 32)
    with torch.no_grad():
        conv.weight.mul_(50.0)
        conv.bias.normal_()
    linear = nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    return nn.Sequential(conv).bfloat16(), nn.Sequential(linear).bfloat16()


@pytest.mark.parametrize(
    ("scaling", "fmt"), [("delayed", "hybrid"), ("current", "hybrid"), ("rowwise", "hybrid"), ("delayed", "e4m3")]
)
def test_a_converted_conv1d_computes_the_bits_of_the_converted_linear(scaling: str, fmt: str) -> None:
    recipe = Fp8Recipe(scaling=scaling, fp8_format=fmt, fallback_steps=0, amax_history_len=3, **ALL)
    conv_model, linear_model = _pair()
    conv_fp8, linear_fp8 = convert_to_fp8(conv_model, recipe), convert_to_fp8(linear_model, recipe)
    conv, linear = conv_model[0], linear_model[0]
    assert isinstance(conv, Fp8Conv1D) and isinstance(linear, Fp8Linear)
    torch.manual_seed(1)
    for step in range(4):  # the later steps cast with the delayed scales of the earlier ones
        x = (torch.randn(2, 12, 32) * (1 + step)).bfloat16()
        g = (torch.randn(2, 12, 48) * 1e-3).bfloat16()
        xc, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
        yc, yl = conv(xc), linear(xl)
        assert yc.shape == (2, 12, 48) and torch.equal(_bits(yc), _bits(yl))
        yc.backward(g)
        yl.backward(g)
        assert torch.equal(_bits(xc.grad), _bits(xl.grad))
        assert conv.weight.grad.shape == (32, 48)
        assert torch.equal(_bits(conv.weight.grad), _bits(linear.weight.grad.t()))
        assert torch.equal(_bits(conv.bias.grad), _bits(linear.bias.grad))
        conv.weight.grad = conv.bias.grad = linear.weight.grad = linear.bias.grad = None
        conv_fp8.update()
        linear_fp8.update()
        assert torch.equal(conv.fp8_amax_history, linear.fp8_amax_history)
        assert torch.equal(conv.fp8_scale, linear.fp8_scale)
    assert conv_fp8.read_stats() == linear_fp8.read_stats()


def test_a_converted_conv1d_runs_the_fp8_gemm_of_its_transposed_weight() -> None:
    # Against the reference by hand: operands cast with their own amax (the first step), the
    # FP32 product of the dequantised operands, rounded to BF16, plus the bias.
    conv_model, _ = _pair(3)
    convert_to_fp8(conv_model, Fp8Recipe(**ALL))
    conv = conv_model[0]
    torch.manual_seed(4)
    x = (torch.randn(24, 32) * 3).bfloat16().requires_grad_()
    g = (torch.randn(24, 48) * 1e-3).bfloat16()
    w = conv.weight.detach().t().float()  # [out, in]

    def dequant(t: torch.Tensor, fmt) -> torch.Tensor:
        scale = torch.tensor(reference_scale(t.abs().max().item(), 1.0, fmt.max, 0, 1e-12))
        return saturating_cast(t.float() * scale, fmt).float() * scale.reciprocal()

    xr, wr, gr = dequant(x.detach().float(), E4M3), dequant(w, E4M3), dequant(g.float(), E5M2)
    y = conv(x)
    assert torch.equal(y, (xr @ wr.T).bfloat16() + conv.bias)
    y.backward(g)
    assert torch.equal(x.grad, (gr @ wr).bfloat16())
    assert torch.equal(conv.weight.grad, (gr.T @ xr).bfloat16().t())


def test_conv1d_keeps_its_parameters_state_dict_and_bf16_forward() -> None:
    torch.manual_seed(0)
    original = Conv1D(32, 16)
    with torch.no_grad():
        original.bias.normal_()
    model = nn.Sequential(original)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    weight, bias = original.weight, original.bias
    convert_to_fp8(model, Fp8Recipe(**ALL))
    layer = model[0]
    assert isinstance(layer, Fp8Conv1D) and layer.weight is weight and layer.bias is bias
    assert (layer.nf, layer.nx, layer.in_features, layer.out_features) == (32, 16, 16, 32)
    assert model.state_dict().keys() == state.keys()
    model.load_state_dict(state)  # the same keys and shapes as before
    x = torch.randn(3, 5, 16)
    layer.fp8_active = False  # after a fallback: Conv1D's own forward, bit for bit
    assert torch.equal(layer(x), original(x))
    assert "nf=32, nx=16, bf16 (fell back)" in repr(layer)


def test_conv1d_is_recognised_by_its_shape_only() -> None:
    assert is_conv1d(Conv1D(32, 16))
    assert not is_conv1d(nn.Conv1d(16, 32, 3))

    class Conv1D_3d(nn.Conv1d):  # a real 1-D convolution that happens to be called Conv1D
        pass

    Conv1D_3d.__name__ = "Conv1D"
    assert not is_conv1d(Conv1D_3d(16, 32, 3))
    odd = Conv1D(32, 16)
    odd.nf = 16  # nf must be the weight's second dimension
    assert not is_conv1d(odd)
    model = nn.Sequential(Conv1D(32, 16), nn.Conv1d(32, 32, 1), Conv1D(32, 32), nn.Linear(32, 16))
    assert eligible(model, Fp8Recipe(**ALL)) == {"0": "fp8", "2": "fp8", "3": "fp8"}


class _Block(nn.Module):
    """GPT-2's block: every projection a Conv1D."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.c_attn, self.attn.c_proj = Conv1D(3 * d, d), Conv1D(d, d)
        self.mlp = nn.Sequential(Conv1D(4 * d, d), nn.GELU(), Conv1D(d, 4 * d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn.c_attn(self.ln_1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.attn.c_proj(att @ v)
        return x + self.mlp(self.ln_2(x))


class _Gpt2Like(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2, vocab: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(_Block(d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(x)


def test_a_gpt2_shaped_model_runs_its_conv1d_projections_in_fp8() -> None:
    torch.manual_seed(0)
    model = _Gpt2Like().bfloat16()
    fp8 = convert_to_fp8(model, Fp8Recipe())
    assert fp8.summary() == {
        "layers": 9,
        "fp8": 7,
        "bf16": 2,
        "fp8_types": {"Conv1D": 7},
        "bf16_reasons": {"first_last": 2},
        "bf16_layers": {"h.0.attn.c_attn": "first_last", "lm_head": "first_last"},
    }
    assert fp8.describe() == ("7 of 9 linear layers in FP8 (7 Conv1D); 2 in BF16: 2 first/last layer (keep_first_last)")
    loss = model(torch.randint(0, 64, (2, 16))).float().logsumexp(-1).mean()
    loss.backward()
    fp8.update()
    assert all(int(m.fp8_stats[:, 3].sum()) > 0 for m in fp8.layers.values())  # each one cast in FP8


def test_real_transformers_conv1d_and_gpt2_convert() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D as HfConv1D

    torch.manual_seed(0)
    hf, ours = HfConv1D(48, 32), Conv1D(48, 32)
    ours.load_state_dict(hf.state_dict())
    a, b = nn.Sequential(hf).bfloat16(), nn.Sequential(ours).bfloat16()
    convert_to_fp8(a, Fp8Recipe(**ALL))
    convert_to_fp8(b, Fp8Recipe(**ALL))
    x = torch.randn(4, 32).bfloat16()
    assert isinstance(a[0], Fp8Conv1D) and torch.equal(a(x), b(x))
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).bfloat16()
    summary = convert_to_fp8(model, Fp8Recipe()).summary()
    assert summary["fp8"] == 7 and summary["fp8_types"] == {"Conv1D": 7}
    assert summary["bf16_layers"] == {"transformer.h.0.attn.c_attn": "first_last", "lm_head": "first_last"}
    model(torch.randint(0, 64, (2, 16))).logits.float().mean().backward()


class _ResNetLike(nn.Module):
    """Convolutions, batch norm, a residual, global pooling and one linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.block(x))
        return self.fc(x.mean(dim=(2, 3)))


def test_a_resnet_with_one_linear_head_warns_and_counts_zero() -> None:
    model = _ResNetLike().bfloat16()
    with pytest.warns(Fp8NothingConvertedWarning, match=r"runs no GEMM in FP8: all 1 of its linear layers.*'fc'"):
        fp8 = convert_to_fp8(model, Fp8Recipe())
    assert fp8.layers == {}
    assert fp8.summary() == {
        "layers": 1,
        "fp8": 0,
        "bf16": 1,
        "fp8_types": {},
        "bf16_reasons": {"first_last": 1},
        "bf16_layers": {"fc": "first_last"},
    }
    assert "0 of 1 linear layers in FP8" in fp8.describe() and "computed as bf16 does" in fp8.describe()
    with pytest.warns(Fp8NothingConvertedWarning, match="no nn.Linear or Conv1D layer"):
        convert_to_fp8(nn.Sequential(nn.Conv2d(3, 8, 3)), Fp8Recipe())


def test_a_model_with_fp8_layers_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Fp8NothingConvertedWarning)
        fp8 = convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), Fp8Recipe(**ALL))
        again = convert_to_fp8(nn.Sequential(fp8.layers["0"]), Fp8Recipe())  # converted already: FP8
    assert list(again.layers) == ["0"] and again.summary()["fp8"] == 1


def test_the_counts_name_every_reason_a_layer_stays_bf16() -> None:
    model = nn.Sequential()
    for name, layer in [
        ("embed", nn.Linear(32, 64)),
        ("small", nn.Linear(64, 8)),
        ("odd", nn.Linear(64, 40)),
        ("attn", nn.Linear(40, 64)),
        ("mlp", nn.Linear(64, 64)),
        ("proj", Conv1D(64, 64)),
        ("head", nn.Linear(64, 10)),
    ]:
        model.add_module(name, layer)
    fp8 = convert_to_fp8(model, Fp8Recipe(keep_bf16=["att*"], fallback_steps=1))
    fp8._fall_back(fp8.layers["mlp"], "mlp", 1)  # as the saturation rule does
    assert fp8.summary() == {
        "layers": 7,
        "fp8": 1,
        "bf16": 6,
        "fp8_types": {"Conv1D": 1},
        "bf16_reasons": {"first_last": 2, "keep_bf16": 1, "min_features": 1, "multiple_of": 1, "fell_back": 1},
        "bf16_layers": {
            "embed": "first_last",
            "small": "min_features",
            "odd": "multiple_of",
            "attn": "keep_bf16",
            "head": "first_last",
            "mlp": "fell_back",
        },
    }


def test_a_keep_bf16_pattern_that_matches_no_layer_is_an_error() -> None:
    model = _Gpt2Like()
    message = r"keep_bf16=\['lm_head', 'lm_hed'\] is not allowed: its pattern 'lm_hed' matches no linear layer"
    with pytest.raises(ValueError, match=message) as e:
        convert_to_fp8(model, Fp8Recipe(keep_bf16=["lm_head", "lm_hed"]))
    assert "linear layers: 'h.0.attn.c_attn', 'h.0.attn.c_proj'," in str(e.value) and "(1 more)" in str(e.value)
    with pytest.raises(ValueError, match=r"names a module \(Module\), not a linear layer: 'h.0.attn.\*'"):
        convert_to_fp8(model, Fp8Recipe(keep_bf16=["h.0.attn"]))
    assert not any(isinstance(m, Fp8Conv1D) for m in model.modules())  # refused before converting
    kept = convert_to_fp8(model, Fp8Recipe(keep_bf16=["h.0.attn.*"])).summary()["bf16_layers"]
    assert kept == {"h.0.attn.c_attn": "first_last", "h.0.attn.c_proj": "keep_bf16", "lm_head": "first_last"}


def test_keep_bf16_as_a_string_is_refused_on_every_path() -> None:
    message = r"keep_bf16='lm_head' is not allowed: keep_bf16 must be a list of name patterns, not a string"
    with pytest.raises(TypeError, match=message):
        Fp8Recipe(keep_bf16="lm_head")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        Fp8Recipe.from_dict({"keep_bf16": "lm_head"})
    with pytest.raises(TypeError, match=message):
        MixedPrecisionPlugin("fp8", fp8={"keep_bf16": "lm_head"})
    assert Fp8Recipe.from_dict({"keep_bf16": ["lm_head"]}).keep_bf16 == ("lm_head",)
    assert MixedPrecisionPlugin("fp8", fp8={"keep_bf16": ["lm_head"]}).settings.fp8.keep_bf16 == ("lm_head",)


def test_margin_is_bounded_by_the_formats_normal_range() -> None:
    # The oracle: the largest margin at which a tensor's amax, scaled to FP8_MAX / 2**margin, is
    # still a normal number of the format (torch's own limits of the dtypes, not the package's).
    def largest(fmt) -> int:
        info = torch.finfo(fmt.dtype)
        return max(m for m in range(64) if info.max / 2.0**m >= info.smallest_normal)

    assert (largest(E4M3), largest(E5M2)) == (14, 29)
    assert max_margin("hybrid") == max_margin("e4m3") == min(largest(E4M3), largest(E5M2)) == 14
    assert Fp8Recipe(margin=14).margin == 14 and Fp8Recipe(margin=0, fp8_format="e4m3").margin == 0
    for margin in (1000, 15, -1):
        with pytest.raises(
            ValueError, match=rf"margin={margin} is not allowed: margin must be an integer in \[0, 14\]"
        ):
            Fp8Recipe(margin=margin)
    with pytest.raises(ValueError, match=r"margin=1000 is not allowed"):
        MixedPrecisionPlugin("fp8", fp8={"margin": 1000})
    # What it would have done: the scale clamps at 2**-126 and every operand casts to zero.
    x = torch.randn(8, 16)
    scale = torch.tensor(reference_scale(x.abs().max().item(), 1.0, E4M3.max, 1000, 1e-12))
    assert torch.count_nonzero(saturating_cast(x * scale, E4M3).float()) == 0
