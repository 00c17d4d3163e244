"""The fused CPU kernels of the master-weight step: exact unscale, torch's Adam update, the
rounded weights written in the same pass, and the fallbacks around them."""

from __future__ import annotations

import warnings

import pytest
import torch
from _moments_oracle import on_a_bf16_neighbour

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, fused
from amp_plugin.fused import adam as fused_adam

HALF = [torch.float16, torch.bfloat16]
# Sizes below and above the non-temporal-store threshold (2**20), odd ones for the tails.
SIZES = [1, 7, 1000, (1 << 20) + 13]


@pytest.fixture(scope="module")
def ops():
    ops = fused.kernels()
    assert ops is not None, f"the fused kernels did not build here: {fused.unavailable_reason()}"
    return ops


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


def reference_adam(master, grads, adamw, steps=12, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, maximize=False):
    p = master.clone().requires_grad_()
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(
        [p], lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize, fused=True
    )
    for g in grads[:steps]:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


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


ADAM_CONFIGS = [  # adamw, betas, weight_decay, maximize
    (True, (0.9, 0.999), 0.01, False),
    (False, (0.9, 0.999), 0.0, False),
    (False, (0.9, 0.95), 0.1, True),
    (True, (0.3, 0.99), 0.0, False),
]


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


def reference_bf16_moments(master, grads, adamw, betas=(0.9, 0.999), weight_decay=0.01, maximize=False):
    """torch's fused Adam on an FP32 master whose moments are rounded to BF16 after every step
    (computed in FP32, stored in BF16): the oracle of moments_dtype=torch.bfloat16."""
    p = master.clone()
    m, v, step = torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros(())
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    for g in grads:
        mf, vf = m.float(), v.float()
        step += 1
        kernel([p], [g.float()], [mf], [vf], [], [step], amsgrad=False, lr=1e-3, beta1=betas[0], beta2=betas[1],
               weight_decay=weight_decay, eps=1e-8, maximize=maximize, grad_scale=None, found_inf=None)  # fmt: skip
        m.copy_(mf)
        v.copy_(vf)
    return p, m, v


@pytest.mark.slow
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("adamw,betas,weight_decay,maximize", ADAM_CONFIGS)
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_remainder_adam_step_is_torch_fused_adam_on_the_joined_master(
    ops, grad_dtype, adamw, betas, weight_decay, maximize, moments
):
    """BF16 weight + 16-bit remainder: the kernel updates the FP32 master they form exactly as
    torch's fused Adam does (BF16 moments: as the oracle that rounds them after each step), and
    writes back the weight rounded to nearest and the remainder."""
    from amp_plugin.master_weights._split import join, split_into

    for numel in [*range(1, 41), 4099, (1 << 20) + 13]:
        g = torch.Generator().manual_seed(numel)
        master = torch.randn(numel, generator=g) * 0.02  # full FP32 masters: both halves matter
        grads = [(torch.randn(numel, generator=g) * 1e-2).to(grad_dtype) for _ in range(4)]
        if moments is torch.float32:
            ref, ref_state = reference_adam(
                master, [x.float() for x in grads], adamw, steps=4, betas=betas, weight_decay=weight_decay,
                maximize=maximize,
            )  # fmt: skip
            ref_m, ref_v = ref_state["exp_avg"], ref_state["exp_avg_sq"]
        else:
            ref, ref_m, ref_v = reference_bf16_moments(master, grads, adamw, betas, weight_decay, maximize)
        weight, rem = torch.empty(numel, dtype=torch.bfloat16), torch.empty(numel, dtype=torch.int16)
        split_into(master, weight, rem)
        assert torch.equal(join(weight, rem), master)
        m, v, step = torch.zeros(numel, dtype=moments), torch.zeros(numel, dtype=moments), torch.zeros(())
        for grad in grads:
            ops.adam_step_bf16_(
                [weight], [rem], [grad], [m], [v], [step], [0], 1e-3, *betas, weight_decay, 1e-8, adamw, maximize
            )
        for name, ours, theirs in (("master", join(weight, rem), ref), ("exp_avg", m, ref_m), ("exp_avg_sq", v, ref_v)):
            differ = (ours != theirs).nonzero().flatten().tolist()
            assert not differ, f"numel={numel}: {name} differs from torch at {differ[:10]}"
        expected_weight = torch.empty_like(weight)
        split_into(ref, expected_weight, torch.empty_like(rem))
        assert torch.equal(weight, expected_weight)
        ties = (ref.view(torch.int32) & 0x1FFFF) == 0x8000  # halfway, the lower neighbour even: rounded up
        assert torch.equal(weight[~ties], ref[~ties].to(torch.bfloat16))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_adam_step_with_bf16_moments_is_the_rounded_moment_oracle(ops, grad_dtype):
    for numel in [*range(1, 20), 4099, (1 << 20) + 13]:
        g = torch.Generator().manual_seed(numel)
        master = torch.randn(numel, generator=g) * 0.02
        grads = [(torch.randn(numel, generator=g) * 1e-2).to(grad_dtype) for _ in range(3)]
        ref, ref_m, ref_v = reference_bf16_moments(master, grads, adamw=True)
        p, model = master.clone(), torch.empty(numel, dtype=torch.bfloat16)
        m, v, step = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(())
        for grad in grads:
            ops.adam_step_([p], [grad], [m], [v], [step], [model], 1e-3, 0.9, 0.999, 0.01, 1e-8, True, False, 1.0)
        assert torch.equal(p, ref) and torch.equal(m, ref_m) and torch.equal(v, ref_v), numel
        assert torch.equal(model, ref.to(torch.bfloat16))


def test_stochastic_adam_step_equals_the_torch_ops_rounding(ops):
    """No master: the kernel's update, rounded stochastically, is the FP32 update of the BF16
    weight rounded by _stochastic.round_stochastic with the same key (the torch-ops path), at
    every vector width and tail."""
    from amp_plugin.master_weights._stochastic import round_stochastic

    for numel in [*range(1, 41), 4099, (1 << 20) + 13]:
        g = torch.Generator().manual_seed(numel)
        weight = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
        grad = (torch.randn(numel, generator=g) * 1e-2).to(torch.bfloat16)
        ref, _ = reference_adam(weight.float(), [grad.float()], adamw=True, steps=1)
        expected = torch.empty_like(weight)
        round_stochastic(ref, expected, key=12345 + numel)
        m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())
        ops.adam_step_bf16_(
            [weight], [None], [grad], [m], [v], [step], [12345 + numel], 1e-3, 0.9, 0.999, 0.01, 1e-8, True, False
        )
        differ = (weight != expected).nonzero().flatten().tolist()
        assert not differ, f"numel={numel}: differs at {differ[:10]}"
        assert on_a_bf16_neighbour(weight, ref), numel


@pytest.mark.parametrize("master", ["stochastic", "bf16_split"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("adamw,maximize", [(True, False), (False, True)])
def test_all_16_bit_steps_give_the_torch_ops_bits_at_every_width(master, rounding, adamw, maximize):
    """A BF16 gradient, a lean master and BF16 moments: every stream 16-bit, the kernel's own loops
    (thirty-two elements at a time with AVX-512, sixteen with AVX2, in 16-bit unpack order; then
    the narrower vectors and the tails). Sizes cover each width and every remainder below 64; the
    torch multi-tensor path (oracle-tested in tests/master_weights) computes the same bits."""

    def run(fused_mode):
        sizes = [*range(1, 130), 4099, (1 << 16) + 77]
        params = [torch.nn.Parameter((torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).bfloat16())
                  for n in sizes]  # fmt: skip
        inner = torch.optim.Adam if not adamw else torch.optim.AdamW
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FrozenMomentWarning: "nearest" is checked on purpose
            opt = MasterWeightOptimizer(
                inner(params, lr=1e-3, weight_decay=0.01, maximize=maximize, fused=True),
                fused=fused_mode,
                master=master,
                moments_dtype=torch.bfloat16,
                moments_rounding=rounding,
                sr_seed=5 if "stochastic" in (master, rounding) else None,
                unscaled_model_grads=False,
            )
        scaler = DynamicLossScaler(init_scale=2.0**4)
        for step in range(3):
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
                p.grad = (g * 2.0**4 * 1e-2).bfloat16()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        state = [opt.state[q][k] for q in opt.master_params() for k in ("exp_avg", "exp_avg_sq")]
        return [p.detach() for p in params] + opt.fp32_masters() + state

    for i, (ours, theirs) in enumerate(zip(run(None), run("torch"), strict=True)):
        differ = (ours.view(torch.int16 if ours.dtype == torch.bfloat16 else torch.int32) != theirs.view(
            torch.int16 if theirs.dtype == torch.bfloat16 else torch.int32)).nonzero().flatten().tolist()  # fmt: skip
        assert not differ, f"tensor {i} ({ours.numel()} elements) differs at {differ[:10]}"


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


def half_model(seed=0):
    torch.manual_seed(seed)
    return (
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
        .half()
        .apply(lambda m: m.float() if isinstance(m, torch.nn.LayerNorm) else None)
    )


def train(fused_mode, steps=8, inf_at=(3,), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)):
    model = half_model()
    opt = MasterWeightOptimizer(optimizer(model.parameters()), fused=fused_mode)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = DynamicLossScaler(init_scale=2.0**12, growth_interval=3)
    torch.manual_seed(1)
    for i in range(steps):
        x = torch.randn(16, 64).half()
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if i in inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.5)  # clipping sees (and edits) the FP32 grads
        if scaler.step(opt) is not None or not scaler.last_step_skipped:
            sched.step()
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


def test_the_fused_path_trains_like_the_stock_path():
    fast_model, fast_opt, fast_scaler = train(None)
    _stock_model, stock_opt, stock_scaler = train(False)
    assert fast_scaler.skipped_steps == stock_scaler.skipped_steps == 1
    assert fast_scaler.get_scale() == stock_scaler.get_scale()
    for a, b in zip(fast_opt.master_params(), stock_opt.master_params()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(fast_model.parameters(), fast_opt.master_params()):
        assert torch.equal(a.detach(), b.detach().to(a.dtype))
    assert fast_opt.param_groups[0]["lr"] == stock_opt.param_groups[0]["lr"]
    # The state has the layout of torch's fused Adam: it loads into the stock path and back.
    stock_opt.load_state_dict(fast_opt.state_dict())
    fast_opt.load_state_dict(stock_opt.state_dict())


def test_the_fused_path_is_taken_only_when_it_applies(monkeypatch):
    calls = []
    real = fused_adam.adam_step
    monkeypatch.setattr("amp_plugin.fused.adam.adam_step", lambda *a: (calls.append(1), real(*a))[1])
    train(None, steps=2, inf_at=())
    assert len(calls) == 2  # AdamW(fused=True)
    calls.clear()
    train(None, steps=2, inf_at=(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))  # the user chose for-loop
    train(None, steps=2, inf_at=(), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-2))
    train(False, steps=2, inf_at=())
    assert calls == []
    train(True, steps=2, inf_at=(), optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))  # asked for explicitly
    assert len(calls) == 2


def test_fused_true_says_why_it_cannot_apply():
    with pytest.raises(ValueError, match="Adam and AdamW only, not SGD"):
        MasterWeightOptimizer(torch.optim.SGD(half_model().parameters(), lr=0.1), fused=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        MasterWeightOptimizer(torch.optim.Adam(half_model().parameters(), amsgrad=True), fused=True)
    with pytest.raises(TypeError, match="fused='yes'"):
        MasterWeightOptimizer(torch.optim.Adam(half_model().parameters()), fused="yes")


def test_a_failed_build_warns_once_and_the_stock_path_carries_on(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the broken build stays out of the real cache
    monkeypatch.setattr(fused, "_state", {"tried": False, "ops": None, "error": None})
    monkeypatch.setattr(fused, "_flags", lambda: ("amp_plugin_fused_broken", ["-this-flag-does-not-exist"]))
    monkeypatch.delattr(torch.ops.amp_plugin, "adam_step_", raising=False)
    monkeypatch.setattr(torch.ops, "amp_plugin", type("Empty", (), {})())
    with pytest.warns(RuntimeWarning, match="could not build its fused CPU kernels"):
        assert fused.kernels() is None
    assert "Error" in fused.unavailable_reason()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert fused.kernels() is None
        _model, _opt, scaler = train(None, steps=5)
    assert scaler.skipped_steps == 1
    with pytest.raises(ValueError, match="the kernels are unavailable"):
        MasterWeightOptimizer(torch.optim.AdamW(half_model().parameters(), fused=True), fused=True)


def test_the_environment_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(fused.ENV_SWITCH, "0")
    assert fused.kernels() is None
    assert fused.unavailable_reason() == f"{fused.ENV_SWITCH}=0 is set"


@pytest.mark.parametrize("contiguous", [True, False])
def test_every_gradient_is_unscaled_exactly_once_on_either_path(contiguous):
    """A non-contiguous half gradient is copied and unscaled by torch's multi-tensor ops; the
    FP32 parameters (their own master) must not be unscaled a second time on the way, and the
    model's half gradients are only read (``unscaled_model_grads=False``: by default an explicit
    ``unscale_`` writes the unscaled values into them)."""
    model = half_model()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), fused=True), unscaled_model_grads=False)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(model(torch.randn(4, 64).half()).float().sum()).backward()
    if not contiguous:
        model[0].weight.grad = model[0].weight.grad.t().contiguous().t()
    before = [p.grad.float().clone() for p in model.parameters()]
    half_before = [(p.grad, p.grad._version) for p in model.parameters() if p.dtype == torch.float16]
    scaler.unscale_(opt)
    for master, grad in zip(opt.master_params(), before):
        assert torch.equal(master.grad, grad * 2.0**-8)
    assert all(
        p.grad is g and g._version == v
        for p, (g, v) in zip([p for p in model.parameters() if p.dtype == torch.float16], half_before)
    )


def test_a_gradient_the_kernel_cannot_take_sends_the_step_the_stock_way():
    model = half_model()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    stock_model = half_model()
    stock = MasterWeightOptimizer(torch.optim.AdamW(stock_model.parameters(), lr=1e-2, fused=True), fused=False)
    x = torch.randn(4, 64).half()
    for net, o in ((model, opt), (stock_model, stock)):
        net(x).float().sum().backward()
        o.sync_grads()
        first = o.master_params()[0]
        first.grad = first.grad.t().contiguous().t()  # as a hook might leave it: not contiguous
        o.step()
    for a, b, p in zip(opt.master_params(), stock.master_params(), model.parameters()):
        assert torch.equal(a, b) and torch.equal(p.detach(), a.detach().to(p.dtype))


@pytest.mark.parametrize("fused_mode", [None, True])
def test_a_non_contiguous_parameter_takes_the_stock_way_for_itself(fused_mode, monkeypatch):
    """A transposed view made a Parameter: the fused unscale and step leave it (and its
    gradient) to stock ops instead of raising, and train exactly as the stock path."""
    calls = []
    real = fused_adam.adam_step
    monkeypatch.setattr("amp_plugin.fused.adam.adam_step", lambda *a: (calls.append(1), real(*a))[1])
    runs = {}
    for name, mode in (("fused", fused_mode), ("stock", False)):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(6, 4).half().t())  # (4, 6), not contiguous
        bias = torch.nn.Parameter(torch.randn(4).half())
        opt = MasterWeightOptimizer(torch.optim.AdamW([weight, bias], lr=1e-2, fused=True), fused=mode)
        scaler = DynamicLossScaler(init_scale=2.0**8)
        for i in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(i)).half()
            scaler.scale((x @ weight.t() + bias).float().pow(2).mean()).backward()
            assert not weight.grad.is_contiguous()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs[name] = [
            weight.detach().clone(),
            bias.detach().clone(),
            *(m.detach().clone() for m in opt.master_params()),
        ]
    assert len(calls) == 3  # the fused run took the fused step, the non-contiguous weight included
    for a, b in zip(runs["fused"], runs["stock"]):
        assert torch.equal(a, b)
    assert torch.equal(runs["fused"][0], runs["fused"][2].half())


def test_step_hooks_on_the_wrapped_optimizer_pause_the_fused_step(monkeypatch):
    calls = []
    real = fused_adam.adam_step
    monkeypatch.setattr("amp_plugin.fused.adam.adam_step", lambda *a: (calls.append(1), real(*a))[1])
    model = half_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    opt = MasterWeightOptimizer(inner)
    hooked = []

    def one_step():
        model(torch.randn(4, 64).half()).float().sum().backward()
        opt.step()
        opt.zero_grad()

    one_step()
    handle = inner.register_step_post_hook(lambda *_: hooked.append(1))
    one_step()  # the hook must run, so torch's own step does
    handle.remove()
    one_step()
    assert calls == [1, 1] and hooked == [1]
    hooked_inner = torch.optim.AdamW(half_model().parameters(), fused=True)
    hooked_inner.register_step_pre_hook(lambda *_: None)
    with pytest.raises(ValueError, match="step hooks, which the fused step would bypass"):
        MasterWeightOptimizer(hooked_inner, fused=True)


def test_a_refused_fused_true_leaves_the_optimizer_as_it_was():
    model = half_model()
    inner = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad=True"):
        MasterWeightOptimizer(inner, fused=True)
    assert [p.dtype for p in inner.param_groups[0]["params"]] == [p.dtype for p in model.parameters()]
    MasterWeightOptimizer(inner)  # not half wrapped: wrapping it again works
