"""``fused="triton"``: the lean kinds' joins and stores as two Triton kernels per group around torch's fused
Adam (what ``fused=None`` runs on CUDA), bit for bit the torch-ops path; on the CPU in Triton's interpreter,
only when named; without Triton (or when it fails) the compiled path runs, or, named, an error says why."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import MasterWeightOptimizer
from amp_plugin.master_weights import _split, _triton
from amp_plugin.master_weights._grads import eager_unscale
from amp_plugin.master_weights._kernels import KERNELS, StepCall, choose
from amp_plugin.master_weights._step import step_kernels
from amp_plugin.master_weights._stochastic import round_stochastic
from tests.master_weights import test_master_compiled as compiled_tests

pytest.importorskip("triton")

BF16 = torch.bfloat16
CPU = torch.device("cpu")
# one element, a block's tail, several blocks (the interpreter runs each program in numpy: kept small)
SIZES = (1, 7, 1000, 2100, 3, 33, 129)
DEVICES = compiled_tests.DEVICES
bits = compiled_tests.bits


@pytest.fixture
def sizes(monkeypatch):
    monkeypatch.setattr(compiled_tests, "SIZES", SIZES)


def train(*args, **kwargs):
    return compiled_tests.train(*args, **kwargs)


@pytest.mark.parametrize("master", ["bf16_split", "stochastic", "fp32"])
@pytest.mark.parametrize(
    "moments, rounding", [(BF16, "stochastic"), (BF16, "nearest"), (None, "stochastic")], ids=["sr", "rne", "fp32"]
)
def test_the_triton_kernels_give_the_bits_of_every_other_path(sizes, master, moments, rounding):
    got, opt = train("triton", master, moments, rounding)
    assert [k.name for k in step_kernels(opt, {})] == ["triton"]
    # torch's ops (pinned against the FP32 oracles in test_master_lean.py), and the CPU kernel
    for other in ("torch", None):
        expected, _ = train(other, master, moments, rounding)
        assert len(expected) == len(got)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b), (other, a.shape)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master", ["bf16_split", "stochastic"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_on_each_device_the_triton_step_gives_the_torch_ops_bits(sizes, device, master, rounding):
    """On CUDA this is what ``fused=None`` runs: the torch-ops path on the same device is its reference;
    ``bf16_split`` also against torch's fused AdamW on FP32 masters."""
    got, opt = train("triton", master, BF16, rounding, device=device)
    assert [k.name for k in step_kernels(opt, {})] == ["triton"]
    expected, _ = train("torch", master, BF16, rounding, device=device)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), a.shape
    if master == "bf16_split":
        split, split_opt = train("triton", master, None, "stochastic", device=device)
        fp32, fp32_opt = train("torch", "fp32", None, "stochastic", device=device)
        for a, b in zip(split_opt.fp32_masters(), fp32_opt.fp32_masters(), strict=True):
            assert torch.equal(bits(a.cpu()), bits(b.cpu())), a.shape
        n = len(SIZES)
        assert all(torch.equal(a, b) for a, b in zip(split[2 * n :], fp32[n:], strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_fused_none_runs_the_triton_kernels(sizes):
    _, opt = train(None, "bf16_split", BF16, "stochastic", steps=1, device="cuda")
    assert next(k.name for k in step_kernels(opt, {})) == "triton"


def test_the_stores_and_prepares_match_the_torch_ops_element_by_element():
    """Past 2**16 elements (the hash's index), NaN, infinities, signed zeros and ties; one launch for all."""
    gen = torch.Generator().manual_seed(3)
    sizes = (70001, 5, 1)
    values = [torch.randn(n, generator=gen) for n in sizes]
    values[0][:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1 + 2**-8, -(1 + 2**-8), 3e38])
    weights = [torch.empty(n, dtype=BF16) for n in sizes]
    remainders = [torch.empty(n, dtype=torch.int16) for n in sizes]
    m16s, v16s = ([torch.empty(n, dtype=BF16) for n in sizes] for _ in range(2))
    squares = [v * v for v in values]
    rows = [(7 + 3 * i, 11 * i - 5) for i in range(len(sizes))]
    keys = _triton.keys_tensor(rows, CPU)
    _triton.store(values, weights, remainders, (values, squares, m16s, v16s), keys, True)
    for i, v in enumerate(values):
        w, r = torch.empty_like(weights[i]), torch.empty_like(remainders[i])
        _split.split_into(v, w, r)
        assert torch.equal(bits(weights[i]), bits(w)) and torch.equal(remainders[i], r)
        m, s = torch.empty_like(m16s[i]), torch.empty_like(v16s[i])
        round_stochastic(v, m, rows[i][1])
        round_stochastic(squares[i], s, rows[i][1], low=True)
        assert torch.equal(bits(m16s[i]), bits(m)) and torch.equal(bits(v16s[i]), bits(s))
    joined, m32s, v32s, no_grads = _triton.prepare(weights, remainders, (m16s, v16s))
    assert no_grads is None
    for i, v in enumerate(values):
        assert torch.equal(bits(joined[i]), bits(v))  # the master back, NaN's bits included
        assert torch.equal(bits(m32s[i]), bits(m16s[i].float())) and torch.equal(bits(v32s[i]), bits(v16s[i].float()))
    _triton.store(values, weights, None, (values, squares, m16s, v16s), keys, False)
    for i, v in enumerate(values):  # stochastic weights: the high 16 bits of the weight key's hash
        expected = torch.empty_like(weights[i])
        round_stochastic(v, expected, rows[i][0])
        assert torch.equal(bits(weights[i]), bits(expected))
        finite = ~v.isnan()  # to nearest: torch's bits; NaN as c10's scalar rule writes it
        assert torch.equal(bits(m16s[i])[finite], bits(v.to(BF16))[finite])
        assert torch.all(bits(m16s[i])[~finite] == 0x7FC0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("factor", [None, 2.0**-7 * 3, 1.0], ids=["unscaled", "scaled", "one"])
def test_the_prepare_makes_the_fp32_gradients_as_torchs_upcast_and_unscale(device, dtype, factor):
    """The half gradients upcast and unscaled in the prepare's launch: the bits of ``eager_unscale`` (torch's
    multi-tensor upcast, then its check-and-unscale op) on the same device, infinities, NaN and subnormal
    products included."""
    gen = torch.Generator().manual_seed(5)
    sizes = (1, 2100, 33)
    grads = [(torch.randn(n, generator=gen) * 100).to(device, dtype) for n in sizes]
    grads[1][:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 2.0**-14]).to(device, dtype)
    m16s, v16s = ([torch.zeros(n, dtype=BF16, device=device) for n in sizes] for _ in range(2))
    inv = None if factor is None else torch.full((1,), factor, device=device)
    weights = [torch.zeros(n, dtype=BF16, device=device) for n in sizes]
    _, m32s, _, g32s = _triton.prepare(weights, None, (m16s, v16s), grads, inv)
    assert m32s is not None and g32s is not None
    expected = eager_unscale(grads, inv, None)
    for got, want, grad in zip(g32s, expected, grads, strict=True):
        assert got.dtype is torch.float32 and got.shape == grad.shape
        assert torch.equal(bits(got), bits(want))


def test_the_prepare_leaves_mixed_or_fp32_gradients_to_the_caller():
    weights = [torch.zeros(3, dtype=BF16), torch.zeros(4, dtype=BF16)]
    for grads, inv in (
        ([torch.ones(3, dtype=BF16), torch.ones(4, dtype=torch.float16)], None),  # two dtypes
        ([torch.ones(3), torch.ones(4)], None),  # FP32 already
        ([torch.ones(3, dtype=BF16), torch.ones(4, dtype=BF16)], torch.ones(2)),  # not one factor
    ):
        assert _triton.prepare(weights, None, None, grads, inv)[3] is None


def test_the_block_table_covers_each_tensor_once():
    table = _triton._block_table((0, 1, 2 * _triton.BLOCK + 1, 3), CPU).view(-1, 2).tolist()
    block = _triton.BLOCK
    assert table == [[1, 0], [2, 0], [2, block], [2, 2 * block], [3, 0]]
    assert (
        _triton._block_table((0, 1, 2 * block + 1, 3), CPU).data_ptr()
        == _triton._block_table((0, 1, 2 * block + 1, 3), CPU).data_ptr()
    )  # kept


def test_on_the_cpu_only_fused_triton_selects_it():
    params = [torch.nn.Parameter(torch.randn(8).to(BF16))]
    opt = MasterWeightOptimizer(torch.optim.AdamW(params, fused=True), master="bf16_split").optimizer
    assert [k.name for k in choose(opt, "bf16_split", "triton", True, False, object())] == ["triton"]
    assert "triton" not in [k.name for k in choose(opt, "bf16_split", None, True, False, object())]
    assert [k.name for k in choose(opt, "bf16_split", "triton", False, False, None)] == ["triton"]
    assert [k.name for k in choose(opt, "bf16_split", None, False, False, None)] == ["triton", "compiled", "torch"]


def _call(opt, fused):
    return StepCall(opt.optimizer, [], {}, [], [], None, [], torch.float32, False, None, fused)


def test_without_triton_the_next_kernel_runs_or_a_named_one_raises(monkeypatch):
    run = next(k for k in KERNELS if k.name == "triton").run
    opt = MasterWeightOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.randn(8).to(BF16))], fused=True))
    monkeypatch.setattr(_triton, "triton", None)
    monkeypatch.setattr(_triton, "_IMPORT_ERROR", ImportError("No module named 'triton'"))
    monkeypatch.setattr(_triton, "_state", {"ok": {}, "error": {}})
    assert run(_call(opt, None)) is False  # declined, nothing changed: the compiled path runs the step
    with pytest.raises(RuntimeError, match="fused='triton': Triton is not importable .*No module named 'triton'"):
        run(_call(opt, "triton"))


def test_a_failing_probe_warns_once_off_the_cpu_and_declines(monkeypatch, capsys):
    """A GPU whose Triton fails: said once on stderr and warned, and the step runs without the kernels."""

    def broken(device):
        raise RuntimeError("no PTX for this GPU")

    monkeypatch.setattr(_triton, "_probe", broken)
    monkeypatch.setattr(_triton, "_state", {"ok": {}, "error": {}})
    meta = torch.device("meta")
    with pytest.warns(RuntimeWarning, match="unavailable on meta .*no PTX for this GPU.*without them"):
        assert _triton.available(meta, False) is False
    assert "compiling the lean step's Triton kernels" in capsys.readouterr().err
    assert _triton.available(meta, False) is False  # said once
    assert capsys.readouterr().err == ""


def test_fused_triton_is_refused_where_torch_is():
    params = [torch.nn.Parameter(torch.randn(8).to(BF16))]
    with pytest.raises(ValueError, match="fused='triton' is not possible here: .*Adam and AdamW only, not SGD"):
        MasterWeightOptimizer(torch.optim.SGD(params, lr=0.1), fused="triton")


def test_the_probe_refuses_kernels_that_compute_other_bits(monkeypatch):
    """Every variant is checked against the torch ops before a step uses it: here the stores get other keys."""
    real = _triton.keys_tensor
    monkeypatch.setattr(_triton, "keys_tensor", lambda rows, device: real([(w + 1, m) for w, m in rows], device))
    with pytest.raises(RuntimeError, match="compute the stochastic weights otherwise than the torch ops"):
        _triton._probe(CPU)
    monkeypatch.setattr(_triton, "keys_tensor", lambda rows, device: real([(w, m ^ 4) for w, m in rows], device))
    with pytest.raises(RuntimeError, match="compute the stochastic exp_avg otherwise than the torch ops"):
        _triton._probe(CPU)
    monkeypatch.setattr(_triton, "keys_tensor", real)
    _triton._probe(CPU)
