"""Reading the masters' gradients in a plain loop gives the gradients the step will use,
with or without ``sync_grads()`` or a loss scaler's ``unscale_`` first.

Oracle: the same torch optimizer and ``clip_grad_norm_`` on an FP32 copy of the model given
the model's gradients upcast."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import MasterWeightOptimizer


def bf16_model_and_reference(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    model[0].bfloat16()
    model[2].bfloat16()
    ref = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    return model, ref


def backward(model, x):
    h = model[0](x.bfloat16()).float()
    model[2](model[1](h).bfloat16()).float().pow(2).mean().backward()


@pytest.mark.parametrize("fused", [None, False, "torch"])
def test_clip_grad_norm_of_the_masters_before_step_without_a_scaler(fused):
    model, ref = bf16_model_and_reference()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused is not False), fused=fused)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused is not False)
    for step in range(3):
        x = torch.randn(8, 32)
        backward(model, x)
        for p, r in zip(model.parameters(), ref.parameters()):
            r.grad = p.grad.float().clone()
        norm = torch.nn.utils.clip_grad_norm_(opt.master_params(), 1e-3)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
        assert torch.equal(norm, ref_norm) and norm > 1e-3  # it clipped
        opt.step()
        ref_opt.step()
        for m, r in zip(opt.master_params(), ref.parameters()):
            assert torch.equal(m.detach(), r.detach()), step
        opt.zero_grad()
        ref_opt.zero_grad()


def test_a_read_after_a_step_then_another_backward_steps_the_new_gradient():
    """A master gradient read after a step (the model's gradients stay until zero_grad),
    then a backward that accumulates onto them: the next step uses the accumulated gradient,
    not the one read before."""
    model, _ = bf16_model_and_reference()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    backward(model, torch.randn(8, 32))
    opt.step()
    assert torch.equal(opt.master_params()[0].grad, model[0].weight.grad.float())
    backward(model, torch.randn(8, 32))
    before = opt.fp32_masters()[0]
    summed = opt.master_params()[0].grad.clone()
    opt.step()
    assert torch.equal(opt.fp32_masters()[0], before - summed)
    assert not torch.equal(summed, model[0].weight.grad.float() * 0)  # a real gradient was stepped


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("master", ["fp32", "bf16_split"])
def test_torch_grad_scaler_then_the_recipes_clip_of_the_model_steps_the_unscaled_gradients(fused, master):
    """torch.amp.GradScaler with the AMP recipe's ``clip_grad_norm_(model.parameters(), max_norm)`` after
    ``unscale_``: GradScaler unscales the masters' gradients (it reads them, then unscales in place) and the
    clip scales the model's, which stay multiplied by the loss scale. The step uses the unscaled master
    gradients, with the warning that says to clip ``opt.master_params()``; it took the model's changed
    gradients, still scaled: an update 1024 times too large. Oracle: SGD on the FP32 copy given the
    gradients upcast, unscaled."""
    from amp_plugin.master_weights import MasterGradWarning

    model, ref = bf16_model_and_reference()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), master=master, fused=fused)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    torch.manual_seed(1)
    h = model[0](torch.randn(8, 32).bfloat16()).float()
    scaler.scale(model[2](model[1](h).bfloat16()).float().pow(2).mean()).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        r.grad = p.grad.float() / 1024.0
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # clips nothing, but writes the gradients
    with pytest.warns(MasterGradWarning, match=r"clip_grad_norm_\(optimizer.master_params\(\), max_norm\)"):
        scaler.step(opt)
    scaler.update()
    ref_opt.step()
    halves = [r for p, r in zip(model.parameters(), ref.parameters()) if p.dtype == torch.bfloat16]
    for m, r in zip(opt.fp32_masters(), halves, strict=True):
        assert torch.equal(m, r.detach())
