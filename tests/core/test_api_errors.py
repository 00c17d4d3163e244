"""Bad input to the public constructors: a ValueError/TypeError that names the argument,
repeats the value and says what is allowed. Never an assert, never a silent fallback."""

from __future__ import annotations

import math

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer, MixedPrecisionPlugin, StaticLossScaler
from amp_plugin.callbacks import FaultInjector, GradientHealthMonitor

CASES = [
    # (constructor, kwargs, exception, text that must appear)
    (
        DynamicLossScaler,
        dict(growth_factor=0.5),
        ValueError,
        "growth_factor=0.5 is not allowed: growth_factor must be a finite number > 1",
    ),
    (
        DynamicLossScaler,
        dict(backoff_factor=1.5),
        ValueError,
        "backoff_factor=1.5 is not allowed: backoff_factor must be a finite number > 0 and < 1",
    ),
    (
        DynamicLossScaler,
        dict(growth_interval=0),
        ValueError,
        "growth_interval=0 is not allowed: growth_interval must be an integer >= 1",
    ),
    (DynamicLossScaler, dict(growth_interval=1.5), TypeError, "growth_interval=1.5"),
    (DynamicLossScaler, dict(hysteresis=0), ValueError, "hysteresis=0 is not allowed"),
    (
        DynamicLossScaler,
        dict(hysteresis_reset="never"),
        ValueError,
        "hysteresis_reset='never' is not allowed: hysteresis_reset must be one of 'growth', 'finite'",
    ),
    (DynamicLossScaler, dict(on_min_scale="stop"), ValueError, "on_min_scale must be one of 'raise', 'skip'"),
    (DynamicLossScaler, dict(init_scale=math.nan), ValueError, "init_scale=nan"),
    (DynamicLossScaler, dict(init_scale="abc"), TypeError, "init_scale='abc'"),
    (DynamicLossScaler, dict(init_scale=2.0**30), ValueError, "init_scale must lie in [min_scale, max_scale]"),
    (DynamicLossScaler, dict(min_scale=-1.0), ValueError, "min_scale=-1.0"),
    (DynamicLossScaler, dict(max_scale=math.inf), ValueError, "max_scale=inf"),
    (
        DynamicLossScaler,
        dict(min_scale=8.0, max_scale=4.0, init_scale=4.0),
        ValueError,
        "min_scale must be <= max_scale",
    ),
    (StaticLossScaler, dict(scale=0), ValueError, "scale=0.0 is not allowed: scale must be a finite number > 0"),
    (StaticLossScaler, dict(scale=None), TypeError, "scale=None"),
    (
        MixedPrecisionPlugin,
        dict(precision="fp17"),
        ValueError,
        "precision='fp17' is not allowed: precision must be one of 'fp32', 'fp16', 'bf16', 'fp16_autocast'",
    ),
    (MixedPrecisionPlugin, dict(precision="16-mixed"), ValueError, "precision='16-mixed'"),
    (MixedPrecisionPlugin, dict(emulate=True), ValueError, "emulate must be one of 'auto', 'on', 'off'"),
    (MixedPrecisionPlugin, dict(master_weights=True, autocast=True), ValueError, "cannot be combined"),
    (
        MixedPrecisionPlugin,
        dict(autocast="yes"),
        TypeError,
        "autocast='yes' is not allowed: autocast must be True, False or None",
    ),
    (MixedPrecisionPlugin, dict(precision="fp32", scaler=DynamicLossScaler()), ValueError, "nothing to scale"),
    (
        MixedPrecisionPlugin,
        dict(scaler=torch.amp.GradScaler("cpu")),
        TypeError,
        "scaler must be 'auto', None (no loss scaling), an amp_plugin LossScaler",
    ),
    (MixedPrecisionPlugin, dict(skip_lr_on_overflow=None), TypeError, "skip_lr_on_overflow=None"),
    (FaultInjector, dict(inject_inf_at=[-2]), ValueError, "inject_inf_at=[-2] is not allowed"),
    (GradientHealthMonitor, dict(every_n_steps=0), ValueError, "every_n_steps"),
]


@pytest.mark.parametrize(
    "factory, kwargs, error, text", CASES, ids=[f"{f.__name__}-{next(iter(k))}" for f, k, _, _ in CASES]
)
def test_bad_constructor_input(factory, kwargs, error, text):
    with pytest.raises(error) as info:
        factory(**kwargs)
    assert text in str(info.value)


def test_master_weight_optimizer_input():
    with pytest.raises(TypeError, match="MasterWeightOptimizer wraps a torch.optim.Optimizer"):
        MasterWeightOptimizer(torch.nn.Linear(2, 2))
    model = torch.nn.Linear(2, 2).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    state = opt.state_dict()
    state["master_params"] = state["master_params"][:1]
    with pytest.raises(ValueError, match="master_params has 1 tensors but this optimizer has 2"):
        opt.load_state_dict(state)


def test_scaler_misuse_is_a_clear_runtime_error():
    scaler = DynamicLossScaler()
    with pytest.raises(RuntimeError, match="No inf checks were recorded"):
        scaler.update()
    with pytest.raises(RuntimeError, match="empty"):
        scaler.load_state_dict({})
    with pytest.raises(TypeError, match="scale\\(\\) takes a tensor"):
        scaler.scale("loss")
