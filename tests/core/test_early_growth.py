"""``DynamicLossScaler(early_growth_interval=N)``: grow before ``growth_interval`` from the gradients' amax.

The headroom of a step is ``log2(65504 / amax)``, the scaled gradients' amax in bits below
FP16's largest value. After N clean steps in a row each with room for one growth above the
margin, the scale grows ``floor((headroom - margin) / log2(growth_factor))`` times, the headroom
taken at the run's largest amax. The trajectories below are computed by hand from that rule;
with the option off (and wherever it does not fire) the oracle is ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer

INF = math.inf


def run_amax(scaler, amaxes, optimizer=None):
    """One step per entry, with every scaled gradient equal to the entry (inf: an overflow)."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = optimizer or torch.optim.SGD([p], lr=0.0)
    scales, reasons = [], []
    for amax in amaxes:
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([amax, -amax / 2, 0.0])
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        reasons.append(scaler.last_update.reason)
    return scales, reasons


def grad_scaler_scales(init_scale, growth_interval, amaxes):
    """torch.amp.GradScaler's scale after each step of the same pattern."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for amax in amaxes:
        scaler.scale(torch.ones(()))
        p.grad = torch.tensor([amax, -amax / 2, 0.0])
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


# The pattern of the trajectory tests; headroom log2(65504 / amax) in brackets.
PATTERN = [
    1024.0,  # 5.999 bits: room for one growth above the 4-bit margin; the run starts
    2.0,  # 14.999: the run goes on, its largest amax stays 1024
    512.0,  # the third step in a row: grow floor(5.999 - 4) = 1 time (at the run's largest amax)
    4096.0,  # 3.999 bits at 2048: no room above the margin, the run resets
    16.0,  # run 1
    INF,  # an overflow: back off, the run resets
    16.0,
    16.0,
    16.0,  # three in a row at 11.999 bits: floor(11.999 - 4) = 7 growths, 1024 -> 2**17
    1.0,
]


def test_the_scale_trajectory_for_an_amax_pattern():
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=100, early_growth_interval=3)
    scales, reasons = run_amax(scaler, PATTERN)
    assert scales == [1024.0, 1024.0, 2048.0, 2048.0, 2048.0, 1024.0, 1024.0, 1024.0, 2.0**17, 2.0**17]
    assert reasons == [None, None, "growth", None, None, "overflow", None, None, "growth", None]
    assert scaler.last_grad_amax == 1.0


def test_off_the_trajectory_is_grad_scalers():
    off = DynamicLossScaler(init_scale=1024.0, growth_interval=4)
    scales, _ = run_amax(off, PATTERN * 3)
    assert scales == grad_scaler_scales(1024.0, 4, PATTERN * 3)
    assert off.last_grad_amax is None  # nothing measured
    assert "_headroom_run" in off.state_dict() and off.state_dict()["_headroom_run"] == 0


def test_without_headroom_early_growth_never_fires_and_the_trajectory_is_grad_scalers():
    tight = [40000.0, 30000.0, INF, 20000.0, 3000.0, 2500.0, 2100.0, 2100.0, 2100.0, INF] * 3  # all < 5 bits
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3, early_growth_interval=1)
    scales, _ = run_amax(scaler, tight)
    assert scales == grad_scaler_scales(1024.0, 3, tight)


def test_an_early_growth_counts_as_a_growth():
    """Capped at max_scale, it still refills the hysteresis and restarts the growth interval."""
    scaler = DynamicLossScaler(
        init_scale=1024.0, max_scale=4096.0, growth_interval=5, hysteresis=2, early_growth_interval=2
    )
    scales, reasons = run_amax(scaler, [INF, 1.0, 1.0, INF, 60000.0, 60000.0, 60000.0, 60000.0, 60000.0])
    # The first overflow spends one of two hysteresis units; the early growth (11 growths by the
    # headroom, capped at 4096) refills them, so the next overflow is absorbed again; the five clean
    # steps the growth interval needs are counted from the early growth's reset, not before.
    assert reasons == ["hysteresis", None, "growth", "hysteresis", None, None, None, None, "growth"]
    assert scales == [1024.0, 1024.0, 4096.0, 4096.0, 4096.0, 4096.0, 4096.0, 4096.0, 4096.0]


def test_a_growth_factor_other_than_two_and_no_gradient_at_all():
    scaler = DynamicLossScaler(init_scale=8.0, growth_factor=4.0, growth_interval=100, early_growth_interval=1)
    # 8 bits of headroom at amax 255.875 (65504 / 256): floor((7.999... - 4) / 2) = 1 growth of 4
    assert run_amax(scaler, [256.0])[0] == [32.0]
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=100, early_growth_interval=1, early_growth_margin=2.5)
    assert run_amax(scaler, [0.0])[0] == [2.0**24]  # all-zero gradients: straight to max_scale


def test_a_manual_scale_and_a_retry_restart_the_run():
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=100, early_growth_interval=2)
    run_amax(scaler, [16.0])
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    scaler.step(torch.optim.SGD([p], lr=0.0))
    scaler.update(512.0)  # measured at 1024: the run starts again at 512
    assert run_amax(scaler, [16.0, 16.0])[0] == [512.0, 2.0**16]  # floor(11.999 - 4) = 7 growths
    retried = DynamicLossScaler(init_scale=1024.0, growth_interval=100, early_growth_interval=2, retries=1)
    run_amax(retried, [16.0])
    p.grad = torch.ones(1)
    for attempt in retried.attempts():
        p.grad = torch.full((1,), INF if attempt == 0 else 16.0)
        retried.step(torch.optim.SGD([p], lr=0.0))
        retried.update()
    assert (retried.retried_steps, retried.get_scale()) == (1, 512.0)
    # the retry reset the run the first batch began; the retried batch's clean attempt starts a new one
    assert run_amax(retried, [16.0])[0] == [2.0**16]


def test_a_saved_run_continues_exactly_and_grad_scaler_dicts_load():
    whole = DynamicLossScaler(init_scale=1024.0, growth_interval=100, early_growth_interval=3)
    expected, _ = run_amax(whole, PATTERN)
    first = DynamicLossScaler(init_scale=1024.0, growth_interval=100, early_growth_interval=3)
    head, _ = run_amax(first, PATTERN[:8])  # two steps into the last run
    state = first.state_dict()
    assert (state["_headroom_run"], state["_headroom_amax"]) == (2, 16.0)
    second = DynamicLossScaler()
    second.load_state_dict(state)
    assert second.early_growth_interval == 3 and head + run_amax(second, PATTERN[8:])[0] == expected
    fresh = DynamicLossScaler(early_growth_interval=3)
    fresh.load_state_dict(torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict())
    assert fresh.state_dict()["_headroom_run"] == 0 and fresh.early_growth_interval == 3
    assert first.restarted(state)["_headroom_run"] == 0


@pytest.mark.parametrize(
    "key, value, error, allowed",
    [
        ("early_growth_interval", -1, ValueError, "an integer >= 0"),
        ("early_growth_interval", 1.5, TypeError, "an integer"),
        ("early_growth_margin", 0.0, ValueError, "a finite number > 0"),
        ("early_growth_margin", math.inf, ValueError, "a finite number > 0"),
        ("early_growth_margin", "4", TypeError, "a finite number"),
    ],
)
def test_the_settings_are_checked(key, value, error, allowed):
    with pytest.raises(error, match=rf"^{key}={value!r} is not allowed: {key} must be {allowed}"):
        DynamicLossScaler(**{key: value})
    state = DynamicLossScaler().state_dict()
    with pytest.raises(ValueError, match=rf"^{key}="):
        DynamicLossScaler().load_state_dict({**state, key: value})


@pytest.mark.parametrize("value", [-1.0, math.nan, "x"])
def test_a_bad_saved_tracker_names_its_key(value):
    state = {**DynamicLossScaler().state_dict(), "_headroom_amax": value}
    with pytest.raises(ValueError, match="^_headroom_amax="):
        DynamicLossScaler().load_state_dict(state)


def test_one_host_read_per_step(monkeypatch):
    """The amax comes to the host with the found-inf flag, in one transfer."""
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=100, early_growth_interval=1)
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    p.grad = torch.tensor([16.0, 1.0, 0.0])
    scaler.scale(torch.ones(()))
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    scaler.step(opt)
    scaler.update()
    monkeypatch.undo()
    assert reads == ["tolist"] and scaler.get_scale() == 2.0**17


@pytest.mark.parametrize("fused, accumulate", [(None, False), (False, False), ("torch", False), (None, True)], ids=str)
def test_a_master_weight_optimizer_measures_its_model_gradients(fused, accumulate):
    """The amax of the half model gradients (or of their FP32 sum when accumulated), still scaled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    model[0].half(), model[2].half()
    opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=0.0), fused=fused, accumulate_fp32=accumulate)
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=100, early_growth_interval=1)
    x = torch.randn(5, 4)
    params = list(model.parameters())
    sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    for _ in range(2 if accumulate else 1):
        loss = scaler.scale(model(x.half()).float().square().mean())
        for total, grad in zip(sums, torch.autograd.grad(loss, params, retain_graph=True)):
            total += grad.float()
        loss.backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_grad_amax == max(float(t.abs().max()) for t in sums) > 0


def _ranks_worker(rank, init_file, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=100, early_growth_interval=1)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.full((1,), 16.0 if rank == 0 else 256.0)  # rank 1 has the larger gradient
    scaler.step(torch.optim.SGD([p], lr=0.0))
    scaler.update()
    torch.save((scaler.last_grad_amax, scaler.get_scale()), f"{out}{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_sees_the_largest_amax():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        mp.spawn(_ranks_worker, args=(os.path.join(tmp, "init"), out), nprocs=2)
        results = [torch.load(f"{out}{r}.pt") for r in (0, 1)]
    # headroom at 256: 7.999 bits, floor(7.999 - 4) = 3 growths on both ranks
    assert results == [(256.0, 8192.0), (256.0, 8192.0)]
