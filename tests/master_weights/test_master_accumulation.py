"""Gradient accumulation with FP32 masters: micro-batch gradients summed in FP32, as
Lightning's ``bf16-mixed`` sums them, and only when several backward passes meet before a step.

Oracle: the FP32 sum of every micro-batch's half-precision gradient in backward order (the
sum a ``bf16-mixed`` run computes), and a float64 sum for the error."""

from __future__ import annotations

import pytest
import torch
from _moments_oracle import on_a_bf16_neighbour

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights._parameter import GRAD_SLOT, MASTERS


def model_and_batches(dtype=torch.bfloat16, n=16, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dtype)
    batches = [torch.randn(16, 64).to(dtype) for _ in range(n)]
    return model, batches


def loss_of(model, x):
    return model(x).float().pow(2).mean()


def micro_grads(model, batches):
    """Each micro-batch's gradient alone, in the model's dtype (a fresh backward each)."""
    out = []
    for x in batches:
        model.zero_grad(set_to_none=True)
        loss_of(model, x).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def fp32_sums(per_batch):
    sums = [g.float() for g in per_batch[0]]
    for grads in per_batch[1:]:
        sums = [s + g.float() for s, g in zip(sums, grads)]
    return sums


@pytest.mark.parametrize("master", ["fp32", "bf16_split"])
@pytest.mark.parametrize("fused", [None, False, "torch"])
def test_sixteen_bf16_micro_batches_are_summed_in_fp32(fused, master):
    model, batches = model_and_batches()
    reference = fp32_sums(micro_grads(model, batches))
    ref_params = [p.detach().float().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), fused=fused, master=master)
    for x in batches:
        loss_of(model, x).backward()
    for master, expected in zip(opt.master_params(), reference):
        assert master.grad.dtype == torch.float32 and torch.equal(master.grad, expected)
    for p, expected in zip(model.parameters(), reference):
        assert torch.equal(p.grad, expected.to(p.dtype))  # the model's gradient: the sum, rounded once
    opt.step()
    for r, g in zip(ref_params, reference):
        r.grad = g
    ref_opt.step()
    for new, r in zip(opt.fp32_masters(), ref_params):
        assert torch.equal(new, r.detach())


def test_the_stochastic_kind_steps_the_fp32_sum_too():
    model, batches = model_and_batches(n=4)
    reference = fp32_sums(micro_grads(model, batches))
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), master="stochastic")
    for x in batches:
        loss_of(model, x).backward()
    for master, expected in zip(opt.master_params(), reference):
        assert torch.equal(master.grad, expected)


def test_the_fp32_sum_adds_no_error_to_the_micro_batch_gradients():
    """Summed by autograd in BF16, 16 micro-batches' gradients pick up an error of the order of
    BF16's precision on top of each one's own; summed in FP32 they pick up FP32's. Against the
    float64 sum of the same BF16 gradients, and of the float64 model's gradients."""
    model, batches = model_and_batches()
    per_batch = micro_grads(model, batches)
    exact_sum = sum(grads[0].double() for grads in per_batch)
    ref64 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).double()
    ref64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    for x in batches:
        loss_of(ref64, x.double()).backward()
    true_sum = ref64[0].weight.grad

    def error(g, against):
        return ((g.double() - against).norm() / against.norm()).item()

    plain = model_and_batches()[0]
    for x in batches:
        loss_of(plain, x).backward()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    for x in batches:
        loss_of(model, x).backward()
    summed = opt.master_params()[0].grad
    assert error(plain[0].weight.grad, exact_sum) > 1e-3  # BF16 accumulation: 15 roundings
    assert error(summed, exact_sum) < 1e-6  # FP32 accumulation
    assert error(summed, true_sum) < error(plain[0].weight.grad, true_sum)


def test_one_backward_keeps_no_fp32_gradient():
    """Nothing accumulated, nothing kept: the common case stays at 16 bytes per parameter."""
    model, batches = model_and_batches(n=2)
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
    for step in range(2):
        loss_of(model, batches[step]).backward()
        records = [MASTERS[p] for p in model.parameters()]
        assert all(r.acc is not None and r.acc.value is None for r in records)
        opt.step()
        opt.zero_grad()
    loss_of(model, batches[0]).backward()
    loss_of(model, batches[1]).backward()
    assert all(MASTERS[p].acc.value is not None for p in model.parameters())  # a window of two
    opt.step()
    assert all(MASTERS[p].acc.value is None for p in model.parameters())  # freed by the step
    assert all(GRAD_SLOT.__get__(m) is None for m in opt.master_params())


@pytest.mark.parametrize("fused", [None, False])
def test_fp16_accumulation_with_a_loss_scaler(fused):
    model, batches = model_and_batches(torch.float16, n=4)
    scale = 2.0**10
    reference = fp32_sums(micro_grads_scaled(model, batches, scale))
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), fused=fused)
    scaler = DynamicLossScaler(init_scale=scale)
    for x in batches:
        scaler.scale(loss_of(model, x)).backward()
    scaler.unscale_(opt)
    for master, expected in zip(opt.master_params(), reference):
        assert torch.equal(master.grad, expected * (1.0 / scale))
    scaler.step(opt)
    assert not scaler.last_step_skipped


def micro_grads_scaled(model, batches, scale):
    """Each micro-batch's gradient of ``loss * scale`` alone, in the model's dtype."""
    out = []
    for x in batches:
        model.zero_grad(set_to_none=True)
        (loss_of(model, x) * scale).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def test_an_overflow_in_any_micro_batch_skips_the_step():
    model, batches = model_and_batches(torch.float16, n=3)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    scaler = DynamicLossScaler(init_scale=2.0**10)
    before = opt.fp32_masters()
    for k, x in enumerate(batches):
        loss = loss_of(model, x)
        scaler.scale(loss * (1e30 if k == 1 else 1.0)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(opt.fp32_masters(), before))


def test_a_write_to_the_model_gradient_after_accumulating_wins():
    """Something else wrote the model's gradient since the last backward (an edit, DDP's
    all-reduce writing the average back): the step uses the model's gradient."""
    model, batches = model_and_batches(n=2)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    for x in batches:
        loss_of(model, x).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(0.5)
    for master, p in zip(opt.master_params(), model.parameters()):
        assert torch.equal(master.grad, p.grad.float())


def test_tensor_hooks_registered_after_wrapping_are_in_the_sum():
    model, batches = model_and_batches(n=3)
    reference = fp32_sums([[2 * g for g in grads] for grads in micro_grads(model, batches)])
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    for p in model.parameters():
        p.register_hook(lambda g: g * 2)
    for x in batches:
        loss_of(model, x).backward()
    for master, expected in zip(opt.master_params(), reference):
        assert torch.equal(master.grad, expected)


def test_a_parameter_frozen_when_wrapped_accumulates_in_fp32_once_unfrozen():
    model, batches = model_and_batches(n=2)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    for p in model[0].parameters():
        p.requires_grad_(True)
    reference = fp32_sums(micro_grads(model, batches))
    for x in batches:
        loss_of(model, x).backward()
    for master, expected in zip(opt.master_params(), reference):
        assert torch.equal(master.grad, expected)


def test_two_optimizers_over_a_shared_parameter_sum_once():
    model, batches = model_and_batches(n=2)
    reference = fp32_sums(micro_grads(model, batches))
    params = list(model.parameters())
    a = MasterWeightOptimizer(torch.optim.SGD(params, lr=1.0))
    b = MasterWeightOptimizer(torch.optim.SGD(params[:2], lr=1.0))
    for x in batches:
        loss_of(model, x).backward()
    for master, expected in zip(b.master_params(), reference[:2]):
        assert torch.equal(master.grad, expected)
    del a, b


class _Accumulating:
    """A Linear model trained with SGD(lr=1), one optimizer step over 4 micro-batches; it
    keeps a copy of itself as converted (BF16) at the start of fit and its batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        g = torch.Generator().manual_seed(1)
        self.data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def on_fit_start(self) -> None:
        import copy

        self.start = copy.deepcopy(self.net)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=16)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16_lean", "bf16_sr"])
def test_lightning_accumulate_grad_batches_sums_in_fp32(pl, precision):
    from amp_plugin.lightning import MixedPrecisionPlugin
    from tests._models import as_lightning, quiet_trainer

    model = as_lightning(pl, _Accumulating)()
    trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin(precision)], max_steps=1, accumulate_grad_batches=4)
    trainer.fit(model)
    start, dtype = model.start, model.start[0].weight.dtype
    scale = trainer.precision_plugin.scaler.get_scale() if precision == "fp16" else 1.0
    per_batch = []
    for (x,) in torch.utils.data.DataLoader(model.data, batch_size=16):
        start.zero_grad(set_to_none=True)
        (start(x.to(dtype)).float().pow(2).mean() / 4 * scale).backward()
        per_batch.append([p.grad.clone() for p in start.parameters()])
    expected = [p.detach().float() - g * (1.0 / scale) for p, g in zip(start.parameters(), fp32_sums(per_batch))]
    masters = trainer.optimizers[0].fp32_masters()
    if precision != "bf16_sr":
        assert all(torch.equal(m, e) for m, e in zip(masters, expected))
        return
    for weight, e in zip(masters, expected):  # no master: the exact step, rounded stochastically to BF16
        assert on_a_bf16_neighbour(weight, e)


def test_an_fp16_sum_beyond_fp16_range_is_an_overflow():
    """Each micro-batch's scaled FP16 gradient is finite, their sum is not (in FP16): the model's
    gradient shows inf, and the step is skipped, as without FP32 accumulation."""
    model = torch.nn.Linear(4, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    scaler = DynamicLossScaler(init_scale=2.0**14)
    x = torch.full((1, 4), 3.0, dtype=torch.float16)
    for _ in range(2):
        scaler.scale(model(x).float().sum()).backward()  # 3 * 2^14 = 49152 each, 98304 summed
    assert torch.isinf(model.weight.grad).all()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0**13


def test_without_fp32_accumulation_autograd_accumulates_and_no_hook_runs():
    """accumulate_fp32=False (what the plugin passes with one backward per step): no hooks, no sum."""
    model, batches = model_and_batches(n=2)
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), accumulate_fp32=False)
    for x in batches:
        loss_of(model, x).backward()
    assert all(MASTERS[p].acc is None for p in model.parameters())
    for master, p in zip(opt.master_params(), model.parameters()):
        assert torch.equal(master.grad, p.grad.float())  # the BF16 sum autograd made
    with pytest.raises(TypeError, match="accumulate_fp32='yes' is not allowed"):
        MasterWeightOptimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0), accumulate_fp32="yes")


def test_the_plugin_hooks_accumulation_only_where_a_step_can_see_several_backwards(pl):
    from amp_plugin.lightning import MixedPrecisionPlugin
    from tests._models import as_lightning, quiet_trainer

    for accumulate, hooked in ((1, False), (2, True)):
        model = as_lightning(pl, _Accumulating)()
        trainer = quiet_trainer(
            pl, plugins=[MixedPrecisionPlugin("bf16")], max_steps=1, accumulate_grad_batches=accumulate
        )
        trainer.fit(model)
        assert bool(trainer.optimizers[0]._accumulators) == hooked
