"""Scaler settings without a class: ``scaler={"hysteresis": 2}`` (a YAML ``scaler: {hysteresis: 2}``) is
merged into the preset's own scaler, so one trainer config serves every preset; settings for a preset that
runs no scaler are an error unless they name the scaler's type."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from amp_plugin import DynamicLossScaler, MixedPrecisionPlugin, StaticLossScaler
from amp_plugin.settings import PRESETS, PrecisionSettings

FP16 = sorted(name for name, preset in PRESETS.items() if preset.precision == "fp16")
UNSCALED = sorted(name for name, preset in PRESETS.items() if preset.precision != "fp16")
HALF_UNSCALED = [name for name in UNSCALED if PRESETS[name].precision != "fp32"]
PROJECT_CONFIGS = Path(__file__).resolve().parents[1] / "hydra_project" / "configs"


@pytest.mark.parametrize("preset", FP16)
def test_settings_are_merged_into_the_fp16_presets_dynamic_scaler(preset):
    scaler = MixedPrecisionPlugin(preset, scaler={"hysteresis": 2, "init_scale": 1024}).scaler
    assert type(scaler) is DynamicLossScaler
    assert scaler.settings() == DynamicLossScaler(hysteresis=2, init_scale=1024).settings()


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_no_settings_is_the_presets_own_scaler(preset):
    scaler = MixedPrecisionPlugin(preset, scaler={}).scaler
    auto = MixedPrecisionPlugin(preset).scaler
    assert type(scaler) is type(auto) and scaler.is_enabled() == auto.is_enabled()
    assert scaler.is_enabled() == (preset in FP16)


@pytest.mark.parametrize("preset", UNSCALED)
def test_settings_for_a_preset_without_a_scaler_are_an_error(preset):
    with pytest.raises(ValueError, match=rf"precision='{preset}': that preset runs no loss scaler.*hysteresis"):
        MixedPrecisionPlugin(preset, scaler={"hysteresis": 2})


@pytest.mark.parametrize("preset", HALF_UNSCALED)
def test_a_named_type_adds_a_scaler_to_a_bf16_preset(preset):
    dynamic = MixedPrecisionPlugin(preset, scaler={"type": "dynamic", "hysteresis": 2}).scaler
    assert type(dynamic) is DynamicLossScaler and dynamic.hysteresis == 2
    static = MixedPrecisionPlugin(preset, scaler={"type": "static", "scale": 8.0}).scaler
    assert type(static) is StaticLossScaler and static.get_scale() == 8.0


def test_fp32_refuses_a_named_scaler_too():
    with pytest.raises(ValueError, match="precision='fp32': FP32 gradients do not underflow"):
        PrecisionSettings.build("fp32", scaler={"type": "dynamic"})
    assert not PrecisionSettings.build("fp32", scaler={"type": "none"}).scaler.is_enabled()


@pytest.mark.parametrize(
    "settings, text",
    [
        (
            {"scale": 8.0},
            r"scaler.scale=8.0 is not allowed: it is not a setting of a dynamic scaler "
            r"\(DynamicLossScaler\); its settings are init_scale, growth_factor",
        ),
        ({"type": "static", "hysteresis": 2}, "scaler.hysteresis=2 is not allowed: it is not a setting of a static"),
        ({"type": "none", "scale": 8.0}, "scaler.scale=8.0 is not allowed: .*type 'none' takes none"),
        ({"type": "adaptive"}, "scaler.type='adaptive' is not allowed: .*'dynamic', 'static', 'none'"),
        ({"growth_factor": 0.5}, "growth_factor=0.5 is not allowed: growth_factor must be a finite number > 1"),
    ],
)
def test_bad_settings_name_the_key_and_what_is_allowed(settings, text):
    with pytest.raises(ValueError, match=text):
        MixedPrecisionPlugin("fp16", scaler=settings)


def test_settings_from_an_omegaconf_node_work_like_a_dict():
    node = OmegaConf.create({"hysteresis": 2, "hysteresis_reset": "finite"})
    scaler = PrecisionSettings.build("fp16", scaler=node).scaler
    assert scaler.settings() == DynamicLossScaler(hysteresis=2, hysteresis_reset="finite").settings()


def project_plugin(*overrides: str) -> MixedPrecisionPlugin:
    """The plugin of the lightning-hydra-template-style project's trainer config (the README's)."""
    with initialize_config_dir(config_dir=str(PROJECT_CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=["paths.output_dir=/nonexistent", *overrides])
    return hydra.utils.instantiate(cfg.trainer.plugins[0])


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_one_project_trainer_config_serves_every_preset(preset):
    scaler = project_plugin(f"trainer.plugins.0.precision={preset}").scaler
    assert scaler.is_enabled() == (preset in FP16)  # bf16* and fp32 do not quietly scale the loss
    if preset in FP16:
        tuned = project_plugin(f"trainer.plugins.0.precision={preset}", "+trainer.plugins.0.scaler.hysteresis=2")
        assert tuned.scaler.hysteresis == 2
    else:
        with pytest.raises(Exception, match="that preset runs no loss scaler"):  # Hydra wraps the ValueError
            project_plugin(f"trainer.plugins.0.precision={preset}", "+trainer.plugins.0.scaler.hysteresis=2")
