"""The fused CPU kernels of the master-weight step over FP32 masters: exact unscale, the inf check,
torch's Adam update bit for bit, the rounded weights written in the same pass (the lean kinds:
test_fused_lean.py; when the fused path runs: test_fused_paths.py)."""

from __future__ import annotations

import pytest
import torch
from _fused_reference import ADAM_CONFIGS, reference_adam

HALF = [torch.float16, torch.bfloat16]
# Sizes below and above the non-temporal-store threshold (2**20), odd ones for the tails.
SIZES = [1, 7, 1000, (1 << 20) + 13]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("numel", SIZES)
def test_unscale_into_equals_copy_then_unscale_bit_for_bit(ops, dtype, numel):
    g = torch.Generator().manual_seed(numel)
    half = (torch.randn(numel, generator=g) * 3000).to(dtype)
    out, found, inv = torch.full((numel,), float("nan")), torch.zeros(()), torch.tensor(2.0**-13)
    ops.unscale_into_([half], [out], found, inv)
    expected = half.float()
    torch._amp_foreach_non_finite_check_and_unscale_([expected], torch.zeros(()), inv)
    assert torch.equal(out, expected) and found.item() == 0.0


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_into_flags_non_finite_anywhere(ops, dtype, bad):
    for where in (0, 517, (1 << 20) + 12):
        half = torch.ones((1 << 20) + 13, dtype=dtype)
        half[where] = bad
        found = torch.zeros(())
        ops.unscale_into_(
            [torch.ones(5, dtype=dtype), half], [torch.empty(5), torch.empty(half.numel())], found, torch.tensor(0.5)
        )
        assert found.item() == 1.0


@pytest.mark.parametrize("dtype", HALF)
def test_unscale_copy_makes_new_fp32_tensors_like_copy_then_unscale(ops, dtype):
    g = torch.Generator().manual_seed(0)
    halves = [(torch.randn(*shape, generator=g) * 3000).to(dtype) for shape in ((3, 5), (7,), ((1 << 20) + 13,))]
    found = torch.zeros(())
    out = ops.unscale_copy(halves, found, torch.tensor(2.0**-13))
    expected = [h.float() for h in halves]
    torch._amp_foreach_non_finite_check_and_unscale_(expected, torch.zeros(()), torch.tensor(2.0**-13))
    for o, e in zip(out, expected):
        assert o.dtype == torch.float32 and o.is_contiguous() and o.shape == e.shape and torch.equal(o, e)
    assert found.item() == 0.0
    halves[1][3] = float("nan")
    ops.unscale_copy(halves, found, torch.tensor(1.0))
    assert found.item() == 1.0


def test_the_unscale_kernels_check_values_before_scaling_them_as_torch_does(ops):
    """A finite half value that the factor takes past FP32's range is not an overflow of the
    gradient: torch's unscale checks the value it reads, not the product."""
    half = torch.full((5,), 60000.0, dtype=torch.float16)
    inv = torch.tensor(2.0**120)
    torch_found = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([half.float()], torch_found, inv)
    for run in (
        lambda f: ops.unscale_into_([half], [torch.empty(5)], f, inv),
        lambda f: ops.unscale_copy([half], f, inv),
    ):
        found = torch.zeros(())
        run(found)
        assert found.item() == torch_found.item() == 0.0


def test_unscale_into_never_clears_a_raised_flag(ops):
    found = torch.ones(())
    ops.unscale_into_([torch.ones(3, dtype=torch.float16)], [torch.empty(3)], found, torch.tensor(1.0))
    assert found.item() == 1.0


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize(
    "adamw,betas,weight_decay,maximize",
    [
        (True, (0.9, 0.999), 0.01, False),
        (False, (0.9, 0.999), 0.0, False),
        (False, (0.9, 0.95), 0.1, True),  # Adam's L2 decay, maximize
        (True, (0.3, 0.99), 0.0, False),  # 1 - beta1 >= 0.5: the other branch of lerp
    ],
)
def test_adam_step_matches_torch_fused_adam_and_writes_the_rounded_weight(
    ops, dtype, numel, adamw, betas, weight_decay, maximize
):
    g = torch.Generator().manual_seed(1)
    master = (torch.randn(numel, generator=g) * 0.02).to(dtype).float()
    grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(12)]
    ref, ref_state = reference_adam(master, grads, adamw, betas=betas, weight_decay=weight_decay, maximize=maximize)
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    model = master.to(dtype)
    for grad in grads:
        ops.adam_step_([master], [grad], [m], [v], [step], [model], 1e-3, *betas, weight_decay, 1e-8, adamw, maximize)
        assert torch.equal(model, master.to(dtype))  # the model holds the rounded master after every step
    assert step.item() == 12
    # torch's fused kernel, element by element, its scalar tail included
    assert torch.equal(master, ref)
    assert torch.equal(m, ref_state["exp_avg"])
    assert torch.equal(v, ref_state["exp_avg_sq"])


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("adamw,betas,weight_decay,maximize", ADAM_CONFIGS)
def test_adam_step_equals_torch_fused_adam_on_every_element_tail_included(
    ops, adamw, betas, weight_decay, maximize, threads
):
    """torch's kernel finishes each tensor's last numel % 8 elements in a scalar loop that
    rounds one product differently: every numel from 1 to 40 (all tail lengths, tensors that
    are all tail) and a few large ones, bit for bit."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for numel in [*range(1, 41), 1000, 4099, (1 << 16) + 5, (1 << 20) + 13]:
            g = torch.Generator().manual_seed(numel)
            master = (torch.randn(numel, generator=g) * 0.02).half().float()
            grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(6)]
            ref, ref_state = reference_adam(
                master, grads, adamw, steps=6, betas=betas, weight_decay=weight_decay, maximize=maximize
            )
            m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
            for grad in grads:
                ops.adam_step_(
                    [master], [grad], [m], [v], [step], [None], 1e-3, *betas, weight_decay, 1e-8, adamw, maximize
                )
            for name, ours, theirs in (
                ("param", master, ref),
                ("exp_avg", m, ref_state["exp_avg"]),
                ("exp_avg_sq", v, ref_state["exp_avg_sq"]),
            ):
                differ = (ours != theirs).nonzero().flatten().tolist()
                assert not differ, f"numel={numel}: {name} differs from torch at {differ[:10]}"
    finally:
        torch.set_num_threads(previous)


LATE_STEP = 20_000  # 1 - beta2**step within 2**-24 of one for each beta2 of ADAM_CONFIGS


@pytest.mark.parametrize("adamw,betas,weight_decay,maximize", ADAM_CONFIGS)
def test_late_in_training_the_step_skips_a_division_by_one_and_keeps_torch_s_bits(
    ops, adamw, betas, weight_decay, maximize
):
    """Once the bias correction's square root rounds to 1.0f the kernel's vector loops leave out
    the division by it (sqrt(v) / 1.0f is sqrt(v)): torch's fused Adam, which still divides, gives
    the same bits, tails, a NaN and an inf gradient included. The early steps (the division kept) are
    test_adam_step_matches_torch_fused_adam_and_writes_the_rounded_weight's."""
    assert torch.tensor((1 - betas[1] ** (LATE_STEP + 1)) ** 0.5, dtype=torch.float32).item() == 1.0
    assert torch.tensor((1 - betas[1] ** 10) ** 0.5, dtype=torch.float32).item() != 1.0
    for numel in (37, 1000, (1 << 16) + 5):
        g = torch.Generator().manual_seed(numel)
        master = torch.randn(numel, generator=g) * 0.02
        m0, v0 = torch.randn(numel, generator=g) * 1e-3, torch.rand(numel, generator=g) * 1e-5
        grads = [torch.randn(numel, generator=g) * 1e-2 for _ in range(3)]
        grads[1][5], grads[1][numel - 2] = float("nan"), float("inf")  # NaN/inf masters, in a vector and the tail
        p = master.clone().requires_grad_()
        opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(
            [p], lr=1e-3, betas=betas, weight_decay=weight_decay, maximize=maximize, fused=True
        )
        opt.state[p] = {"step": torch.tensor(float(LATE_STEP)), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
        m, v, step = m0.clone(), v0.clone(), torch.tensor(float(LATE_STEP))
        for grad in grads:
            p.grad = grad.clone()
            opt.step()
            ops.adam_step_(
                [master], [grad], [m], [v], [step], [None], 1e-3, *betas, weight_decay, 1e-8, adamw, maximize
            )
        for name, ours, theirs in (
            ("param", master, p.detach()),
            ("exp_avg", m, opt.state[p]["exp_avg"]),
            ("exp_avg_sq", v, opt.state[p]["exp_avg_sq"]),
        ):
            differ = (ours.view(torch.int32) != theirs.view(torch.int32)).nonzero().flatten().tolist()
            assert not differ, f"numel={numel}: {name} differs from torch at {differ[:10]}"


@pytest.mark.parametrize("dtype", HALF)
def test_nonfinite_check_flags_any_inf_or_nan_and_only_reads(ops, dtype):
    """The inf check of the step decision reads the half gradients and nothing else: every
    position (vector body, the 16-wide tail, a tensor of one element), each kind of value."""
    for numel in (1, 15, 16, 17, 1000, (1 << 20) + 13):
        for where in sorted({0, numel // 2, numel - 1}):
            for bad in (float("inf"), float("-inf"), float("nan")):
                g = torch.full((numel,), 3.0, dtype=dtype)
                g[where] = bad
                before, version = g.clone(), g._version
                found = torch.zeros(())
                ops.nonfinite_check_([torch.ones(3, dtype=dtype), g], found)
                assert found.item() == 1.0, (numel, where, bad)
                assert g._version == version and torch.equal(g.isnan(), before.isnan())
        found = torch.zeros(())
        ops.nonfinite_check_([torch.full((numel,), 65504.0 if dtype is torch.float16 else 3e38, dtype=dtype)], found)
        assert found.item() == 0.0  # the largest finite values are finite
    found = torch.ones(())
    ops.nonfinite_check_([torch.ones(3, dtype=dtype)], found)
    assert found.item() == 1.0  # never cleared
    with pytest.raises(RuntimeError, match="float16/bfloat16"):
        ops.nonfinite_check_([torch.ones(3)], torch.zeros(()))


@pytest.mark.slow
@pytest.mark.parametrize("grad_dtype", HALF)
@pytest.mark.parametrize("inv_scale", [2.0**-10, 1.0, 1 / 3])
@pytest.mark.parametrize("adamw,betas,weight_decay,maximize", ADAM_CONFIGS)
def test_adam_step_reads_half_gradients_times_the_unscale_factor(
    ops, grad_dtype, inv_scale, adamw, betas, weight_decay, maximize
):
    """A half gradient read with the factor s steps as the FP32 gradient half.float() * s
    does (what copy-then-unscale stores), through torch's fused Adam: every element, the
    scalar tail included, whatever the factor (1/3 is not a power of two)."""
    for numel in [*range(1, 41), 4099, (1 << 20) + 13]:
        g = torch.Generator().manual_seed(numel)
        master = (torch.randn(numel, generator=g) * 0.02).half().float()
        halves = [(torch.randn(numel, generator=g) * 300).to(grad_dtype) for _ in range(4)]
        fp32 = [h.float() for h in halves]
        torch._amp_foreach_non_finite_check_and_unscale_(fp32, torch.zeros(()), torch.tensor(inv_scale))
        ref, ref_state = reference_adam(
            master, fp32, adamw, steps=4, betas=betas, weight_decay=weight_decay, maximize=maximize
        )
        m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
        model = master.half()
        for half in halves:
            ops.adam_step_(
                [master],
                [half],
                [m],
                [v],
                [step],
                [model],
                1e-3,
                *betas,
                weight_decay,
                1e-8,
                adamw,
                maximize,
                inv_scale,
            )
        for name, ours, theirs in (
            ("param", master, ref),
            ("exp_avg", m, ref_state["exp_avg"]),
            ("exp_avg_sq", v, ref_state["exp_avg_sq"]),
        ):
            differ = (ours != theirs).nonzero().flatten().tolist()
            assert not differ, f"numel={numel}: {name} differs from torch at {differ[:10]}"
        assert torch.equal(model, master.half())


def test_adam_step_without_a_model_tensor_updates_the_master_only(ops):
    master, grad = torch.randn(100), torch.randn(100)
    ref, _ = reference_adam(master, [grad], adamw=True, steps=1)
    ops.adam_step_(
        [master],
        [grad],
        [torch.zeros(100)],
        [torch.zeros(100)],
        [torch.zeros(())],
        [None],
        1e-3,
        0.9,
        0.999,
        0.01,
        1e-8,
        True,
        False,
    )
    assert torch.allclose(master, ref, rtol=2e-6, atol=0)


def test_kernels_reject_mismatched_tensors(ops):
    with pytest.raises(RuntimeError, match="sizes differ"):
        ops.unscale_into_([torch.ones(3, dtype=torch.float16)], [torch.empty(4)], torch.zeros(()), torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="expected a float32 tensor"):
        ops.unscale_into_(
            [torch.ones(3, dtype=torch.float16)],
            [torch.empty(3, dtype=torch.float64)],
            torch.zeros(()),
            torch.tensor(1.0),
        )
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.adam_step_(
            [torch.ones(4, 2).t()],
            [torch.ones(2, 4)],
            [torch.zeros(2, 4)],
            [torch.zeros(2, 4)],
            [torch.zeros(())],
            [None],
            1e-3,
            0.9,
            0.999,
            0.0,
            1e-8,
            True,
            False,
        )
