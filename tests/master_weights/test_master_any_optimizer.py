"""The lean master kinds and BF16 state with every torch optimizer: the general path (the wrapped
optimizer's own ``step()`` over the FP32 values) against the same optimizer on FP32 copies."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import SRGenerator, round_stochastic, state_key, state_low_bits

BF16 = torch.bfloat16


class SignSGD(torch.optim.Optimizer):
    """A user's own optimizer: sign of a BF16-stored momentum, with decoupled weight decay."""

    def __init__(self, params, lr=1e-2, beta=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, beta=beta, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(state["momentum"].sign(), alpha=-group["lr"])


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "own_subclass": lambda ps: SignSGD(ps, lr=1e-3, weight_decay=0.1),
}


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(BF16) for shape in ((9, 7), (7,), (3, 9))]


def grad(step, i, shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + i)) * 1e-2


def fp32_run(make, steps, scale=None):
    """The oracle: the optimizer on FP32 copies of the BF16 weights, fed the BF16 gradients (unscaled)."""
    params = [torch.nn.Parameter(w.float()) for w in weights()]
    opt = make(params)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = grad(step, i, p.shape).to(BF16).float()
        opt.step()
    return params


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bf16_split_follows_any_optimizer_on_fp32_copies_bit_for_bit(name):
    """Scaled gradients through a DynamicLossScaler (a power-of-two scale: the unscale is exact)."""
    make = OPTIMIZERS[name]
    model = [torch.nn.Parameter(w) for w in weights()]
    opt = MasterWeightOptimizer(make(model), master="bf16_split")
    scaler = DynamicLossScaler(init_scale=2.0**10)
    for step in range(6):
        for i, p in enumerate(model):
            p.grad = (grad(step, i, p.shape).to(BF16).float() * scaler.get_scale()).to(BF16)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    for ours, ref, weight in zip(opt.fp32_masters(), fp32_run(make, 6), model):
        assert torch.equal(ours, ref.detach())
        assert weight.dtype is BF16
        assert opt.master_tensors()[0].dtype is torch.int16  # 2 bytes of remainder, no FP32 master


def round_state(opt_ref, params, generator, rounding):
    """The oracle's BF16 state: every per-element floating state tensor rounded after each step."""
    keys = generator.keys(list(range(len(params)))) if generator is not None else None
    for i, p in enumerate(params):
        for name, value in opt_ref.state[p].items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape == p.shape and value.is_floating_point():
                out = torch.empty(value.shape, dtype=BF16)
                if rounding == "stochastic":
                    round_stochastic(value, out, state_key(keys[i], name), low=state_low_bits(name))
                else:
                    out.copy_(value)
                value.copy_(out)


@pytest.mark.filterwarnings("ignore::amp_plugin.master_weights.FrozenMomentWarning")
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("name", ["sgd_momentum_nesterov_wd", "rmsprop", "adagrad", "adamw_foreach", "own_subclass"])
def test_bf16_state_of_any_optimizer_gives_the_rounded_state_oracle(name, rounding):
    """BF16 state with a general optimizer: computed in FP32 by the optimizer's own step, stored in
    BF16 after it (SGD's momentum buffer, RMSprop's square_avg, Adagrad's sum, ... all of them)."""
    make = OPTIMIZERS[name]
    model = [torch.nn.Parameter(w) for w in weights()]
    seed = 17 if rounding == "stochastic" else None
    opt = MasterWeightOptimizer(
        make(model), master="bf16_split", moments_dtype=BF16, moments_rounding=rounding, sr_seed=seed
    )
    ref = [torch.nn.Parameter(w.float()) for w in weights()]
    ref_opt = make(ref)
    round_state(ref_opt, ref, None, "nearest")  # state made at construction (Adagrad's sum) is stored rounded too
    generator = SRGenerator(17) if rounding == "stochastic" else None
    for step in range(6):
        for i, (p, q) in enumerate(zip(model, ref)):
            q.grad = grad(step, i, q.shape).to(BF16).float()
            p.grad = q.grad.to(BF16)
        opt.step()
        ref_opt.step()
        round_state(ref_opt, ref, generator, rounding)
    for ours, theirs, master in zip(opt.fp32_masters(), ref, opt.master_params()):
        assert torch.equal(ours, theirs.detach())
        state = opt.state[master]
        per_element = [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        assert per_element and all(v.dtype is BF16 for v in per_element)


@pytest.mark.parametrize("name", ["sgd_momentum_nesterov_wd", "rmsprop", "own_subclass"])
def test_stochastic_master_with_any_optimizer_gives_its_oracle(name):
    """``master="stochastic"``: each step runs from the BF16 weight upcast, and the result is rounded
    stochastically with the step's keys (the state in BF16, rounded with its own keys)."""
    make = OPTIMIZERS[name]
    model = [torch.nn.Parameter(w) for w in weights()]
    opt = MasterWeightOptimizer(make(model), master="stochastic", moments_dtype=BF16, sr_seed=5)
    ref = [torch.nn.Parameter(w.float()) for w in weights()]
    ref_opt = make(ref)
    generator = SRGenerator(5)
    for step in range(5):
        for i, (p, q) in enumerate(zip(model, ref)):
            q.grad = grad(step, i, q.shape).to(BF16).float()
            p.grad = q.grad.to(BF16)
        opt.step()
        ref_opt.step()
        keys = list(generator.keys(list(range(len(ref)))))
        generator.counter -= 1  # round_state draws this step's keys again
        round_state(ref_opt, ref, generator, "stochastic")
        with torch.no_grad():
            for q, key in zip(ref, keys):
                out = torch.empty(q.shape, dtype=BF16)
                round_stochastic(q.detach(), out, key)
                q.copy_(out)
    for ours, theirs in zip(model, ref):
        assert torch.equal(ours.float(), theirs.detach())


def test_general_path_resumes_bit_for_bit_and_loads_across_kinds():
    make = OPTIMIZERS["sgd_momentum_nesterov_wd"]

    def build(master="bf16_split", moments=BF16):
        model = [torch.nn.Parameter(w) for w in weights()]
        seed = 2 if moments is BF16 else None
        return model, MasterWeightOptimizer(make(model), master=master, moments_dtype=moments, sr_seed=seed)

    def run(model, opt, steps):
        for step in steps:
            for i, p in enumerate(model):
                p.grad = grad(step, i, p.shape).to(BF16)
            opt.step()

    model, opt = build()
    run(model, opt, range(6))
    half_model, half = build()
    run(half_model, half, range(3))
    saved = half.state_dict()
    resumed_model, resumed = build()
    with torch.no_grad():
        for p, q in zip(resumed_model, half_model):
            p.copy_(q)
    resumed.load_state_dict(saved)
    run(resumed_model, resumed, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(opt.fp32_masters(), resumed.fp32_masters()))
    _, fp32_opt = build("fp32", None)
    fp32_opt.load_state_dict(saved)  # the split masters are exact FP32 values: nothing rounded
    assert all(torch.equal(a, b) for a, b in zip(fp32_opt.fp32_masters(), half.fp32_masters()))


def test_step_hooks_and_closures_of_the_wrapped_optimizer_run_on_the_general_path():
    model = [torch.nn.Parameter(w) for w in weights()]
    inner = torch.optim.AdamW(model, lr=1e-3)
    calls = []
    inner.register_step_post_hook(lambda o, args, kwargs: calls.append(1))
    opt = MasterWeightOptimizer(inner, master="bf16_split", moments_dtype=BF16)

    def closure():
        for i, p in enumerate(model):
            p.grad = grad(0, i, p.shape).to(BF16)
        return torch.tensor(1.0)

    assert float(opt.step(closure)) == 1.0
    assert calls == [1]  # the own step ran (its hook with it), not the fused kernel


@pytest.mark.parametrize("preset, master", [("bf16_lean", "bf16_split"), ("bf16_sr", "stochastic")])
def test_the_lean_presets_train_a_lightning_module_whose_optimizer_is_sgd(pl, preset, master):
    from _models import TinyClassifier, as_lightning, quiet_trainer

    from amp_plugin import MixedPrecisionPlugin

    class Recorded(TinyClassifier):
        losses: list[float]

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

    module = as_lightning(pl, Recorded)(optimizer="sgd", lr=0.1)
    module.losses = []
    trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin(preset)], max_steps=40)
    trainer.fit(module)
    opt = trainer.optimizers[0]
    assert isinstance(opt, MasterWeightOptimizer) and opt.master == master
    assert isinstance(opt.optimizer, torch.optim.SGD)
    buffers = {tuple(s["momentum_buffer"].shape): s["momentum_buffer"].dtype for s in opt.state.values()}
    assert buffers[(16, 8)] is BF16 and buffers[(2, 16)] is BF16  # the BF16 parameters' momentum: 2 bytes
    assert buffers[(16,)] is torch.float32 or module.net[1].weight.dtype is BF16  # LayerNorm kept in FP32
    first, last = sum(module.losses[:5]) / 5, sum(module.losses[-5:]) / 5
    assert last < 0.7 * first
