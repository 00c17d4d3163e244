"""A retried batch puts the module's buffers back: BatchNorm's running statistics and counter,
and whatever a forward updates (in place or by replacing the tensor).

The oracle is the run that never needed the retry: a plain loop that retries its first batch
from 2**16 (or 2**17, twice) must end bit for bit equal to one started at 2**15: weights, every
buffer, the FP32 masters, the optimizer's state, the LR schedule, the scale and the random streams.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from _ddp_launch import assert_bitwise_equal
from torch import nn

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, StaticLossScaler
from amp_plugin.half_module import cast_module
from amp_plugin.scaling import retries as retries_module
from amp_plugin.scaling.buffer_state import BufferState


class ForwardCounter(nn.Module):
    """Buffers a training forward updates: an int64 counter in place, a float count by replacing
    the tensor, and a running mean of its input (in place, FP16 once the model is cast)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("input_mean", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(1)
            self.count = self.count + 1
            self.input_mean.mul_(0.5).add_(x.detach().float().mean(0).to(self.input_mean.dtype), alpha=0.5)
        return x


def make_model() -> nn.Module:
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), ForwardCounter(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2)
    )
    return cast_module(model, torch.float16)  # BatchNorm stays FP32, the rest FP16


def plain_run(init_scale: float, retries: int, pass_model: bool = True, steps: int = 5):
    """Batch 0 overflows while the scale is above 2**15."""
    torch.manual_seed(0)
    random.seed(0)
    model = make_model()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=1000, retries=retries)
    data = torch.randn(steps * 4, 8).half()
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    for step, x in enumerate(loader):
        for _ in scaler.attempts(model) if pass_model else scaler.attempts():
            opt.zero_grad()
            loss = (model(x).float() ** 2).mean() * (1 + random.random())
            scaler.scale(loss).backward()
            if step == 0 and scaler.get_scale() > 2.0**15:
                model[0].weight.grad.view(-1)[0] = math.inf
            scaler.step(opt)
            scaler.update()
        if not scaler.last_step_skipped:
            sched.step()
    return model, opt, sched, scaler, (torch.get_rng_state(), random.getstate())


@pytest.mark.parametrize(("init_scale", "retries"), [(2.0**16, 1), (2.0**17, 2)], ids=["one_retry", "two_retries"])
def test_a_retried_batch_leaves_the_buffers_as_a_run_started_at_the_lower_scale(init_scale, retries):
    m1, o1, s1, sc1, rng1 = plain_run(init_scale, retries)
    m2, o2, s2, sc2, rng2 = plain_run(2.0**15, 0)
    assert (sc1.retried_steps, sc1.skipped_steps, sc2.retried_steps, sc2.skipped_steps) == (retries, 0, 0, 0)
    assert int(m1[1].num_batches_tracked) == int(m1[2].seen) == float(m1[2].count) == 5
    assert_bitwise_equal(m1.state_dict(), m2.state_dict(), "model")
    assert_bitwise_equal(list(o1.master_params()), list(o2.master_params()), "masters")
    assert_bitwise_equal(o1.state_dict(), o2.state_dict(), "optimizer")
    assert s1.state_dict() == s2.state_dict() and sc1.get_scale() == sc2.get_scale()
    assert torch.equal(rng1[0], rng2[0]) and rng1[1] == rng2[1]


def test_the_buffers_of_modules_not_passed_keep_the_failed_attempt():
    """What ``attempts(model)`` is for: without the model only the random streams go back."""
    model = plain_run(2.0**16, 1, pass_model=False)[0]
    assert int(model[1].num_batches_tracked) == int(model[2].seen) == 6  # 5 batches, one of them twice


def test_nothing_is_saved_when_no_retry_can_happen(monkeypatch):
    snapshots = []

    class Counted(BufferState):
        __slots__ = ()

        def __init__(self, modules):
            snapshots.append(tuple(modules))
            super().__init__(modules)

    monkeypatch.setattr(retries_module, "BufferState", Counted)
    model = nn.BatchNorm1d(4)
    for scaler in (DynamicLossScaler(), DynamicLossScaler(retries=2, enabled=False), StaticLossScaler(64.0)):
        for _ in scaler.attempts(model):
            pass
    assert snapshots == []
    scaler = DynamicLossScaler(retries=1)
    for _ in scaler.attempts():  # no module: nothing to save
        pass
    for _ in range(2):
        for _ in scaler.attempts(model):
            pass
    assert snapshots == [(model,), (model,)]  # one per iteration, with the module passed


def test_attempts_refuses_what_is_not_a_module():
    scaler = DynamicLossScaler(retries=1)
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"argument 0 is list \(pass several modules as separate arguments\)"):
        scaler.attempts([model])  # refused at the call, before the loop starts
    with pytest.raises(TypeError, match=r"attempts\(\) takes the modules .* argument 1 is generator"):
        scaler.attempts(model, model.parameters())


def test_a_snapshot_puts_back_changed_replaced_and_shared_buffers():
    shared = torch.arange(3.0)
    a, b = nn.Module(), nn.Module()
    a.register_buffer("x", shared)
    b.register_buffer("x", shared)  # one tensor in two modules: saved once
    a.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    a.register_buffer("flag", torch.tensor([True, False]))
    a.register_buffer("table", torch.arange(6.0).view(2, 3).t())  # 2-d, not contiguous
    a.register_buffer("empty", None)
    assert BufferState([a, b, a]).nbytes == 3 * 4 + 8 + 2 + 6 * 4
    a.register_buffer("sparse", torch.eye(3).to_sparse())
    state = BufferState([a, b])
    original_steps = a.steps
    with torch.no_grad():
        shared.mul_(10)
        a.steps = a.steps + 5  # a new tensor in the slot
        a.flag.logical_not_()
        a.table.add_(1)
        a.sparse.mul_(2)
    a.empty = torch.ones(1)
    b.register_buffer("late", torch.ones(1))  # registered after the snapshot: left as it is
    state.restore()
    assert torch.equal(a.x, torch.arange(3.0)) and a.x is b.x is shared
    assert a.steps is original_steps and int(a.steps) == 0
    assert a.flag.tolist() == [True, False] and torch.equal(a.table, torch.arange(6.0).view(2, 3).t())
    assert torch.equal(a.sparse.to_dense(), torch.eye(3))
    assert a.empty is None and torch.equal(b.late, torch.ones(1))
