"""A copy of a model and its :class:`MasterWeightOptimizer` taken together (``copy.deepcopy``, pickling,
``torch.save``/``torch.load``: a snapshot to branch a run from) trains on as the original does, bit for bit,
and independently of it.

The oracle is the original run going on with the same gradients (its own bits are pinned against torch's
optimizer on FP32 copies elsewhere). A copy used to hold plain ``Parameter``s where the masters were, and
its first step failed (``'Parameter' object has no attribute '_amp_grad'``)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from amp_plugin import MasterWeightOptimizer
from amp_plugin.master_weights import MasterParameter

BF16 = torch.bfloat16
KINDS = [
    dict(master="fp32"),
    dict(master="bf16_split"),
    dict(master="bf16_split", moments_dtype=BF16),  # bf16_lean
    dict(master="stochastic", moments_dtype=BF16, sr_seed=5),  # bf16_sr
]


def copied(how, obj):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def train(model, opts, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen).to(BF16)
        model(x).float().pow(2).sum().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def bits(model, opts):
    tensors = [p.detach() for p in model.parameters()]
    for opt in opts:
        tensors += opt.fp32_masters()
        tensors += [t for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]
    return [t.reshape(-1).contiguous().view(torch.uint8) for t in tensors]


def model_and_optimizer(kind, fused, accumulate):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)).to(BF16)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    return model, MasterWeightOptimizer(inner, fused=fused, accumulate_fp32=accumulate, **kind)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k["master"] + ("_bf16_moments" if "moments_dtype" in k else ""))
def test_a_copy_of_model_and_optimizer_trains_on_as_the_original(kind, fused, how):
    model, opt = model_and_optimizer(kind, fused, accumulate=False)
    train(model, [opt], 2, seed=1)
    model2, opt2 = copied(how, (model, opt))
    assert all(isinstance(m, MasterParameter) for m in opt2._half_masters)
    assert [m.model_param() for m in opt2._half_masters] == list(model2.parameters())
    before = bits(model, [opt])
    train(model2, [opt2], 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(bits(model, [opt]), before, strict=True))  # the original untouched
    train(model, [opt], 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(bits(model2, [opt2]), bits(model, [opt]), strict=True))


def test_a_copy_keeps_fp32_accumulation_and_a_placeholder_stays_one_element():
    """The copy's accumulation hooks are its own (a sum over two micro-batches in FP32, as the original's),
    and a master kept as a placeholder (one NaN element broadcast) is copied as one element."""
    kind = dict(master="bf16_split", moments_dtype=BF16)
    model, opt = model_and_optimizer(kind, None, accumulate=True)
    train(model, [opt], 1, seed=1)
    model2, opt2 = copy.deepcopy((model, opt))
    assert [m.untyped_storage().nbytes() for m in opt2._half_masters] == [4] * 4

    def accumulate(model, opt):
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            model(torch.randn(4, 6, generator=gen).to(BF16)).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    accumulate(model2, opt2)
    accumulate(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(bits(model2, [opt2]), bits(model, [opt]), strict=True))


def test_two_optimizers_over_a_shared_layer_copied_together_share_one_master_again():
    torch.manual_seed(0)
    shared = torch.nn.Linear(6, 6).to(BF16)
    model = torch.nn.Sequential(shared, torch.nn.Linear(6, 3).to(BF16))
    first = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    second = MasterWeightOptimizer(torch.optim.SGD(shared.parameters(), lr=1e-2))
    train(model, [first, second], 2, seed=1)
    model2, first2, second2 = copy.deepcopy((model, first, second))
    assert first2.master_params()[:2] == second2.master_params()
    assert all(m.model_param() is p for m, p in zip(second2.master_params(), model2[0].parameters(), strict=True))
    train(model2, [first2, second2], 2, seed=2)
    train(model, [first, second], 2, seed=2)
    assert all(
        torch.equal(a, b) for a, b in zip(bits(model2, [first2, second2]), bits(model, [first, second]), strict=True)
    )


def test_a_shallow_copy_shares_the_original_masters():
    model, opt = model_and_optimizer(dict(master="fp32"), None, accumulate=False)
    twin = copy.copy(opt)
    assert twin.master_params() == opt.master_params()
    assert all(m._amp_owner() is opt for m in opt.master_params())
    train(model, [opt], 1, seed=1)
