"""The master-weight step on torch's multi-tensor kernels (the CUDA path), run here on CPU
tensors with ``fused="torch"``: the same masters as the stock path bit for bit, a number of
kernel launches that does not grow with the number of parameters, and its selection."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import _multi_tensor
from amp_plugin.master_weights._step import step_kernels

CONFIGS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam_l2_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, maximize=True, fused=True),
    "adamw_betas": lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.3, 0.95), fused=True),
    "two_groups": lambda ps: torch.optim.AdamW(
        [{"params": ps[:3]}, {"params": ps[3:], "lr": 1e-3, "weight_decay": 0.0}], lr=1e-2, fused=True
    ),
}


def model_for(seed=0, dtype=torch.float16):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8)
    )
    for m in (model[0], model[2], model[3]):
        m.to(dtype)
    return model


def train(mode, config, dtype=torch.float16, steps=8, inf_at=(3,), frozen_at=(5,)):
    model = model_for(dtype=dtype)
    opt = MasterWeightOptimizer(CONFIGS[config](list(model.parameters())), fused=mode)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    for i in range(steps):
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(i)).to(dtype)
        model[3].requires_grad_(i not in frozen_at)  # a layer without gradients in some steps
        scaler.scale(model(x).float().pow(2).mean()).backward()
        if i in inf_at:
            model[0].weight.grad[1, 1] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(opt.master_params()[:2], 0.5)  # some masters read and clipped
        scaler.step(opt)
        if not scaler.last_step_skipped:
            sched.step()
        scaler.update()
        opt.zero_grad()
    return model, opt, scaler


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_multi_tensor_path_equals_the_stock_and_kernel_paths_bit_for_bit(config, dtype):
    runs = {mode: train(mode, config, dtype) for mode in ("torch", False, None)}
    (m_model, m_opt, m_scaler) = runs["torch"]
    assert m_scaler.skipped_steps == 1
    for mode in (False, None):
        model, opt, scaler = runs[mode]
        assert scaler.get_scale() == m_scaler.get_scale()
        for a, b in zip(m_opt.master_params(), opt.master_params()):
            assert torch.equal(a, b), mode
        for a, b in zip(m_model.parameters(), model.parameters()):
            assert torch.equal(a, b), mode
        for s_a, s_b in zip(m_opt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
            assert all(torch.equal(s_a[k], s_b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert m_opt.param_groups[0]["lr"] == runs[False][1].param_groups[0]["lr"]


def test_the_multi_tensor_path_runs_torch_kernels_not_the_wrapped_step(monkeypatch):
    calls = []
    real = _multi_tensor.torch_adam_step
    monkeypatch.setattr(_multi_tensor, "torch_adam_step", lambda *a: (calls.append(1), real(*a))[1])
    model = model_for()
    inner = torch.optim.AdamW(model.parameters(), fused=True)
    opt = MasterWeightOptimizer(inner, fused="torch")
    monkeypatch.setattr(inner, "step", lambda *a, **k: pytest.fail("the wrapped step ran"))
    scaler = DynamicLossScaler(init_scale=4.0)
    for _ in range(2):
        scaler.scale(model(torch.randn(3, 16).half()).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert len(calls) == 2


def top_level_ops(n_layers, mode="torch", show=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n_layers)]).half()
    opt = MasterWeightOptimizer(
        torch.optim.AdamW(model.parameters(), fused=True), fused=mode, unscaled_model_grads=show
    )
    scaler = DynamicLossScaler(init_scale=4.0)
    counts = None
    for _ in range(2):  # the second step: state exists
        scaler.scale(model(torch.randn(3, 8).half()).float().sum()).backward()
        with torch.profiler.profile() as prof:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        counts = {}
        for event in prof.events():  # ops called from Python: no op above them
            if event.name.startswith(OPS) and not any(a.name.startswith(OPS) for a in ancestors(event)):
                counts[event.name] = counts.get(event.name, 0) + 1
    return counts


OPS = ("aten::", "amp_plugin::")


def ancestors(event):
    while event.cpu_parent is not None:
        event = event.cpu_parent
        yield event


@pytest.mark.parametrize("mode", ["torch", None])
def test_the_number_of_kernel_launches_does_not_grow_with_the_parameters(mode):
    """Unscale + step + update on 2 and on 12 parameter tensors dispatch the same ops from
    Python (multi-tensor ops; per-tensor work stays inside them)."""
    few, many = top_level_ops(1, mode), top_level_ops(6, mode)
    assert few == many
    assert top_level_ops(1, mode, show=True) == top_level_ops(6, mode, show=True)  # unscaled grads shown too
    if mode == "torch":
        assert few["aten::_fused_adamw_"] == 1 and few["aten::_foreach_copy_"] == 1  # Adam, the copy back
        assert few["aten::_foreach_mul"] == 1  # the FP32 copies of the half gradients
        assert few["aten::_amp_foreach_non_finite_check_and_unscale_"] == 1
        assert few.get("aten::item", 0) + few.get("aten::_local_scalar_dense", 0) <= 2  # the skip decision
    else:
        assert few["amp_plugin::adam_step_"] == 1 and few["amp_plugin::nonfinite_check_"] == 1


def test_fused_torch_needs_adam_and_says_so():
    with pytest.raises(ValueError, match="fused='torch' is not possible here: .*Adam and AdamW only, not SGD"):
        MasterWeightOptimizer(torch.optim.SGD(model_for().parameters(), lr=0.1), fused="torch")
    with pytest.raises(ValueError, match="amsgrad=True"):
        MasterWeightOptimizer(torch.optim.AdamW(model_for().parameters(), amsgrad=True), fused="torch")
    with pytest.raises(TypeError, match="fused='yes' is not allowed.*'torch'"):
        MasterWeightOptimizer(torch.optim.AdamW(model_for().parameters()), fused="yes")


def test_parameters_off_the_cpu_select_the_multi_tensor_path(monkeypatch):
    """fused=None picks torch's kernels for non-CPU parameters (seen here by pretending): torch's fused
    Adam with the bit handling in Triton kernels, compiled if Triton fails, torch's ops if compiling fails."""
    model = model_for()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
    names = lambda: [k.name for k in step_kernels(opt, {})]  # noqa: E731
    assert names() == ["amp_plugin"]
    opt._chosen = None  # the choice is cached from the first step
    monkeypatch.setattr(opt, "_all_cpu", lambda: False)
    monkeypatch.setattr(opt, "_kernel_ops", lambda: None)  # amp_plugin's kernels are CPU-only
    assert names() == ["triton", "compiled", "torch"]
    opt._chosen = None
    opt.param_groups[0]["fused"] = False  # the user chose foreach/for-loop Adam: its own step
    assert names() == []


@pytest.mark.parametrize("fused", [None, "torch", "compiled", False])
@pytest.mark.parametrize("master", ["bf16_split", "stochastic", "fp32"])
def test_a_sparse_gradient_gets_torchs_own_refusal_on_every_path(fused, master):
    """torch's Adam refuses sparse gradients ("consider SparseAdam"); the fused paths decline them to the
    optimizer's own step, which says so, rather than failing inside a kernel with a message about backends."""
    emb = torch.nn.Embedding(20, 4, sparse=True).to(torch.bfloat16)
    opt = MasterWeightOptimizer(
        torch.optim.Adam(emb.parameters(), lr=1e-2, fused=True),
        master=master,
        moments_dtype=torch.bfloat16,
        fused=fused,
        sr_seed=1,
    )
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2, 2])).float().sum().backward()
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before)
