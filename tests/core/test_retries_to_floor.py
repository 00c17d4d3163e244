"""Retries down to the floor: ``retries >= retries_to_floor`` loses no batch that fits at some scale.

Every retry costs one wasted pass, as every skipped batch costs ``torch.amp.GradScaler``'s rule per
halving. The oracle is GradScaler on the same overflow thresholds: where it skips k batches to
back off k times, retrying spends the same k passes on one batch and keeps it, and both end at the
same scale.
"""

from __future__ import annotations

import math

import pytest
import torch

from amp_plugin import DynamicLossScaler


def run_thresholds(scaler, thresholds):
    """One batch per entry; a pass overflows while the scale is above the entry.

    Returns the batches trained on (by index) and the scale after each batch.
    """
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    kept, scales = [], []
    for batch, threshold in enumerate(thresholds):
        for _ in scaler.attempts():
            scaler.scale(torch.ones(()))
            p.grad = torch.full((1,), math.inf if scaler.get_scale() > threshold else 1.0)
            scaler.step(opt)
            scaler.update()
        if not scaler.last_step_skipped:
            kept.append(batch)
        scales.append(scaler.get_scale())
    return kept, scales


def grad_scaler_run(init_scale, growth_interval, thresholds):
    """torch.amp.GradScaler on the same thresholds: its skipped batches and scale after each batch."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    skipped, scales = 0, []
    for threshold in thresholds:
        scaler.scale(torch.ones(()))
        p.grad = torch.full((1,), math.inf if scaler.get_scale() > threshold else 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        scales.append(scaler.get_scale())
    return skipped, scales


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({}, 24),  # 2**24 down to 1 by halves
        ({"backoff_factor": 0.25}, 12),
        ({"min_scale": 2.0**-4, "max_scale": 2.0**4}, 8),
        ({"backoff_factor": 0.3}, 14),  # ceil(24 * log(2) / log(1 / 0.3)) = ceil(13.8)
        ({"min_scale": 8.0, "max_scale": 8.0}, 0),
    ],
)
def test_retries_to_floor(settings, expected):
    assert DynamicLossScaler(init_scale=8.0, **settings).retries_to_floor == expected


def test_a_scale_far_too_high_costs_the_passes_grad_scaler_skips_and_no_batch():
    thresholds = [2.0**9] * 20  # every batch fits at 512 or below; the run starts at 2**16
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=1000, retries=24)
    kept, scales = run_thresholds(scaler, thresholds)
    skipped, grad_scaler_scales = grad_scaler_run(2.0**16, 1000, thresholds)
    assert (skipped, grad_scaler_scales[-1]) == (7, 2.0**9)
    assert kept == list(range(20)) and scaler.skipped_steps == 0
    assert scaler.retried_steps == skipped == scaler.wasted_passes  # the same wasted passes, no batch lost
    assert scales == [2.0**9] * 20 == grad_scaler_scales[skipped:] + [2.0**9] * skipped


def test_a_spike_is_kept_and_the_scale_stays_where_it_fitted():
    """GradScaler skips the spike and backs off once (2**17 -> 2**16); retrying keeps the batch
    and the scale stays where it fitted, growing back from there."""
    thresholds = [math.inf] * 3 + [2.0**4] + [math.inf] * 4  # batch 3 needs a 2**13 times lower scale
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=3, retries=24)
    kept, scales = run_thresholds(scaler, thresholds)
    assert kept == list(range(8)) and (scaler.retried_steps, scaler.skipped_steps) == (13, 0)
    # grown to 2**17 after three clean batches; 13 retries to 2**4; three clean batches from the retry on
    assert scales == [2.0**16, 2.0**16, 2.0**17, 2.0**4, 2.0**4, 2.0**5, 2.0**5, 2.0**5]
    skipped, grad_scaler_scales = grad_scaler_run(2.0**16, 3, thresholds)
    assert skipped == 1 and grad_scaler_scales[3] == 2.0**16


def test_one_retry_is_not_enough_for_a_spike_and_the_batch_is_lost():
    thresholds = [math.inf] * 3 + [2.0**4] + [math.inf] * 4
    scaler = DynamicLossScaler(init_scale=2.0**16, growth_interval=3, retries=1)
    kept, _ = run_thresholds(scaler, thresholds)
    assert 3 not in kept and (scaler.retried_steps, scaler.skipped_steps) == (1, 1)


def test_at_the_floor_an_overflow_is_still_skipped():
    scaler = DynamicLossScaler(init_scale=2.0**4, retries=24, on_min_scale="skip")
    kept, scales = run_thresholds(scaler, [0.5, math.inf])
    assert kept == [1] and (scaler.retried_steps, scaler.skipped_steps) == (4, 1) and scales == [1.0, 1.0]
