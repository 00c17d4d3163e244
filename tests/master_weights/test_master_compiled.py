"""``fused="compiled"``: the lean kinds' joins and stores compiled by ``torch.compile`` around torch's
fused Adam (what ``fused=None`` runs off the CPU), bit for bit the torch-ops path and amp_plugin's CPU
kernel; chosen on the CPU only when named; a failure to compile falls back or, when named, raises."""

from __future__ import annotations

import warnings

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import FrozenMomentWarning, _compiled, _split
from amp_plugin.master_weights._kernels import StepCall, choose
from amp_plugin.master_weights._step import step_kernels

BF16 = torch.bfloat16
# one element (Dynamo specializes it), a vector tail, past 2**16 for the hash; odd sizes run one element per
# lane, even ones in pairs (2: one pair, a size Dynamo specializes; 70002: past 2**16; 34: a vector tail)
SIZES = (1, 7, 1000, 70001, 3, 33, 129, 2, 70002, 34)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def bits(t):
    if t.dtype in (BF16, torch.float16):
        return t.view(torch.int16)
    return t.view(torch.int32) if t.dtype is torch.float32 else t


def train(fused, master, moments, rounding, steps=4, device="cpu", scaled=True, shown=True):
    """``steps`` steps of AdamW over BF16 parameters of ``SIZES`` (``scaled``: through a dynamic loss scaler, else
    ``opt.step()`` on the gradients as they are; ``shown``: ``unscaled_model_grads``); the weights', remainders' and
    moments' bits, and the optimizer."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(device, BF16)) for n in SIZES]
    seeded = master == "stochastic" or (moments is BF16 and rounding == "stochastic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FrozenMomentWarning)
        opt = MasterWeightOptimizer(
            torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
            master=master,
            moments_dtype=moments,
            moments_rounding=rounding,
            fused=fused,
            sr_seed=5 if seeded else None,
            unscaled_model_grads=shown,
        )
    scaler = DynamicLossScaler(init_scale=2.0**10) if scaled else None
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=gen) * 2.0**10).to(device, BF16)
        if scaler is None:
            opt.step()
            continue
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    state = opt.state_dict()
    tensors = [bits(p.detach().cpu()) for p in params]
    tensors += [bits(r.remainder.cpu()) for r in opt._records if r.remainder is not None]
    tensors += [bits(s[k].cpu()) for s in state["state"].values() for k in ("exp_avg", "exp_avg_sq")]
    return tensors, opt


@pytest.mark.slow
@pytest.mark.parametrize("master", ["bf16_split", "stochastic", "fp32"])
@pytest.mark.parametrize(
    "moments, rounding", [(BF16, "stochastic"), (BF16, "nearest"), (None, "stochastic")], ids=["sr", "rne", "fp32"]
)
def test_the_compiled_stores_give_the_bits_of_every_other_path(master, moments, rounding):
    compiled, opt = train("compiled", master, moments, rounding)
    assert [k.name for k in step_kernels(opt, {})] == ["compiled"]
    for other in (
        "torch",
        None,
    ):  # torch's ops (pinned against the FP32 oracles in test_master_lean.py); the CPU kernel
        expected, _ = train(other, master, moments, rounding)
        assert len(expected) == len(compiled)
        for a, b in zip(compiled, expected):
            assert torch.equal(a, b), (other, a.shape)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("master", ["bf16_split", "stochastic"])
def test_on_each_device_the_compiled_step_gives_the_torch_ops_bits(device, master):
    """Off the CPU the compiled step is what ``fused=None`` runs: the torch-ops path on the same device is
    its reference (the CPU's kernel has other Adam bits than CUDA's); ``bf16_split`` also against FP32 masters."""
    compiled, _ = train("compiled", master, BF16, "stochastic", device=device)
    expected, _ = train("torch", master, BF16, "stochastic", device=device)
    for a, b in zip(compiled, expected, strict=True):
        assert torch.equal(a, b), a.shape
    if master == "bf16_split":  # the masters and FP32 moments of torch's fused AdamW on FP32 masters
        split, split_opt = train("compiled", master, None, "stochastic", device=device)
        fp32, fp32_opt = train("torch", "fp32", None, "stochastic", device=device)
        for a, b in zip(split_opt.fp32_masters(), fp32_opt.fp32_masters(), strict=True):
            assert torch.equal(bits(a.cpu()), bits(b.cpu())), a.shape
        n = len(SIZES)
        assert all(torch.equal(a, b) for a, b in zip(split[2 * n :], fp32[n:], strict=True))


def test_a_batch_that_fails_to_compile_runs_the_same_functions_uncompiled(monkeypatch):
    expected, _ = train("torch", "bf16_split", BF16, "stochastic", steps=2)
    assert _compiled.available(torch.device("cpu"), True)

    def broken(name):
        raise RuntimeError("out of registers")

    monkeypatch.setattr(_compiled, "_fn", broken)
    monkeypatch.setitem(_compiled._state, "eager", False)
    with pytest.warns(RuntimeWarning, match="failed on a batch of the lean step .*out of registers.*uncompiled"):
        got, _ = train("compiled", "bf16_split", BF16, "stochastic", steps=2)
    assert _compiled._state["eager"]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_batches_cut_a_group_largest_first():
    assert [(s.start, s.stop) for s in _compiled.batches(22)] == [(0, 16), (16, 20), (20, 21), (21, 22)]
    assert [s.stop - s.start for s in _compiled.batches(78)] == [16] * 4 + [4] * 3 + [1] * 2
    assert list(_compiled.batches(0)) == []
    # a batch never mixes sizes Dynamo compiles as constants (0, 1) with the others
    tensors = [torch.empty(n) for n in (5, 6, 1, 1, 0, 9, 2, 3, 4)]
    runs = [(s.start, s.stop) for s in _compiled._runs(tensors)]
    assert runs == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 9)]


@pytest.mark.slow
def test_scalar_parameters_anywhere_in_a_group_compile_a_bounded_number_of_graphs():
    """Size-1 tensors are compiled as constants: ordered last, they form batches of their own, so where they
    sit in the group does not multiply the graphs."""
    from torch._dynamo.utils import counters

    def step(sizes):
        params = [torch.nn.Parameter(torch.randn(n).to(BF16)) for n in sizes]
        opt = MasterWeightOptimizer(torch.optim.AdamW(params, fused=True), master="bf16_split", fused="compiled")
        for p in params:
            p.grad = torch.randn(p.shape).to(BF16)
        opt.step()

    step([1, 3, 5, 7, 9])
    before = counters["stats"]["unique_graphs"]
    for sizes in ([3, 1, 5, 7, 9], [3, 5, 7, 1, 9], [1, 3, 1, 5, 7, 1, 9], [3, 5, 7, 9, 1, 1, 1]):
        step(sizes)
    assert counters["stats"]["unique_graphs"] == before  # batches of 4 tensors of 2 elements or more, and of one


def test_on_the_cpu_only_fused_compiled_selects_it():
    params = [torch.nn.Parameter(torch.randn(8).to(BF16))]
    opt = MasterWeightOptimizer(torch.optim.AdamW(params, fused=True), master="bf16_split").optimizer
    assert [k.name for k in choose(opt, "bf16_split", "compiled", True, False, object())] == ["compiled"]
    assert "compiled" not in [k.name for k in choose(opt, "bf16_split", None, True, False, object())]
    assert "compiled" not in [k.name for k in choose(opt, "bf16_split", "torch", True, False, object())]
    # off the CPU fused=None takes it after the Triton kernels (amp_plugin's are CPU-only), torch's ops last
    assert [k.name for k in choose(opt, "bf16_split", None, False, False, None)] == ["triton", "compiled", "torch"]


def _call(opt, fused):
    return StepCall(opt.optimizer, [], {}, [], [], None, [], torch.float32, False, None, fused)


def test_a_failure_to_compile_falls_back_to_the_torch_ops_or_raises_when_named(monkeypatch, capsys):
    from amp_plugin.master_weights._kernels import KERNELS

    run = next(k for k in KERNELS if k.name == "compiled").run
    opt = MasterWeightOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.randn(8).to(BF16))], fused=True))

    def broken(device):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(_compiled, "_probe", broken)
    monkeypatch.setattr(_compiled, "_state", {"ok": None, "error": None})
    with pytest.warns(RuntimeWarning, match="could not compile the lean step .*no compiler.*torch's multi-tensor ops"):
        assert run(_call(opt, None)) is False  # declined, nothing changed: the next kernel runs the step
    assert "compiling the lean step" in capsys.readouterr().err
    assert run(_call(opt, None)) is False  # said once
    assert capsys.readouterr().err == ""
    with pytest.raises(RuntimeError, match="fused='compiled': torch.compile failed: no compiler"):
        run(_call(opt, "compiled"))


def test_fused_compiled_is_refused_where_torch_is():
    params = [torch.nn.Parameter(torch.randn(8).to(BF16))]
    with pytest.raises(ValueError, match="fused='compiled' is not possible here: .*Adam and AdamW only, not SGD"):
        MasterWeightOptimizer(torch.optim.SGD(params, lr=0.1), fused="compiled")
    with pytest.raises(TypeError, match="fused='yes' is not allowed.*'compiled'"):
        MasterWeightOptimizer(torch.optim.AdamW(params), fused="yes")


@pytest.mark.slow
def test_a_batch_compiles_once_whatever_sizes_happen_to_be_equal():
    """Each size its own symbol: a model's batches differ in which sizes are equal, and must not recompile
    (a batch of odd sizes runs one element per lane, of even sizes in pairs: one graph each)."""
    from torch._dynamo.utils import counters

    assert _compiled.available(torch.device("cpu"), True)
    before = counters["stats"]["unique_graphs"]
    odd = ([5, 5, 5, 5], [5, 7, 9, 11], [9, 9, 7, 7], [3, 5, 3, 5])
    even = ([6, 6, 6, 6], [6, 8, 10, 12], [10, 10, 8, 8], [4, 12, 4, 12], [4, 4, 4, 6])
    for sizes in odd + even:
        weights = [torch.randn(n).to(BF16) for n in sizes]
        remainders = [torch.randint(-(2**15), 2**15, (n,), dtype=torch.int16) for n in sizes]
        (values,) = _compiled.prepare(weights, remainders, None)[:1]
        for w, r, v in zip(weights, remainders, values, strict=True):
            assert torch.equal(v, _split.join(w, r))
    # the join over batches of 4 compiled once per layout (or before, by another test); with duck shapes,
    # once per pattern
    assert counters["stats"]["unique_graphs"] - before <= 2


@pytest.mark.slow
def test_each_new_graph_counts_as_build_time_not_step_time():
    """A batch of a length, size class or moment rounding not compiled before compiles: that time is the
    build's (left out of steps/s), whichever of them is new."""
    from amp_plugin import fused

    # a fresh start: in a process whose earlier tests compiled many batches, the functions' recompile limit
    # would switch them to eager (no compile, no build time), whatever order the tests run in
    torch._dynamo.reset()
    _compiled._compiled.clear()
    _compiled._seen.clear()
    assert _compiled.available(torch.device("cpu"), True)
    values = [torch.randn(5 + 2 * k) for k in range(16)]  # odd sizes, one batch of 16: no other test compiles one
    weights = [v.to(BF16) for v in values]
    remainders = [torch.zeros(v.shape, dtype=torch.int16) for v in values]
    m16s, v16s = [v.to(BF16) for v in values], [v.abs().to(BF16) for v in values]
    keys = _compiled.keys_tensor([(k, k + 1) for k in range(16)], torch.device("cpu"))
    for sr in (True, False):  # the same batch; the second rounding compiles a graph of its own
        before = fused.build_seconds()
        _compiled.store(values, weights, remainders, (values, [v.abs() for v in values], m16s, v16s), keys, sr)
        assert fused.build_seconds() - before > 0.1, sr
    before = fused.build_seconds()
    _compiled.store(values, weights, remainders, (values, [v.abs() for v in values], m16s, v16s), keys, True)
    assert fused.build_seconds() == before  # compiled before: step time


def _special_values(n: int) -> torch.Tensor:
    """FP32 values whose bits every rule has a case for, then random ones: NaNs (quiet, signalling, negative),
    infinities, zeros, the largest finite, subnormals, ties of the split, and low halves that read as a BF16
    NaN or infinity (a remainder a float conversion would not keep)."""
    bits = [0x7FC00000, 0x7F800001, 0xFFC00123, 0x7F800000, 0xFF800000, 0, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF]
    bits += [0x00000001, 0x807FFFFF, 0x3F808000, 0xBF818000, 0x3F807FFF, 0x3F80FF81, 0xC000FF80, 0x4049FFC1]
    gen = torch.Generator().manual_seed(3)
    rest = torch.randint(-(2**31), 2**31, (n - len(bits),), generator=gen, dtype=torch.int64)
    words = torch.cat([torch.tensor(bits, dtype=torch.int64), rest])
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 1], ids=["pairs", "lanes"])
def test_pairs_and_lanes_give_the_torch_ops_bits_on_every_kind_of_value(offset):
    """The same values through the pairs (an even size at an even offset) and one element per lane (at an odd
    offset into a buffer, as a flat parameter's view can be): the bits of ``_split`` and ``round_stochastic``."""
    from amp_plugin.master_weights._compiled_bits import pairable
    from amp_plugin.master_weights._stochastic import round_stochastic

    assert _compiled.available(torch.device("cpu"), True)
    n = 1026
    value = _special_values(n)
    moments = _special_values(n).flip(0)

    def buffers(dtype):
        return [torch.zeros(n + 2, dtype=dtype)[offset : offset + n] for _ in range(2)]

    weights, m16s, v16s, remainders = buffers(BF16), buffers(BF16), buffers(BF16), buffers(torch.int16)
    assert pairable(weights[0]) == (offset == 0)
    keys = _compiled.keys_tensor([(11, 12), (13, 14)], torch.device("cpu"))
    _compiled.store([value], weights[:1], remainders[:1], ([moments], [value], m16s[:1], v16s[:1]), keys[:1], True)
    _compiled.store([value], weights[1:], None, None, keys[1:], True)
    w_ref, m_ref, v_ref = (torch.empty(n, dtype=BF16) for _ in range(3))
    r_ref = torch.empty(n, dtype=torch.int16)
    _split.split_into(value, w_ref, r_ref)
    round_stochastic(moments, m_ref, 12)
    round_stochastic(value, v_ref, 12, low=True)
    assert torch.equal(bits(weights[0]), bits(w_ref)) and torch.equal(remainders[0], r_ref)
    assert torch.equal(bits(m16s[0]), bits(m_ref)) and torch.equal(bits(v16s[0]), bits(v_ref))
    round_stochastic(value, w_ref, 13)
    assert torch.equal(bits(weights[1]), bits(w_ref))
    joined, m32, v32, _ = _compiled.prepare(weights[:1], remainders[:1], (m16s[:1], v16s[:1]))
    assert torch.equal(bits(joined[0]), bits(value))  # every pattern back, NaN payloads included
    assert torch.equal(bits(m32[0]), bits(m_ref.float())) and torch.equal(bits(v32[0]), bits(v_ref.float()))


def test_the_first_call_check_runs_on_the_heads_of_the_tensors_with_their_tails(monkeypatch):
    """A graph's first-call check copies at most ``CHECK_ELEMENTS`` elements of each tensor, plus the size's
    remainder modulo 64 (so the loops' tails run): its memory stays small whatever the batch's size."""
    from amp_plugin.master_weights._compiled_bits import FUNCTIONS

    assert _compiled.available(torch.device("cpu"), True)
    for name in FUNCTIONS:  # the compiled wrappers of the real functions, before they are spied on
        _compiled._fn(name)
    seen: list[int] = []

    def spy(real):
        def run(*args):
            seen.extend(t.numel() for a in args if isinstance(a, list) for t in a)
            return real(*args)

        return run

    for name, real in list(FUNCTIONS.items()):
        monkeypatch.setitem(FUNCTIONS, name, spy(real))
    monkeypatch.setattr(_compiled, "CHECK_ELEMENTS", 100)
    monkeypatch.setattr(_compiled, "_seen", set())
    monkeypatch.setitem(_compiled._state, "eager", False)
    expected, _ = train("torch", "bf16_split", BF16, "stochastic", steps=1, scaled=False)
    got, _ = train("compiled", "bf16_split", BF16, "stochastic", steps=1, scaled=False)
    assert not _compiled._state["eager"]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert 100 + 70001 % 64 in seen  # the head of the largest tensor (one element per lane), with its tail
    assert all(n <= 100 or 100 < n < 164 for n in seen), sorted(set(seen))


_ISA_CHILD = """
import torch
from amp_plugin.master_weights import _compiled, _split

gen = torch.Generator().manual_seed(0)
value = torch.randn(80, generator=gen)
weight, remainder = torch.empty(80, dtype=torch.bfloat16), torch.empty(80, dtype=torch.int16)
_split.split_into(value, weight, remainder)
grads = [value.to(torch.bfloat16), value[:77].to(torch.bfloat16)]
upcast = _compiled._run("up_grads", [grads])
ok = all(torch.equal(a, g.float()) for a, g in zip(upcast, grads))
print("same bits" if ok and torch.equal(_compiled.join(weight, remainder), value) else "other bits")
"""


@pytest.mark.slow
def test_runs_of_other_vector_isas_sharing_inductors_cache_each_compile_their_own_code(tmp_path):
    """Inductor's on-disk graph cache (torch 2.13) keys a graph without the vector ISA its C++ was generated for;
    the compiled functions name their vector width in the compile options (``_isa_options``), so runs of
    different ISAs sharing a cache each get code for their own. A run with the CPU's own ISA fills the cache;
    then runs with ``ATEN_CPU_CAPABILITY`` set to each narrower ISA the CPU has, and to ``default`` (no vectors),
    compile and upcast and join with torch's bits. Without the width, an AVX2 run after an AVX-512 one upcast
    16 of every 32 values wrong, and a ``default`` one failed to compile."""
    import os
    import subprocess
    import sys

    from torch._inductor.cpu_vec_isa import pick_vec_isa, valid_vec_isa_list

    best = pick_vec_isa()
    narrower = [c for c in ("avx2",) if any(c == str(i) for i in valid_vec_isa_list()) and c != str(best)]
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    runs = [("the CPU's own", {})] + [(c, {"ATEN_CPU_CAPABILITY": c}) for c in (*narrower, "default")]
    for name, extra in runs:
        done = subprocess.run(
            [sys.executable, "-c", _ISA_CHILD], env={**env, **extra}, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0 and done.stdout.strip() == "same bits", (name, done.stdout, done.stderr[-3000:])


@pytest.mark.parametrize("name", [None, "join_up", "join_up_pairs", "up_grads", "split_moments", "split_moments_pairs"])
def test_a_graph_giving_other_bits_is_caught_at_its_first_call_and_the_step_keeps_the_torch_ops_bits(monkeypatch, name):
    """Each graph's first call is checked against the same function uncompiled, on copies of the heads of the
    step's tensors: code generated wrong (or loaded from a cache for other hardware) is warned about, and that batch and
    the later ones run uncompiled, with the torch ops' bits. Here ``name``'s compiled code writes or returns one
    wrong value (``None``: none does, and nothing is said)."""
    from amp_plugin.master_weights._compiled_bits import FUNCTIONS

    expected, _ = train("torch", "bf16_split", BF16, "stochastic", steps=2, scaled=False)
    assert _compiled.available(torch.device("cpu"), True)
    real = _compiled._fn

    def wrong(*args):
        out = FUNCTIONS[name](*args)
        written = [a for a in args if isinstance(a, list)][-1][:1]  # a store's last list: exp_avg_sq
        for t in _compiled._tensors(out) or written:
            t.view(-1)[-1] += 1
        return out

    monkeypatch.setattr(_compiled, "_fn", lambda n: wrong if n == name else real(n))
    monkeypatch.setattr(_compiled, "_seen", set())
    monkeypatch.setitem(_compiled._state, "eager", False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got, _ = train("compiled", "bf16_split", BF16, "stochastic", steps=2, scaled=False)
    caught = [str(w.message) for w in said if "gives other bits" in str(w.message)]
    assert _compiled._state["eager"] is (name is not None)
    assert len(caught) == (name is not None), caught
    if name is not None:
        assert f"the compiled {name!r} gives other bits than the same function uncompiled" in caught[0]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
