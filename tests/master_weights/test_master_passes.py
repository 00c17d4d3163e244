"""The passes' step (``fused="compiled"``, ``"triton"``): a group worked through in slabs of pieces of its
tensors, each slab's FP32 copies made, updated by torch's fused Adam and stored before the next, with the bits
of one pass over whole tensors (strided parameters: ``test_master_layouts.py``)."""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import _compiled, _multi_tensor
from amp_plugin.master_weights._step import step_kernels
from tests.master_weights import test_master_compiled as compiled_tests
from tests.master_weights.test_master_compiled import BF16, SIZES, train


@pytest.mark.parametrize("limit, numels", [(8, [0, 3, 8, 9, 20, 1, 1]), (1000, [70001, 2, 999, 1, 1000, 34])])
def test_slabs_cut_each_tensor_at_multiples_of_the_limit_and_cover_it_once(limit, numels):
    slabs = list(_multi_tensor.slabs(numels, limit))
    seen = {n: [] for n in range(len(numels))}
    for slab in slabs:
        assert sum(b - a for _, a, b in slab) <= limit
        for n, a, b in slab:
            assert a % limit == 0 and (b == numels[n] or b % limit == 0) and a <= b
            seen[n].append((a, b))
    for n, numel in enumerate(numels):
        edges = [a for a, _ in seen[n]] + [seen[n][-1][1]]
        assert edges[0] == 0 and edges[-1] == numel and edges == sorted(edges)
        assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(seen[n]))
    # the pieces in the tensors' order, a slab closed only when the next piece does not fit
    flat = [p for slab in slabs for p in slab]
    assert [n for n, _, _ in flat] == sorted(n for n, _, _ in flat)
    for slab, following in itertools.pairwise(slabs):
        n, a, b = following[0]
        assert sum(y - x for _, x, y in slab) + b - a > limit


def _fused_adamw(n: int, cuts: list[int], threads: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-6
    step = torch.tensor(5.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for a, b in itertools.pairwise([0, *cuts, n]):
            torch._fused_adamw_(
                [p[a:b]], [g[a:b]], [m[a:b]], [v[a:b]], [], [step],
                amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, maximize=False,
            )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    return [t.view(torch.int32) for t in (p, m, v)]


def test_torchs_fused_adam_gives_each_element_its_bits_wherever_a_tensor_is_cut_at_a_multiple_of_8():
    """What the slabs rest on: torch's fused CPU Adam rounds the last ``numel % 8`` elements of a call otherwise
    than the rest (its scalar tail), whatever the thread count, so calls over pieces cut at multiples of 8 give
    one call's bits. A torch that changes this fails here, not silently in the lean step."""
    assert _multi_tensor.SLAB_ELEMENTS % 8 == 0
    n = 100_003  # a tail of 3
    whole = _fused_adamw(n, [], 1)
    for cuts, threads in [([], 2), ([8 * 1001, 8 * 5003], 1), ([8 * 1001, 8 * 5003], 2), ([64 * 1000], 2)]:
        for a, b in zip(_fused_adamw(n, cuts, threads), whole, strict=True):
            assert torch.equal(a, b), (cuts, threads)
    # calls of 15 elements, seven of them each call's tail: other bits (the test sees what it guards against)
    assert not all(torch.equal(a, b) for a, b in zip(_fused_adamw(n, list(range(15, n, 15)), 1), whole, strict=True))


@pytest.mark.parametrize("device", compiled_tests.DEVICES)
@pytest.mark.parametrize("fused", ["compiled", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("master", ["bf16_split", "stochastic", "fp32"])
@pytest.mark.parametrize("moments, rounding", [(BF16, "stochastic"), (BF16, "nearest")], ids=["sr", "rne"])
def test_a_step_in_small_slabs_gives_the_bits_of_the_torch_ops(monkeypatch, device, fused, master, moments, rounding):
    """Tensors cut into many pieces (every size of ``SIZES`` past the limit, odd and even, whole tensors and
    pieces in one slab): the rounding keys offset to each piece, torch's fused Adam per slab, the same bits
    (on CUDA: against the torch ops there, whose Adam rounds otherwise than the CPU's)."""
    if fused == "triton":
        pytest.importorskip("triton")
        if device == "cpu":  # the interpreter: small sizes
            monkeypatch.setattr(compiled_tests, "SIZES", (1, 7, 1000, 2100, 3, 33, 129, 2, 34))
    expected, _ = train("torch", master, moments, rounding, steps=3, device=device)
    monkeypatch.setattr(_multi_tensor, "SLAB_ELEMENTS", 520)
    got, opt = train(fused, master, moments, rounding, steps=3, device=device)
    assert [k.name for k in step_kernels(opt, {})] == [fused]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), a.shape


LEAN_KINDS = (("bf16_split", BF16), ("stochastic", BF16))


@pytest.mark.parametrize("device", compiled_tests.DEVICES)
@pytest.mark.parametrize("scaled", [False, True], ids=["no_scaler", "scaler"])
@pytest.mark.parametrize(
    "fused, master, moments",
    [
        *(("compiled", *kind) for kind in (*LEAN_KINDS, ("fp32", BF16), ("fp32", None))),
        *(pytest.param("triton", *kind, marks=pytest.mark.slow) for kind in LEAN_KINDS),
    ],
)
def test_the_bf16_gradients_are_upcast_a_slab_at_a_time(monkeypatch, device, fused, scaled, master, moments):
    """The step is handed the model's BF16 gradients (no loss scaler, the lean presets' default; or a scaler's
    ``unscale_`` that only checked them; built as the plugin builds it, ``unscaled_model_grads=False``) and
    makes their FP32 copies, unscaled, one slab at a time (each freed before the next slab's are made), where
    the torch ops copy the whole group first; the same bits (FP32 masters with FP32 moments: their gradients
    upcast whole). The passes' prepare makes a slab's (the Triton kernels in its launch), not torch's ops."""
    if fused == "triton":
        pytest.importorskip("triton")  # on the CPU: its interpreter
    expected, _ = train("torch", master, moments, "stochastic", steps=3, device=device, scaled=scaled, shown=False)
    monkeypatch.setattr(_multi_tensor, "SLAB_ELEMENTS", 520)
    seen: list[weakref.ref] = []
    update = _multi_tensor.fused_adam_update
    by_torch_ops = _multi_tensor._fp32_grads

    def counted(grads, inv_on):
        if moments is not None:  # a slab's half gradients: the prepare's
            assert not any(g.dtype is BF16 for g in grads), "a slab's BF16 gradients upcast by torch's ops"
        return by_torch_ops(grads, inv_on)

    monkeypatch.setattr(_multi_tensor, "_fp32_grads", counted)

    def recording(group, optimizer, lists, increment):
        grads = lists[1]
        assert all(g.dtype is torch.float32 for g in grads)
        if not increment:  # a slab's update
            assert all(ref() is None for ref in seen), "an earlier slab's FP32 gradients are still alive"
            parts = 4 if fused == "triton" else 1  # the Triton prepare's one buffer: values, moments and gradients
            assert all(g.untyped_storage().nbytes() <= 4 * 520 * parts for g in grads), "a larger FP32 gradient's"
            seen.extend(weakref.ref(g) for g in grads)
        return update(group, optimizer, lists, increment)

    monkeypatch.setattr(_multi_tensor, "fused_adam_update", recording)
    got, _ = train(fused, master, moments, "stochastic", steps=3, device=device, scaled=scaled, shown=False)
    assert len(seen) > 3 * len(SIZES) or moments is None
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b), a.shape


@pytest.mark.parametrize("fused", ["compiled", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("master", ["bf16_split", "stochastic", "fp32"])
def test_an_inf_clipping_and_a_frozen_layer_through_the_passes_give_the_torch_ops_bits(master, fused):
    """The scaler's ``unscale_`` only checks the gradients the passes read (torch's check, a factor of one: the
    model's gradients keep their bits), and leaves them pending: an inf skips its step and backs the scale off,
    master gradients read for clipping are made then, a layer without gradients is left out; every weight, remainder
    and moment as on the torch ops, which copy and unscale every gradient in ``unscale_``."""

    def run(fused):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8)).to(BF16)
        opt = MasterWeightOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True),
            master=master, moments_dtype=BF16, fused=fused, sr_seed=3, unscaled_model_grads=False,
        )  # fmt: skip
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
        for i in range(7):
            x = torch.randn(12, 16, generator=torch.Generator().manual_seed(i)).to(BF16)
            model[2].requires_grad_(i != 5)
            scaler.scale(model(x).float().pow(2).mean()).backward()
            if i == 3:
                model[0].weight.grad[1, 1] = float("inf")
            before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            scaler.unscale_(opt)
            after = [p.grad for p in model.parameters() if p.grad is not None]
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before, after))
            torch.nn.utils.clip_grad_norm_(opt.master_params()[:2], 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert scaler.skipped_steps == 1
        state = [s[k] for s in opt.state_dict()["state"].values() for k in ("exp_avg", "exp_avg_sq")]
        extra = [r.remainder for r in opt._records if r.remainder is not None]
        return [*model.parameters(), *extra, *state], scaler.get_scale(), opt

    if fused == "triton":
        pytest.importorskip("triton")  # on the CPU: its interpreter
    expected, scale, _ = run("torch")
    got, got_scale, opt = run(fused)
    assert [k.name for k in step_kernels(opt, {})] == [fused]
    assert got_scale == scale
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_the_step_holds_the_fp32_copies_of_one_slab_at_a_time(monkeypatch):
    monkeypatch.setattr(_multi_tensor, "SLAB_ELEMENTS", 520)
    made: list[weakref.ref] = []
    prepare = _compiled.prepare

    def recording(*args):
        assert all(ref() is None for ref in made), "an earlier slab's FP32 copies are still alive"
        out = prepare(*args)
        copies = [t for x in out if x is not None for t in x]
        assert sum(t.numel() for t in copies) <= 4 * 520  # the values, exp_avg, exp_avg_sq and gradients of one slab
        made.extend(weakref.ref(t) for t in copies)
        return out

    monkeypatch.setattr(_compiled, "prepare", recording)
    train("compiled", "bf16_split", BF16, "stochastic", steps=2)
    assert len(made) > 3 * len(SIZES)
