"""Optimizer wrappers share the wrapped optimizer's param groups and state (the objects themselves):
what an LR scheduler or a checkpoint writes through one is what the other reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_plugin import MasterWeightOptimizer
from amp_plugin.fsdp_moments import Bf16MomentsAdam


def wrappers():
    fp32 = nn.Linear(4, 3)
    half = nn.Linear(4, 3).to(torch.bfloat16)
    return [
        ("Bf16MomentsAdam", lambda: Bf16MomentsAdam(torch.optim.AdamW(fp32.parameters(), lr=1e-3))),
        ("MasterWeightOptimizer", lambda: MasterWeightOptimizer(torch.optim.AdamW(half.parameters(), lr=1e-3))),
    ]


@pytest.mark.parametrize("name,make", wrappers(), ids=[n for n, _ in wrappers()])
def test_a_wrapper_reads_and_writes_the_wrapped_optimizers_groups_and_state(name, make):
    wrapper = make()
    inner = wrapper.optimizer
    assert wrapper.param_groups is inner.param_groups and wrapper.state is inner.state
    scheduler = torch.optim.lr_scheduler.StepLR(wrapper, step_size=1, gamma=0.5)
    wrapper.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 5e-4  # the scheduler wrote the wrapped optimizer's group
    groups, state = [dict(g) for g in inner.param_groups], {"replaced": True}
    wrapper.param_groups = groups
    wrapper.state = state
    assert inner.param_groups is groups and inner.state is state
    assert repr(wrapper).startswith(f"{name}(AdamW (")
