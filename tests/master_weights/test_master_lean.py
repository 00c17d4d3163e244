"""The lean master kinds: BF16 moments (``moments_dtype=torch.bfloat16``), ``master="stochastic"``,
and the ``bf16_lean``/``bf16_sr`` presets: exact oracles on every step path, stochastic rounding
that is unbiased and reproducible, bytes per parameter, checkpoints within and across kinds."""

from __future__ import annotations

import warnings

import pytest
import torch
from _moments_oracle import MomentStore

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import FrozenMomentWarning, MasterRoundingWarning
from amp_plugin.master_weights._stochastic import SRGenerator, round_stochastic

BF16 = torch.bfloat16
# amp_plugin's CPU kernel, torch's multi-tensor kernels, the wrapped optimizer's own step over the FP32 values
# (the general path: the oracles' fused rule because the optimizers here are built with fused=True)
PATHS = [None, "torch", False]


def model(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 5))
    net[0].to(BF16)
    net[2].to(BF16)
    return net


def halves(net):
    return [p for p in net.parameters() if p.dtype == BF16]


def grads_for(net, step, scale=1.0):
    for i, p in enumerate(net.parameters()):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)) * 1e-2
        p.grad = (g.to(p.dtype).float() * scale).to(p.dtype)


def adamw(params):
    """AdamW with torch's fused rule (the oracles'), so the general path (``fused=False``, its own
    step) gives the kernels' bits too."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def oracle(net, steps, moments=BF16, seed=None):
    """FP32 AdamW (torch's fused kernel) on FP32 copies of the weights, fed the same gradients;
    BF16 moments: upcast for each step, rounded after it (stochastically with the keys of
    ``seed``, to nearest without)."""
    params = [p.detach().float().clone() for p in net.parameters()]
    state = [(torch.zeros_like(p), torch.zeros_like(p), torch.zeros(())) for p in params]
    half = [p.dtype == BF16 for p in net.parameters()]
    index = [sum(half[:i]) for i in range(len(half))]  # position among the half-precision parameters
    store = MomentStore(seed)
    for step in range(steps):
        grads_for(net, step)
        store.next_step(sum(half))
        for j, (p, g, (m, v, t), is_half) in enumerate(
            zip(params, [q.grad.float() for q in net.parameters()], state, half)
        ):
            t += 1
            torch._fused_adamw_(
                [p], [g], [m], [v], [], [t], amsgrad=False, lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1,
                eps=1e-8, maximize=False, grad_scale=None, found_inf=None,
            )  # fmt: skip
            if is_half and moments is BF16:
                store.store(m, v, index[j])
    return [p for p, is_half in zip(params, half) if is_half], [p for p, is_half in zip(params, half) if not is_half]


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("fused", PATHS)
@pytest.mark.parametrize("master", ["fp32", "bf16_split"])
def test_bf16_moments_give_the_rounded_moment_oracle_bit_for_bit(master, fused, rounding):
    net = model()
    seed = 21 if rounding == "stochastic" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FrozenMomentWarning)
        opt = MasterWeightOptimizer(
            adamw(net.parameters()),
            fused=fused,
            master=master,
            moments_dtype=BF16,
            moments_rounding=rounding,
            sr_seed=seed,
        )
    for step in range(6):
        grads_for(net, step)
        opt.step()
    ref_half, ref_own = oracle(model(), 6, seed=seed)
    for ours, ref in zip(opt.fp32_masters(), ref_half):
        assert torch.equal(ours, ref)
    for ours, ref in zip(net[1].parameters(), ref_own):  # FP32 LayerNorm: its own master, FP32 moments
        assert torch.equal(ours, ref)
    for p in opt.master_params():
        if p.dim() == 2:
            state = opt.state[p]
            assert state["exp_avg"].dtype == BF16 and state["exp_avg_sq"].dtype == BF16


@pytest.mark.parametrize("fused", PATHS)
def test_bf16_split_is_fp32_adamw_bit_for_bit(fused):
    net = model()
    opt = MasterWeightOptimizer(adamw(net.parameters()), fused=fused, master="bf16_split")
    for step in range(6):
        grads_for(net, step)
        opt.step()
        ref_half, _ = oracle(model(), step + 1, moments=torch.float32)
        for ours, ref, weight in zip(opt.fp32_masters(), ref_half, halves(net)):
            assert torch.equal(ours, ref), step
            assert torch.equal(weight, ref.to(BF16)), step  # no tie among these values


def test_the_lean_kinds_hold_10_and_8_bytes_per_parameter():
    for master, expected in (("bf16_split", 10), ("stochastic", 8)):
        net = torch.nn.Linear(512, 512).to(BF16)
        opt = MasterWeightOptimizer(torch.optim.AdamW(net.parameters()), master=master, moments_dtype=BF16)
        net(torch.randn(4, 512).to(BF16)).float().sum().backward()
        opt.step()
        seen, total = set(), 0
        tensors = [*net.parameters(), *(p.grad for p in net.parameters()), *opt.master_tensors()]
        tensors += [p for g in opt.param_groups for p in g["params"]]  # placeholders: 4 bytes each
        tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        for t in tensors:
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        n = sum(p.numel() for p in net.parameters())
        assert expected <= total / n < expected + 0.01, master


def test_stochastic_rounding_is_unbiased():
    """Values at a fraction f of the way between two BF16 neighbours round up with probability f."""
    lower = torch.tensor(1.0 + 2.0**-7)  # a BF16 number; its ulp is 2**-7
    fractions = torch.tensor([0.001, 0.1, 0.25, 0.5, 0.9])
    x = (lower + fractions * 2.0**-7).repeat(4096, 1)  # 4096 draws of each
    out = torch.empty(x.shape, dtype=BF16)
    generator = SRGenerator(1234)
    for key, row, row_out in zip(generator.keys(list(range(4096))), x, out):
        round_stochastic(row, row_out, key)
    up = (out.float() > lower).double().mean(0)
    sigma = (fractions.double() * (1 - fractions.double()) / 4096).sqrt()
    assert torch.all((up - fractions.double()).abs() < 4 * sigma + 1e-3), up
    assert torch.all((out.float() == lower) | (out.float() == lower + 2.0**-7))


def test_stochastic_updates_too_small_for_bf16_land_on_average():
    """lr * update far below half a BF16 ulp: pure BF16 never moves, stochastic rounding moves by
    the FP32 updates on average (the reason the kind exists)."""
    weights = torch.nn.Parameter(torch.ones(20000, dtype=BF16))
    opt = MasterWeightOptimizer(torch.optim.AdamW([weights], lr=2.0**-12, weight_decay=0.0), master="stochastic")
    for _ in range(10):  # constant gradients: each Adam step moves the weights by lr, 1/16 of a BF16 ulp below 1.0
        weights.grad = torch.ones_like(weights)
        opt.step()
    assert torch.ones(1, dtype=BF16) - 2.0**-12 == 1.0  # rounded to nearest, every step would be lost
    assert abs(weights.float().mean().item() - (1 - 10 * 2.0**-12)) < 2e-4


def train_stochastic(seed, steps=5, fused=None, start=None):
    net = model()
    opt = MasterWeightOptimizer(
        torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True),
        fused=fused,
        master="stochastic",
        moments_dtype=BF16,
        sr_seed=seed,
    )
    for step in range(steps):
        grads_for(net, step)
        opt.step()
    return net, opt


def test_stochastic_rounding_reproduces_with_a_seed_and_on_every_path():
    runs = {fused: train_stochastic(7, fused=fused) for fused in PATHS}
    ref = [p.detach() for p in runs[None][0].parameters()]
    for fused in PATHS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ref, runs[fused][0].parameters())), fused
    other = train_stochastic(8)[0]
    assert not torch.equal(ref[0], other[0].weight)
    assert torch.equal(ref[0], train_stochastic(7)[0][0].weight)


@pytest.mark.parametrize(
    "master, moments", [("fp32", BF16), ("bf16_split", torch.float32), ("bf16_split", BF16), ("stochastic", BF16)]
)
def test_every_kind_resumes_bit_for_bit_from_its_state_dict(master, moments):
    def build():
        net = model()
        kwargs = dict(sr_seed=3) if master == "stochastic" else {}
        opt = MasterWeightOptimizer(adamw(net.parameters()), master=master, moments_dtype=moments, **kwargs)
        return net, opt

    def run(net, opt, steps):
        scaler = DynamicLossScaler(init_scale=2.0**8)
        for step in steps:
            grads_for(net, step, scaler.get_scale())
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.05)
            scaler.step(opt)
            scaler.update()

    net, opt = build()
    run(net, opt, range(6))
    half, saved = build()
    run(half, saved, range(3))
    checkpoint = (half.state_dict(), saved.state_dict())
    resumed_net, resumed = build()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MasterRoundingWarning)  # same kind: nothing rounded
        resumed_net.load_state_dict(checkpoint[0])
        resumed.load_state_dict(checkpoint[1])
    run(resumed_net, resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed_net.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt.fp32_masters(), resumed.fp32_masters()))
    for a, b in zip(opt.state.values(), resumed.state.values()):
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def trained(master="fp32", moments=torch.float32, seed=0):
    net = model(seed)
    opt = MasterWeightOptimizer(adamw(net.parameters()), master=master, moments_dtype=moments)
    for step in range(3):
        grads_for(net, step)
        opt.step()
    return net, opt


def test_an_fp32_checkpoint_into_bf16_lean_keeps_the_masters_and_says_the_moments_were_rounded():
    net, opt = trained()
    saved = opt.state_dict()
    lean_net, lean = trained("bf16_split", BF16, seed=1)
    lean_net.load_state_dict(net.state_dict())
    with pytest.warns(MasterRoundingWarning, match="moments were rounded to bfloat16") as record:
        lean.load_state_dict(saved)
    assert "master" not in str(record[0].message).split(";")[0]
    assert all(torch.equal(a, b) for a, b in zip(lean.fp32_masters(), opt.fp32_masters()))  # exact
    lean_moments = [(a, b) for a, b in zip(opt.state.values(), lean.state.values()) if b["exp_avg"].dtype == BF16]
    assert len(lean_moments) == 4  # the BF16 parameters' (the FP32 LayerNorm keeps FP32 moments)
    for a, b in lean_moments:
        assert torch.equal(b["exp_avg"], a["exp_avg"].to(BF16)) and torch.equal(
            b["exp_avg_sq"], a["exp_avg_sq"].to(BF16)
        )
    # and back: the FP32 masters exact, the BF16 moments upcast exactly, nothing to say
    fp32_net, fp32 = trained(seed=2)
    fp32_net.load_state_dict(lean_net.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", MasterRoundingWarning)
        fp32.load_state_dict(lean.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(fp32.fp32_masters(), opt.fp32_masters()))
    for a, b in zip(lean.state.values(), fp32.state.values()):
        assert b["exp_avg"].dtype == torch.float32 and torch.equal(b["exp_avg"], a["exp_avg"].float())


def test_an_fp32_checkpoint_into_stochastic_says_the_masters_were_rounded():
    _, opt = trained()
    sr_net, sr = trained("stochastic", BF16, seed=1)
    with pytest.warns(MasterRoundingWarning, match="FP32 masters were rounded to the BF16 weights"):
        sr.load_state_dict(opt.state_dict())
    for weight, master in zip(halves(sr_net), opt.fp32_masters()):
        assert torch.equal(weight, master.to(BF16))


def test_the_fused_update_rule_is_not_put_in_place_of_foreach_adam():
    """fused=True used to run torch's fused update for Adam(foreach=True): masters differing from
    foreach Adam's in some elements every step, silently. Asking for a fused kernel is refused; the
    lean kinds and BF16 moments take the optimizer's own (foreach) step instead."""
    for kwargs in (dict(fused=True), dict(fused="torch")):
        with pytest.raises(ValueError, match="foreach=True.*fused Adam update.*fused=True"):
            MasterWeightOptimizer(torch.optim.Adam(model().parameters(), foreach=True), **kwargs)
    MasterWeightOptimizer(torch.optim.Adam(model().parameters(), foreach=True))  # its own step: fine
    net = model()
    opt = MasterWeightOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True), master="bf16_split")
    ref = [p.detach().float().clone().requires_grad_() for p in model().parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=True)
    for step in range(4):
        grads_for(net, step)
        for p, q in zip(ref, net.parameters()):
            p.grad = q.grad.float()
        opt.step()
        ref_opt.step()
    halves = [p for p, q in zip(ref, net.parameters()) if q.dtype == BF16]
    assert all(torch.equal(a, b) for a, b in zip(opt.fp32_masters(), halves))  # foreach AdamW's bits


def test_bad_arguments_name_what_is_allowed():
    with pytest.raises(ValueError, match="moments_dtype=torch.float16 is not allowed"):
        MasterWeightOptimizer(adamw(model().parameters()), moments_dtype=torch.float16)
    with pytest.raises(ValueError, match="sr_seed=1 is not allowed with master='fp32'"):
        MasterWeightOptimizer(adamw(model().parameters()), sr_seed=1)
    fp16 = torch.nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match="master='stochastic' is not possible here: it needs a BF16 model"):
        MasterWeightOptimizer(torch.optim.AdamW(fp16.parameters()), master="stochastic")


@pytest.mark.parametrize("preset, master", [("bf16_lean", "bf16_split"), ("bf16_sr", "stochastic")])
def test_the_presets_through_the_plugin(pl, preset, master):
    from _models import TinyClassifier, as_lightning, quiet_trainer

    from amp_plugin import MixedPrecisionPlugin

    pl.seed_everything(0)
    module = as_lightning(pl, TinyClassifier)()
    plugin = MixedPrecisionPlugin(preset)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=3)
    trainer.fit(module)
    opt = trainer.optimizers[0]
    assert isinstance(opt, MasterWeightOptimizer) and opt.master == master and opt.moments_dtype is BF16
    assert plugin.settings.preset == preset and "BF16 Adam moments" in plugin.describe()
    moments = [s["exp_avg"] for p, s in opt.state.items() if p.dim() == 2]
    assert moments and all(m.dtype == BF16 for m in moments)
    assert not any(torch.isnan(p).any() for p in module.parameters())


def test_the_presets_from_the_app():
    from amp_plugin.settings import PRESETS, PrecisionSettings

    lean, sr = PrecisionSettings.build("bf16_lean"), PrecisionSettings.build("bf16_sr")
    assert (lean.master, lean.moments_dtype, sr.master, sr.moments_dtype) == ("bf16_split", BF16, "stochastic", BF16)
    assert PRESETS["bf16_split"].moments == "fp32"
    with pytest.raises(ValueError, match="master_weights=False contradicts precision='bf16_lean'"):
        PrecisionSettings.build("bf16_lean", master_weights=False)


def moment_drop(master, rounding, beta2, numel=1024, before=300, after=2000):
    """Gradients N(0, 1) for ``before`` steps, then 100x smaller: the stored ``exp_avg_sq`` and the
    mean update size of the last 100 steps (``benchmarks/bench_moments.py``'s regime, shorter)."""
    weight = torch.nn.Parameter(torch.ones(numel, dtype=BF16))
    moments = None if rounding is None else BF16
    seed = 5 if master == "stochastic" or rounding == "stochastic" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FrozenMomentWarning)
        opt = MasterWeightOptimizer(
            torch.optim.AdamW([weight], lr=1e-3, betas=(0.9, beta2), weight_decay=0.0),
            master=master,
            moments_dtype=moments,
            moments_rounding=rounding or "stochastic",
            sr_seed=seed,
        )
    gen = torch.Generator().manual_seed(0)
    sizes = []
    for step in range(before + after):
        weight.grad = (torch.randn(numel, generator=gen) * (1.0 if step < before else 0.01)).to(BF16)
        start = opt.fp32_masters()[0]
        opt.step()
        if step >= before + after - 100:
            sizes.append(float((opt.fp32_masters()[0] - start).abs().mean()))
    return opt.state[opt.master_params()[0]]["exp_avg_sq"].float(), sum(sizes)


@pytest.mark.slow
@pytest.mark.parametrize("beta2", [0.999, 0.9995])
@pytest.mark.parametrize("master", ["bf16_split", "stochastic"])
def test_bf16_moments_follow_fp32_moments_after_a_100x_gradient_drop(master, beta2):
    """Rounded to nearest, a BF16 exp_avg_sq cannot shrink at these betas (it stays at its peak and
    the updates shrink); rounded stochastically it follows FP32 moments' within the goals."""
    v_ref, size_ref = moment_drop("bf16_split", None, beta2)
    v_near, size_near = moment_drop(master, "nearest", beta2)
    v_sr, size_sr = moment_drop(master, "stochastic", beta2)
    assert float((v_near / v_ref).median()) > 2.0 and size_near / size_ref < 0.8  # the fault
    assert 1 / 1.5 < float((v_sr / v_ref).median()) < 1.5
    assert 1 / 1.33 < size_sr / size_ref < 1.33


def test_stochastic_moments_decay_on_average_where_nearest_ones_freeze():
    """One step of pure decay (zero gradient) at beta2 = 0.999: rounded to nearest, no element moves;
    stochastically, the mean moves by beta2 (within the sampling error of 4096 elements)."""
    v = torch.full((4096,), 1.0 + 2.0**-7, dtype=BF16)  # one ulp above 1: not a power of two
    for rounding in ("nearest", "stochastic"):
        weight = torch.nn.Parameter(torch.ones(4096, dtype=BF16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FrozenMomentWarning)
            opt = MasterWeightOptimizer(
                torch.optim.AdamW([weight], lr=1e-3), master="bf16_split", moments_dtype=BF16, moments_rounding=rounding
            )
        weight.grad = torch.zeros_like(weight)
        opt.step()  # builds the state
        state = opt.state[opt.master_params()[0]]
        state["exp_avg_sq"].copy_(v)
        weight.grad = torch.zeros_like(weight)
        opt.step()
        mean = float(state["exp_avg_sq"].float().mean())
        if rounding == "nearest":
            assert torch.equal(state["exp_avg_sq"], v)
        else:
            expected = float(v.float()[0]) * 0.999
            assert abs(mean - expected) < 4 * 2.0**-7 / 64  # 4 standard errors of a one-ulp coin, n = 4096


def test_rounding_to_nearest_warns_naming_the_beta_the_threshold_and_the_alternative():
    net = model()
    with pytest.warns(FrozenMomentWarning, match=r"beta2=0.999.*1 - 2\*\*-9 = 0.998046875.*'stochastic'"):
        MasterWeightOptimizer(adamw(net.parameters()), moments_dtype=BF16, moments_rounding="nearest")
    net = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FrozenMomentWarning)
        MasterWeightOptimizer(
            torch.optim.AdamW(net.parameters(), betas=(0.9, 0.99)), moments_dtype=BF16, moments_rounding="nearest"
        )
        MasterWeightOptimizer(torch.optim.AdamW(model().parameters()), moments_rounding="nearest")  # FP32 moments
    with pytest.raises(ValueError, match="moments_rounding='up' is not allowed"):
        MasterWeightOptimizer(adamw(model().parameters()), moments_dtype=BF16, moments_rounding="up")
    with pytest.raises(ValueError, match="sr_seed=3 is not allowed with master='bf16_split'"):
        MasterWeightOptimizer(adamw(model().parameters()), master="bf16_split", sr_seed=3)
    opt = MasterWeightOptimizer(adamw(model().parameters()), master="bf16_split", moments_dtype=BF16, sr_seed=3)
    assert opt.state_dict()["sr_generator"] == {"seed": 3, "counter": 0}  # BF16 moments draw bits: carried
