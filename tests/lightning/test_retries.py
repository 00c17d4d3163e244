"""``DynamicLossScaler(retries=N)``: an overflowing batch runs again at a lower scale.

The oracle for a retry is a run that never needed one: a run that retries its first batch once
(2**16 -> 2**15) must equal, bit for bit on the CPU, a run that started at 2**15: weights, LR
schedule, ``global_step``, the data order and the random streams.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from _models import as_lightning, quiet_trainer

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, StaticLossScaler
from amp_plugin.lightning import MixedPrecisionPlugin


def overflow_above(model: torch.nn.Module, threshold: float | None, scale: float) -> None:
    """An overflow that a lower scale avoids: an inf gradient when ``scale > threshold``."""
    if threshold is not None and scale > threshold:
        next(model.parameters()).grad.view(-1)[0] = math.inf


# ---------------------------------------------------------------- the rule
def run_pattern(scaler, thresholds):
    """One batch per entry; the step overflows while the scale is above the entry."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.0)
    attempts = []
    for threshold in thresholds:
        for attempt in scaler.attempts():
            scaler.scale(torch.ones(()))
            p.grad = torch.full((2,), math.inf if scaler.get_scale() > threshold else 1.0)
            scaler.step(opt)
            scaler.update()
            attempts.append(attempt)
    return attempts


def test_an_overflow_backs_off_and_the_same_batch_runs_again():
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100, retries=2)
    # batch 0 fits at 32 (one retry); batch 1 would need 8 (two retries are not enough: skipped)
    assert run_pattern(scaler, [32.0, 4.0, math.inf]) == [0, 1, 0, 1, 2, 0]
    assert (scaler.retried_steps, scaler.skipped_steps, scaler.update_count) == (3, 1, 3)
    assert scaler.get_scale() == 4.0  # 64 -> 32 (retry); 32 -> 16, 8 (retries), 8 -> 4 (skip)
    assert (scaler.passes, scaler.wasted_passes, scaler.wasted_fraction) == (6, 4, 4 / 6)
    assert [(u.old_scale, u.new_scale, u.reason) for u in scaler.iteration_updates] == [(4.0, 4.0, None)]


def test_iteration_updates_list_the_retries_then_the_skip():
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100, retries=2)
    run_pattern(scaler, [4.0])
    assert [(u.iteration, u.old_scale, u.new_scale, u.reason) for u in scaler.iteration_updates] == [
        (0, 64.0, 32.0, "retry"),
        (0, 32.0, 16.0, "retry"),
        (0, 16.0, 8.0, "overflow"),
    ]
    assert scaler.last_step_skipped and scaler.consecutive_skips == 1


def test_a_retry_ignores_the_hysteresis_and_the_final_skip_uses_it():
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100, hysteresis=2, retries=1)
    run_pattern(scaler, [1.0])
    assert [u.reason for u in scaler.iteration_updates] == ["retry", "hysteresis"]
    assert scaler.get_scale() == 32.0


def test_no_retry_at_min_scale_and_none_outside_attempts():
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=2.0, on_min_scale="skip", retries=3)
    assert run_pattern(scaler, [1.0]) == [0]
    assert (scaler.retried_steps, scaler.skipped_steps) == (0, 1)
    plain = DynamicLossScaler(init_scale=64.0, retries=3)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.full((1,), math.inf)
    plain.step(torch.optim.SGD([p], lr=0.0))
    plain.update()  # no attempts() loop: nobody would run the batch again
    assert (plain.retried_steps, plain.skipped_steps, plain.get_scale(), plain.retrying) == (0, 1, 32.0, False)


def test_retries_zero_and_a_static_scaler_run_the_body_once():
    for scaler in (DynamicLossScaler(init_scale=64.0), StaticLossScaler(64.0), DynamicLossScaler(enabled=False)):
        assert run_pattern(scaler, [1.0, 1.0]) == [0, 0]
        assert scaler.retried_steps == 0


def test_no_retry_when_another_optimizer_of_the_iteration_stepped():
    """Running the batch again would step that optimizer twice: the overflow is a skip."""
    scaler = DynamicLossScaler(init_scale=64.0, retries=2)
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    runs = 0
    for _ in scaler.attempts():
        runs += 1
        a.grad, b.grad = torch.ones(1), torch.full((1,), math.inf)
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
    assert runs == 1 and a.item() == -1 / 64 and scaler.skipped_steps == 1 and scaler.retried_steps == 0


def test_the_retry_counter_is_saved_and_loaded():
    scaler = DynamicLossScaler(init_scale=64.0, retries=1)
    run_pattern(scaler, [32.0])
    again = DynamicLossScaler()
    again.load_state_dict(scaler.state_dict())
    assert (again.retried_steps, again.retries, again.get_scale()) == (1, 1, 32.0)


# ---------------------------------------------------------------- a plain loop
def plain_run(init_scale, retries, steps=6):
    """An FP16 model with FP32 masters, dropout and an LR schedule; batch 0 overflows above 2**15."""
    torch.manual_seed(0)
    random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2)).half()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=1000, retries=retries)
    data = torch.randn(steps * 4, 8).half()
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    for step, x in enumerate(loader):
        for _ in scaler.attempts(model):
            opt.zero_grad()
            noise = random.random()  # Python's stream, put back with torch's
            loss = (model(x).float() ** 2).mean() * (1 + noise)
            scaler.scale(loss).backward()
            overflow_above(model, 2.0**15 if step == 0 else None, scaler.get_scale())
            scaler.step(opt)
            scaler.update()
        if not scaler.last_step_skipped:
            sched.step()
    return model, opt, sched, scaler, (torch.get_rng_state(), random.getstate())


def test_a_plain_loop_with_a_retry_equals_a_run_started_at_the_lower_scale():
    retried = plain_run(2.0**16, retries=1)
    lower = plain_run(2.0**15, retries=0)
    (m1, o1, s1, sc1, rng1), (m2, o2, s2, sc2, rng2) = retried, lower
    assert (sc1.retried_steps, sc1.skipped_steps, sc2.retried_steps, sc2.skipped_steps) == (1, 0, 0, 0)
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(o1.master_params(), o2.master_params()))
    assert s1.state_dict() == s2.state_dict() and sc1.get_scale() == sc2.get_scale()
    assert torch.equal(rng1[0], rng2[0]) and rng1[1] == rng2[1]


def test_without_retries_the_overflowing_batch_is_lost():
    model, _, sched, scaler, _ = plain_run(2.0**16, retries=0)
    lower = plain_run(2.0**15, retries=0)[0]
    assert scaler.skipped_steps == 1 and sched.last_epoch == 5
    assert not all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), lower.state_dict().values()))


# ---------------------------------------------------------------- Lightning
class RetryClassifier:
    """Linear -> Dropout -> Linear on shuffled data with a step LR schedule; the gradient
    overflows at the global steps of ``overflow`` while the scale is above the value there."""

    def __init__(self, overflow: dict[int, float] | None = None, manual: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 2))
        self.overflow = overflow or {}
        self.automatic_optimization = not manual
        self.batches: dict[int, float] = {}  # global step -> the batch it trained on (a checksum)
        self.calls = 0

    def forward(self, x):
        return self.net(x)

    def loss(self, batch):
        x, y = batch
        self.batches[self.global_step] = float(x.float().sum())
        self.calls += 1
        return F.cross_entropy(self(x).float(), y)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self.loss(batch)
        opt, sched = self.optimizers(), self.lr_schedulers()
        for _ in self.trainer.precision_plugin.attempts():
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            opt.step()
        if not self.trainer.precision_plugin.scaler.last_step_skipped:
            sched.step()
        return None

    def on_after_backward(self):
        scaler = self.trainer.precision_plugin.scaler
        overflow_above(self, self.overflow.get(self.global_step), scaler.get_scale())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)


def lightning_run(pl, init_scale, retries, overflow, manual=False, **trainer_kwargs):
    torch.manual_seed(0)
    model = as_lightning(pl, RetryClassifier)(overflow, manual=manual)
    scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=1000, retries=retries)
    trainer = quiet_trainer(pl, max_epochs=2, plugins=[MixedPrecisionPlugin("fp16", scaler=scaler)], **trainer_kwargs)
    trainer.fit(model)
    return model, trainer, scaler


def assert_same_run(first, second):
    (m1, t1, s1), (m2, t2, s2) = first, second
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    assert t1.global_step == t2.global_step == 8
    assert t1.lr_scheduler_configs[0].scheduler.state_dict() == t2.lr_scheduler_configs[0].scheduler.state_dict()
    assert m1.batches == m2.batches  # the same data in the same order
    assert s1.get_scale() == s2.get_scale()


@pytest.mark.slow
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_lightning_run_with_a_retry_equals_a_run_started_at_the_lower_scale(pl, manual):
    retried = lightning_run(pl, 2.0**16, 1, {0: 2.0**15}, manual=manual)
    rng_after_retried = torch.get_rng_state()
    lower = lightning_run(pl, 2.0**15, 0, {0: 2.0**15}, manual=manual)
    assert torch.equal(rng_after_retried, torch.get_rng_state())
    assert_same_run(retried, lower)
    (m1, _, s1), (m2, _, s2) = retried, lower
    assert (s1.retried_steps, s1.skipped_steps, m1.calls) == (1, 0, 9)
    assert (s2.retried_steps, s2.skipped_steps, m2.calls) == (0, 0, 8)


def test_without_retries_lightning_loses_the_batch(pl):
    _, trainer, scaler = lightning_run(pl, 2.0**16, 0, {0: 2.0**15})
    assert scaler.skipped_steps == 1 and trainer.lr_scheduler_configs[0].scheduler.last_epoch == 7


def test_retries_with_gradient_accumulation_are_refused(pl):
    with pytest.raises(ValueError, match=r"retries=1\) cannot retry with accumulate_grad_batches=2"):
        lightning_run(pl, 2.0**16, 1, {}, accumulate_grad_batches=2)
