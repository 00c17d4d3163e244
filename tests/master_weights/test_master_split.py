"""BF16 masters as the BF16 weight plus a 16-bit remainder (``master="bf16_split"``): the
masters are FP32 masters bit for bit, the weight is the master rounded to nearest, clipping
sees FP32 gradients, 14 bytes of training state per parameter with AdamW, checkpoints move
between the two kinds."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer

OPTIMIZERS = {  # fused=True: the update bf16_split computes (on FP32 masters: the reference)
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, fused=True),
    "adamw_maximize": lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.3, 0.95), maximize=True, fused=True),
}


def model(seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 5))
    net[0].bfloat16()
    net[2].bfloat16()
    return net


def rounded(x: torch.Tensor) -> torch.Tensor:
    """The BF16 weight of the FP32 master ``x``: rounded to nearest, ties away from zero (as
    ``x.to(torch.bfloat16)`` except at a tie whose lower neighbour is even), upcast."""
    bits = x.view(torch.int32)
    up = ((bits & 0xFFFF) >= 0x8000).to(torch.int32) << 16
    ours = ((bits & -65536) + up).view(torch.float32)
    ties = (bits & 0x1FFFF) == 0x8000
    assert torch.equal(ours[~ties], x[~ties].bfloat16().float())
    return ours


def grads_for(net, step, scale=1.0):
    for i, p in enumerate(net.parameters()):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)) * 1e-2
        p.grad = (g.to(p.dtype).float() * scale).to(p.dtype)


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_split_masters_are_fp32_masters_and_the_weight_is_the_master_rounded(name, fused):
    """Fed the same gradients, the split masters follow the FP32 masters bit for bit, on the
    kernel (fused=None) and on the torch-ops path (fused=False)."""
    fp32_net, split_net = model(), model()
    fp32_opt = MasterWeightOptimizer(OPTIMIZERS[name](fp32_net.parameters()))
    split_opt = MasterWeightOptimizer(OPTIMIZERS[name](split_net.parameters()), fused=fused, master="bf16_split")
    sched = torch.optim.lr_scheduler.StepLR(split_opt, step_size=2, gamma=0.5)
    fp32_sched = torch.optim.lr_scheduler.StepLR(fp32_opt, step_size=2, gamma=0.5)
    for step in range(6):
        grads_for(fp32_net, step)
        grads_for(split_net, step)
        fp32_opt.step()
        split_opt.step()
        sched.step()
        fp32_sched.step()
        for a, b in zip(fp32_opt.fp32_masters(), split_opt.fp32_masters()):
            assert torch.equal(a, b), step
    masters = split_opt.fp32_masters()
    halves = [p for p in split_net.parameters() if p.dtype == torch.bfloat16]
    for master, weight, ref in zip(masters, halves, [p for p in fp32_net.parameters() if p.dtype != torch.float32]):
        assert torch.equal(weight.float(), rounded(master))
        assert torch.equal(weight, ref)  # the FP32-master model's weight, bit for bit (no tie here)
    for a, b in zip(split_net[1].parameters(), fp32_net[1].parameters()):  # FP32 LayerNorm: its own master
        assert torch.equal(a, b)


def test_the_kernel_and_the_torch_ops_path_agree_with_a_scaler():
    runs = []
    for fused in (None, False):
        net = model()
        opt = MasterWeightOptimizer(OPTIMIZERS["adamw"](net.parameters()), fused=fused, master="bf16_split")
        scaler = DynamicLossScaler(init_scale=2.0**8)
        for step in range(5):
            grads_for(net, step, scaler.get_scale())
            if step == 2:
                net[0].weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            if step != 2:  # the master gradients are FP32 and unscaled; the model's show them rounded
                assert opt.master_params()[3].grad.dtype == torch.float32
                assert opt.master_params()[3].grad.abs().max() < 1 and net[2].bias.grad.abs().max() < 1
            torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.05)
            scaler.step(opt)
            scaler.update()
        assert scaler.skipped_steps == 1
        runs.append((opt.fp32_masters(), [p.detach().clone() for p in net.parameters()]))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1]):
        assert torch.equal(a, b)


def state_bytes(net, opt):
    seen, total = set(), 0
    tensors = [*net.parameters(), *(p.grad for p in net.parameters())]
    tensors += [p for g in opt.param_groups for p in g["params"]] + opt.master_tensors()
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def test_training_state_is_14_bytes_per_parameter():
    net = torch.nn.Linear(512, 512).bfloat16()
    opt = MasterWeightOptimizer(torch.optim.AdamW(net.parameters(), fused=True), master="bf16_split")
    net(torch.randn(4, 512).bfloat16()).float().sum().backward()
    opt.step()
    n = sum(p.numel() for p in net.parameters())
    assert state_bytes(net, opt) / n < 14.01  # weight 2 + gradient 2 + extension 2 + moments 8 (+ step counters)


def test_state_dicts_move_between_fp32_and_split_masters():
    net = model()
    opt = MasterWeightOptimizer(OPTIMIZERS["adamw"](net.parameters()), master="bf16_split")
    for step in range(3):
        grads_for(net, step)
        opt.step()
    saved, saved_masters = opt.state_dict(), opt.fp32_masters()
    assert all(m.dtype == torch.float32 for m in saved["master_params"])
    # into FP32 masters: the same masters, the weights rounded from them
    fp32_net = model(seed=1)
    fp32_opt = MasterWeightOptimizer(OPTIMIZERS["adamw"](fp32_net.parameters()))
    fp32_net.load_state_dict(net.state_dict())
    fp32_opt.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(fp32_opt.fp32_masters(), saved_masters))
    # and back into split masters: the weights rounded from them
    split_net = model(seed=2)
    split_opt = MasterWeightOptimizer(OPTIMIZERS["adamw"](split_net.parameters()), master="bf16_split")
    split_opt.load_state_dict(fp32_opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(split_opt.fp32_masters(), saved_masters))
    assert torch.equal(split_net[0].weight.float(), rounded(saved_masters[0]))
    # a plain optimizer state dict: the masters are the model's weights, exactly
    split_opt.load_state_dict(OPTIMIZERS["adamw"](model().parameters()).state_dict())
    assert torch.equal(split_opt.fp32_masters()[0], split_net[0].weight.float())


def test_a_write_to_the_model_clears_the_remainder():
    net = model()
    opt = MasterWeightOptimizer(OPTIMIZERS["adamw"](net.parameters()), master="bf16_split")
    grads_for(net, 0)
    opt.step()
    assert opt.master_tensors()[0].any()
    with torch.no_grad():
        net[0].weight.fill_(0.5)
    assert torch.equal(opt.fp32_masters()[0], torch.full_like(net[0].weight, 0.5, dtype=torch.float32))


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="master='bf16_split' is not possible here: it needs a BF16 model"):
        MasterWeightOptimizer(torch.optim.AdamW(torch.nn.Linear(2, 2).half().parameters()), master="bf16_split")
    with pytest.raises(ValueError, match="master='bf16' is not allowed: master must be one of 'fp32', 'bf16_split'"):
        MasterWeightOptimizer(torch.optim.AdamW(model().parameters()), master="bf16")
    net = model()
    MasterWeightOptimizer(torch.optim.AdamW(net.parameters()), master="bf16_split")
    with pytest.raises(ValueError, match="one master per parameter"):
        MasterWeightOptimizer(torch.optim.AdamW(net.parameters()))
    opt = MasterWeightOptimizer(torch.optim.AdamW(model().parameters()), master="bf16_split")
    with pytest.raises(TypeError, match="tag"):  # passed to AdamW's own step, which takes no such argument
        opt.step(tag=1)


def test_a_lightning_module_can_return_a_split_master_optimizer(pl):
    """The plugin keeps a MasterWeightOptimizer the module built itself."""
    from _models import TinyClassifier, as_lightning, quiet_trainer

    from amp_plugin import MixedPrecisionPlugin

    class Split(TinyClassifier):
        def configure_optimizers(self):
            return MasterWeightOptimizer(torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True), master="bf16_split")

    module = as_lightning(pl, Split)()
    trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin("bf16")], max_steps=4)
    trainer.fit(module)
    opt = trainer.optimizers[0]
    assert opt.master == "bf16_split"
    for weight, master in zip([p for p in module.parameters() if p.dtype == torch.bfloat16], opt.fp32_masters()):
        assert torch.equal(weight.float(), rounded(master))


def test_a_state_dict_reloaded_keeps_the_fp32_moments_exactly():
    """torch's load_state_dict casts state to the parameter's dtype (BF16 here); the moments stay FP32."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).bfloat16()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), master="bf16_split")
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        opt.step()
    saved = opt.state_dict()
    twin = torch.nn.Linear(8, 8).bfloat16()
    twin_opt = MasterWeightOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-3), master="bf16_split")
    twin_opt.load_state_dict(saved)
    for a, b in zip(opt.optimizer.state.values(), twin_opt.optimizer.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert b[key].dtype == torch.float32 and torch.equal(a[key], b[key])
    assert all(torch.equal(x, y) for x, y in zip(opt.fp32_masters(), twin_opt.fp32_masters()))


@pytest.mark.parametrize("fused", [None, False])
def test_clipping_sees_fp32_gradients_and_keeps_the_fp32_trajectory(fused):
    """With a scaler and clip_grad_norm_ on master_params(), split masters equal FP32 masters
    bit for bit: the clip is computed and applied to the FP32 master gradients (it used to act
    on the BF16 gradients, in BF16, and the masters left the FP32 trajectory)."""
    runs = []
    for master in ("fp32", "bf16_split"):
        net = model()
        opt = MasterWeightOptimizer(OPTIMIZERS["adamw"](net.parameters()), fused=fused, master=master)
        scaler = DynamicLossScaler(init_scale=2.0**8)
        norms = []
        for step in range(6):
            grads_for(net, step, scaler.get_scale())
            scaler.unscale_(opt)
            assert all(p.grad is None or p.grad.dtype == torch.float32 for p in opt.master_params())
            norms.append(torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.02))
            scaler.step(opt)
            scaler.update()
        runs.append((norms, opt.fp32_masters()))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
