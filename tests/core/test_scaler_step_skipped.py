"""``scaler.step_skipped(optimizer)``: which optimizer skipped, so a plain loop holds only its schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, StaticLossScaler


def two_optimizer_loop(hold_when, iterations=4, overflow_a_at=1):
    """Two half-precision models, each with its own optimizer and StepLR; A overflows once."""
    torch.manual_seed(0)
    nets = [nn.Linear(4, 2).half(), nn.Linear(4, 2).half()]
    opts = [MasterWeightOptimizer(torch.optim.SGD(net.parameters(), lr=0.1)) for net in nets]
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]
    scaler = DynamicLossScaler(init_scale=2.0**8)
    x, y = torch.randn(8, 4).half(), torch.randint(0, 2, (8,))
    for it in range(iterations):
        for i, (net, opt) in enumerate(zip(nets, opts)):
            scaler.scale(nn.functional.cross_entropy(net(x).float(), y)).backward()
            if i == 0 and it == overflow_a_at:
                net.weight.grad[0, 0] = math.inf
            scaler.step(opt)
        scaler.update()
        for opt, sched in zip(opts, scheds):
            if not hold_when(scaler, opt):
                sched.step()
            opt.zero_grad(set_to_none=True)
    return scaler, scheds


def test_each_optimizer_holds_only_its_own_schedule():
    scaler, (sched_a, sched_b) = two_optimizer_loop(lambda scaler, opt: scaler.step_skipped(opt))
    assert scaler.skipped_steps == 1
    assert (sched_a.last_epoch, sched_b.last_epoch) == (3, 4)
    assert sched_b.get_last_lr() == [0.1 * 0.5**4]


def test_last_step_skipped_covers_the_whole_iteration():
    """Why a per-optimizer answer is needed: the iteration-wide flag also holds B's schedule."""
    _, (sched_a, sched_b) = two_optimizer_loop(lambda scaler, opt: scaler.last_step_skipped)
    assert (sched_a.last_epoch, sched_b.last_epoch) == (3, 3)


def test_the_answer_lasts_until_the_next_iteration_starts():
    param = nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([param], lr=0.1), torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    scaler = StaticLossScaler(4.0)
    param.grad = torch.tensor([math.inf, 1.0])
    scaler.step(opt_a)
    assert scaler.step_skipped(opt_a) and not scaler.step_skipped(opt_b)  # B has not stepped in this iteration
    scaler.update()
    assert scaler.step_skipped(opt_a)  # still readable after update()
    param.grad = torch.ones(2)
    scaler.step(opt_a)  # the next iteration
    assert not scaler.step_skipped(opt_a)
    assert not DynamicLossScaler(enabled=False).step_skipped(opt_a)
