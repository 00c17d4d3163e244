"""The fused CPU kernel over the lean master kinds: BF16 weight and remainder, BF16 moments (to
nearest and stochastically), stochastic weights, and the all-16-bit loops at every vector width."""

from __future__ import annotations

import warnings

import pytest
import torch
from _fused_reference import ADAM_CONFIGS, reference_adam
from _moments_oracle import on_a_bf16_neighbour

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer


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
@pytest.mark.parametrize("late", [False, True], ids=["early", "late"])
def test_all_16_bit_steps_give_the_torch_ops_bits_at_every_width(master, rounding, adamw, maximize, late):
    """A BF16 gradient, a lean master and BF16 moments: every stream 16-bit, the kernel's own loops
    (thirty-two elements at a time with AVX-512, sixteen with AVX2, in 16-bit unpack order; then
    the narrower vectors and the tails). Sizes cover each width and every remainder below 64; the
    torch multi-tensor path (oracle-tested in tests/master_weights) computes the same bits. ``late``:
    from step 20,000 on, where the bias correction's square root is 1.0f and the kernel's widest
    loops leave out the division by it."""

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
            if late and step == 1:  # the state exists from the first step on
                for q in opt.master_params():
                    opt.state[q]["step"].fill_(20_000.0)
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


@pytest.mark.parametrize("master", ["stochastic", "bf16_split"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_nans_of_any_sign_and_payload_round_to_the_torch_ops_quiet_nan(master, rounding, adamw):
    """The kernel's roundings leave out their NaN handling for vectors whose new weights hold no NaN (no NaN
    moment then either); a vector with one takes the full path. Here weights and gradients hold NaNs of either
    sign and with payloads (a rounding without the check would keep them, or carry into them: 0xffc0, 0x7fc1)
    inside vectors of every width, no loss scaler, so the step runs on them (Adam's L2 term carries a NaN
    weight into its moments): the torch ops' bits, and every NaN the kernel rounds is c10's quiet NaN 0x7fc0.
    One difference is expected: moments rounded to nearest take torch's vectorised FP32 -> BF16 copy on the
    torch-ops path, which writes a NaN as 0xffff; there a NaN is compared as a NaN."""
    weights_nan = {3: 0xFFC0, 37: 0x7FC1, 70: 0xFF81}  # BF16 bit patterns: negative, payload, signalling
    grads_nan = {10: 0xFFC3, 50: 0x7F82}

    def planted(t, nans):
        bits = t.view(torch.int16)
        for i, b in nans.items():
            if i < t.numel():
                bits[i] = b - (1 << 16) if b >= 1 << 15 else b
        return t

    def run(fused_mode):
        sizes = [40, 77, 4099]
        params = [torch.nn.Parameter((torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.02).bfloat16())
                  for n in sizes]  # fmt: skip
        with torch.no_grad():
            for p in params:
                planted(p.data, weights_nan)
        inner = torch.optim.AdamW if adamw else torch.optim.Adam
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FrozenMomentWarning: "nearest" is checked on purpose
            opt = MasterWeightOptimizer(
                inner(params, lr=1e-3, weight_decay=0.01, fused=True),
                fused=fused_mode,
                master=master,
                moments_dtype=torch.bfloat16,
                moments_rounding=rounding,
                sr_seed=5 if "stochastic" in (master, rounding) else None,
            )
        for step in range(2):
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
                p.grad = planted(g.bfloat16(), grads_nan)
            opt.step()
        state = [opt.state[q][k] for q in opt.master_params() for k in ("exp_avg", "exp_avg_sq")]
        return [p.detach() for p in params] + state

    ours, theirs = run(None), run("torch")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        rounded = i >= 3 or master == "stochastic"  # the split weight keeps a NaN's bits, on both paths
        if rounded:
            assert torch.equal(a.isnan(), b.isnan()), i
            assert (a.view(torch.int16)[a.isnan()] == 0x7FC0).all(), i
        if i >= 3 and rounding == "nearest":
            a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)  # torch's vectorised copy: 0xffff (above)
        differ = (a.view(torch.int16) != b.view(torch.int16)).nonzero().flatten().tolist()
        assert not differ, f"tensor {i} ({a.numel()} elements) differs at {differ[:10]}"
    assert any(t.isnan().any() for t in ours[3:])  # NaN moments were rounded
