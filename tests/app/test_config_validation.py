"""The Hydra configs: every option composes, defaults follow the rules, bad input fails cleanly.

Composition and building run in-process (fast). A table of bad command lines also goes
through the real CLI (``python train.py ...`` in a subprocess): non-zero exit, one short
message naming the key and what is allowed, no traceback, and no run directory that looks
like a success. The messages of range and choice errors come from the constructors; the app
puts the config key in front.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _cli_batch import clean_env, run_batch
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from amp_plugin import DynamicLossScaler, StaticLossScaler
from amp_plugin.app.build import build, prepare
from amp_plugin.app.validation import ConfigError, validate
from amp_plugin.settings import PRESETS

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
RECIPES = sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml"))
EXTENDS = {"bert_grad_drop": "bert"}  # recipe configs that are another recipe's module in other settings
# The documented rule: the FP16 presets scale the loss dynamically, the others do not.
DEFAULT_SCALER = {name: "dynamic" if preset.precision == "fp16" else "none" for name, preset in PRESETS.items()}


def test_config_groups_match_the_design():
    groups = {p.name: sorted(q.stem for q in p.glob("*.yaml")) for p in CONFIG_DIR.iterdir() if p.is_dir()}
    assert groups["precision"] == sorted(PRESETS)
    assert groups["scaler"] == ["dynamic", "none", "static"]
    assert {"digits", "char_gpt", "underflow_demo", "stagnation_demo"} <= set(groups["recipe"])
    assert {"csv", "tensorboard"} <= set(groups["logger"])
    assert {"default", "diagnostics", "none"} <= set(groups["callbacks"])
    assert "default" in groups["trainer"]


def test_default_config_is_fp16_dynamic_digits(compose_config):
    cfg = compose_config()
    settings = prepare(cfg)
    assert (settings.preset, settings.precision, settings.master_weights, settings.scaling) == (
        "fp16",
        "fp16",
        True,
        "dynamic",
    )
    assert cfg.recipe._target_ == "amp_plugin.recipes.DigitsRecipe"
    assert cfg.logger._target_.endswith("CSVLogger")
    assert cfg.seed == 0 and cfg.ckpt_path is None


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["precision=bf16", "scaler=static"], "static"),
        (["scaler=static", "precision=bf16"], "static"),  # order on the command line does not matter
        (["precision=bf16_pure", "scaler=dynamic"], "dynamic"),
        (["precision=fp16", "scaler=none"], "none"),
    ],
)
def test_explicit_scaler_on_the_command_line_wins(overrides, expected, compose_config):
    assert prepare(compose_config(*overrides)).scaling == expected


@pytest.mark.parametrize(
    "overrides, preset",
    [
        (["precision=fp16", "precision.master_weights=false"], "fp16_pure"),
        (["precision=fp16", "precision.autocast=true"], "fp16_autocast"),
        (["precision=bf16", "precision.autocast=true"], "bf16_autocast"),
        (["precision=fp32", "precision.master_weights=true"], "fp32"),  # nothing to keep in FP32: ignored
        (["precision=fp16_pure", "precision.master_weights=false"], "fp16_pure"),  # agrees with the preset
    ],
)
def test_precision_keys_follow_the_library_rules(overrides, preset, compose_config):
    """``precision.master_weights``/``autocast`` mean what they mean in ``MixedPrecisionPlugin``."""
    assert prepare(compose_config(*overrides)).preset == preset


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_and_recipe_instantiates(preset, recipe, compose_config):
    from amp_plugin.lightning.plugin import MixedPrecisionPlugin

    cfg = compose_config(f"precision={preset}", f"recipe={recipe}")
    run = build(cfg)
    plugin = run.plugin
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.settings.preset == preset
    if DEFAULT_SCALER[preset] == "dynamic":
        assert type(plugin.scaler) is DynamicLossScaler
    else:
        assert not plugin.scaler.is_enabled()
    assert type(run.module) is get_class(cfg.recipe._target_)
    assert type(run.module).__module__ == f"amp_plugin.recipes.{EXTENDS.get(recipe, recipe)}"
    assert [type(c).__name__ for c in run.callbacks] == [
        "LossScaleMonitor",
        "ModelCheckpoint",
        "RecoveryCheckpoint",
        "PreflightChecks",
        *(["FP8Monitor"] if preset == "fp8" else []),  # added to the defaults with fp8
    ]
    assert run.trainer.precision_plugin is plugin


def test_scaler_settings_reach_the_scaler(compose_config):
    settings = prepare(
        compose_config(
            "scaler.init_scale=1024",
            "scaler.growth_interval=7",
            "scaler.hysteresis=2",
            "scaler.on_min_scale=skip",
            "scaler.hysteresis_reset=finite",
        )
    )
    scaler = settings.scaler
    assert isinstance(scaler, DynamicLossScaler)
    assert (scaler.get_scale(), scaler.growth_interval, scaler.hysteresis) == (1024, 7, 2)
    assert (scaler.on_min_scale, scaler.hysteresis_reset) == ("skip", "finite")
    assert type(scaler.on_min_scale) is str  # the config's Enum choices reach the scaler as plain strings
    static = prepare(compose_config("precision=bf16", "scaler=static", "scaler.scale=128")).scaler
    assert isinstance(static, StaticLossScaler) and static.get_scale() == 128


@pytest.mark.parametrize(
    "group, option",
    [
        ("logger", "tensorboard"),
        ("logger", "csv"),
        ("callbacks", "diagnostics"),
        ("callbacks", "none"),
        ("callbacks", "default"),
        ("trainer", "default"),
        ("trainer", "ddp"),
        ("strategy", "auto"),
        ("strategy", "ddp"),
        ("strategy", "fsdp"),
    ],
)
def test_every_group_option_composes_and_builds(group, option, compose_config):
    run = build(compose_config(f"{group}={option}", "trainer.accelerator=cpu"))
    if group == "strategy":
        expected = {"auto": "SingleDeviceStrategy", "ddp": "DDPStrategy", "fsdp": "ModelParallelStrategy"}[option]
        assert type(run.trainer.strategy).__name__ == expected
    if group == "callbacks":
        names = [type(c).__name__ for c in run.callbacks]
        assert ("GradientHealthMonitor" in names) == (option == "diagnostics")
        assert (names == []) == (option == "none")
    if group == "logger":
        assert type(run.loggers[0]).__name__ == {"csv": "CSVLogger", "tensorboard": "TensorBoardLogger"}[option]


@pytest.mark.parametrize(
    "max_steps, configured, used", [(3, None, 1), (100, None, 1), (101, None, 10), (-1, None, 10), (20, 5, 5)]
)
def test_short_runs_log_every_step(max_steps, configured, used, compose_config):
    run = build(compose_config(f"trainer.max_steps={max_steps}", f"trainer.log_every_n_steps={configured or 'null'}"))
    assert run.trainer.log_every_n_steps == used


# Each row: overrides, then strings the message must contain (the key, the value, what is allowed).
# Most messages come from the constructor that rejects the value, with the config key put in front.
BAD_VALUES = [
    (["scaler.growth_factor=0.5"], ["scaler.growth_factor=0.5", "> 1"]),
    (["scaler.backoff_factor=1.5"], ["scaler.backoff_factor=1.5", "> 0 and < 1"]),
    (["scaler.growth_interval=0"], ["scaler.growth_interval=0", "integer >= 1"]),
    (["scaler.hysteresis=0"], ["scaler.hysteresis=0", "integer >= 1"]),
    (["scaler.init_scale=0"], ["scaler.init_scale=0", "> 0"]),
    (["scaler.init_scale=1e9"], ["scaler.init_scale=1000000000", "[min_scale, max_scale]"]),
    (["scaler.init_scale=inf"], ["scaler.init_scale=inf", "finite"]),
    (["scaler.min_scale=100", "scaler.max_scale=10", "scaler.init_scale=50"], ["scaler.min_scale=100", "max_scale=10"]),
    (["scaler=static", "scaler.scale=-1"], ["scaler.scale=-1", "> 0"]),
    (["+scaler.foo=1"], ["scaler.foo is not a setting of DynamicLossScaler", "init_scale, growth_factor"]),
    (["scaler=none", "+scaler.init_scale=8"], ["scaler.init_scale", "scaler=none"]),
    (
        ["precision=fp32", "scaler=static"],
        ["scaler=StaticLossScaler", "not allowed with precision='fp32'", "scaler=None"],
    ),
    (
        ["precision=bf16_pure", "precision.master_weights=true"],
        ["precision.master_weights=True contradicts precision='bf16_pure'", "precision='bf16'"],
    ),
    (
        ["precision=fp16_pure", "precision.autocast=true"],
        ["precision.autocast=True contradicts precision='fp16_pure'", "precision='fp16_autocast'"],
    ),
    (
        ["precision=fp16_autocast", "precision.master_weights=true"],
        ["precision.master_weights=True and autocast=True cannot be combined"],
    ),
    (
        ["precision.master_weights=true", "precision.autocast=true"],
        ["precision.master_weights=True", "cannot be combined"],
    ),
    (["+precision.foo=1"], ["precision.foo is not a setting of PrecisionSettings.build", "emulate"]),
    (["trainer.max_steps=-2"], ["trainer.max_steps=-2", "non-negative integer or -1"]),
    (["trainer.limit_val_batches=1.5"], ["trainer.limit_val_batches=1.5", "[0.0, 1.0]"]),
    (["trainer.devices=0"], ["trainer.devices=0 is not allowed"]),
    (["trainer.accumulate_grad_batches=0"], ["trainer.accumulate_grad_batches=0", "integer >= 1"]),
    (["+trainer.precision=16-mixed"], ["trainer.precision='16-mixed'", "precision=fp32|fp16|bf16", "bf16_split"]),
    (["trainer.strategy=fsdp_cpu_offload"], ["trainer.strategy='fsdp_cpu_offload'", "FSDP1", "Use strategy=fsdp"]),
    (["trainer.strategy=deepspeed_stage_2"], ["trainer.strategy='deepspeed_stage_2'", "its own loss scaler"]),
    (["trainer.strategy=ddp_spawn"], ["trainer.strategy='ddp_spawn' is not allowed", "Use strategy=ddp"]),
    (["trainer.strategy=ddp_fork"], ["trainer.strategy='ddp_fork' is not allowed", "took no step"]),
    (
        ["trainer.accelerator=cpu", "trainer.devices=4096"],
        ["trainer.devices=4096", "each device is a process", "Use at most trainer.devices="],
    ),
    (
        ["strategy=fsdp", "trainer.accelerator=cpu", "trainer.devices=auto"],
        ["trainer.devices='auto' is not allowed with strategy=fsdp", "trainer.devices=2"],
    ),
    (["+trainer.foo=1"], ["trainer.foo is not a setting of Trainer", "max_steps"]),
    (["recipe.lr=-1"], ["recipe.lr=-1", "finite number > 0"]),
    (["recipe.lr=nan"], ["recipe.lr=nan", "finite number > 0"]),
    (["recipe.batch_size=0"], ["recipe.batch_size=0", "integer >= 1"]),
    (["seed=-1"], ["seed=-1", "[0, 2**32 - 1]"]),
    (["num_threads=0"], ["num_threads=0", "integer >= 1"]),
    (["ckpt_path=/no/such/file.ckpt"], ["ckpt_path='/no/such/file.ckpt'", "no such file", "checkpoint file"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, expected", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_bad_values_are_rejected_with_the_key_and_what_is_allowed(overrides, expected, compose_config):
    with pytest.raises(ConfigError) as info:
        build(compose_config(*overrides))
    message = str(info.value)
    for part in expected:
        assert part in message
    assert "\n" not in message  # one paragraph


# Values outside a choice: OmegaConf rejects them while composing, naming the key and the choices.
BAD_CHOICES = [
    (["precision.precision=fp17"], "precision.precision", "[fp32, fp16, bf16, fp16_autocast, bf16_autocast"),
    (["precision.emulate=maybe"], "precision.emulate", "[auto, on, off]"),
    (["scaler.hysteresis_reset=never"], "scaler.hysteresis_reset", "[growth, finite]"),
    (["scaler.on_min_scale=ignore"], "scaler.on_min_scale", "[raise, skip]"),
    (["trainer.gradient_clip_algorithm=l2"], "trainer.gradient_clip_algorithm", "[norm, value]"),
]


@pytest.mark.parametrize("overrides, key, allowed", BAD_CHOICES, ids=[" ".join(o) for o, _, _ in BAD_CHOICES])
def test_values_outside_a_choice_fail_while_composing(overrides, key, allowed, compose_config):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(*overrides)
    text = str(info.value.__cause__)
    assert f"full_key: {key}" in text and f"expected one of {allowed}" in text


def test_a_fault_step_past_max_steps_warns(compose_config):
    with pytest.warns(UserWarning, match=r"fault.inject_inf_at=\[3,30\]: step 30 is at or past trainer.max_steps=20"):
        validate(compose_config("trainer.max_steps=20", "+fault.inject_inf_at=[3,30]"))


BAD_TYPES = [
    (["scaler.init_scale=abc"], "scaler.init_scale"),
    (["scaler.growth_interval=2.5"], "scaler.growth_interval"),
    (["precision.master_weights=maybe"], "precision.master_weights"),
    (["trainer.max_steps=ten"], "trainer.max_steps"),
    (["seed=abc"], "seed"),
    (["foo=1"], "foo"),
    (["scaler.foo=1"], "scaler.foo"),
    (["recipe.lrr=0.1"], "recipe.lrr"),
    (["precision.name=mine"], "precision.name"),  # a preset is named by precision.precision
]


@pytest.mark.parametrize("overrides, key", BAD_TYPES, ids=[" ".join(o) for o, _ in BAD_TYPES])
def test_wrong_types_and_unknown_keys_fail_while_composing(overrides, key, compose_config):
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError)) as info:
        compose_config(*overrides)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert key.split(".")[-1] in text


@pytest.mark.parametrize("option", ["fp17", "FP16"])
def test_unknown_preset_lists_the_choices(option, compose_config):
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(f"precision={option}")
    message = str(info.value)
    assert f"precision/{option}" in message
    for preset in PRESETS:
        assert preset in message


def test_recipe_arguments_are_checked_by_the_recipe(compose_config):
    with pytest.raises(ConfigError, match=r"recipe.lr='abc' is not allowed: lr must be a finite number > 0"):
        build(compose_config("recipe.lr=abc"))
    with pytest.raises(ConfigError, match=r"recipe.hidden_sizes=\['a'\] is not allowed"):
        build(compose_config("recipe.hidden_sizes=[a]"))
    with pytest.raises(ConfigError, match=r"recipe.extra is not a setting of DigitsRecipe: the allowed keys are lr,"):
        build(compose_config("+recipe.extra=1"))
    with pytest.raises(ConfigError, match=r"recipe.model='rnn' is not allowed: model must be one of 'mlp', 'cnn'"):
        build(compose_config("recipe.model=rnn"))
    with pytest.raises(ConfigError, match=r"recipe._target_='amp_plugin.recipes.nope.Nope'"):
        build(compose_config("recipe._target_=amp_plugin.recipes.nope.Nope"))
    with pytest.raises(ConfigError, match=r"recipe._target_='collections.OrderedDict' .*LightningModule subclass"):
        build(compose_config("recipe._target_=collections.OrderedDict", "~recipe.lr"))


def test_unreadable_checkpoint_is_a_config_error(tmp_path, compose_config):
    from amp_plugin.app.run import train

    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(b"not a checkpoint")
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(ConfigError, match=r"ckpt_path=.*broken.ckpt.*cannot be read as a checkpoint"):
        train(compose_config(f"ckpt_path={bad}", output_dir=out))
    assert sorted(p.name for p in out.iterdir()) == ["FAILED"]


# ------------------------------------------------------------------------------ the real CLI
# Each row: the command-line arguments, then strings stderr must contain.
CLI_CASES = [
    (["precision=fp17"], ["precision/fp17", "fp16_autocast", "bf16_pure"]),
    (["scaler=dynamc"], ["scaler/dynamc", "dynamic", "static", "none"]),
    (["recipe=mnist"], ["recipe/mnist", "digits", "char_gpt"]),
    (["scaler.growth_factor=0.5"], ["scaler.growth_factor=0.5", "> 1"]),
    (["scaler.backoff_factor=2"], ["scaler.backoff_factor=2", "> 0 and < 1"]),
    (["scaler.init_scale=abc"], ["scaler.init_scale", "abc", "Float"]),
    (["scaler.hysteresis=0"], ["scaler.hysteresis=0", "integer >= 1"]),
    (["scaler.growth_interval=-3"], ["scaler.growth_interval=-3", "integer >= 1"]),
    (["scaler.init_scale=1e30"], ["scaler.init_scale=1e+30", "[min_scale, max_scale]"]),
    (["scaler.hysteresis_reset=never"], ["scaler.hysteresis_reset", "'never'", "expected one of [growth, finite]"]),
    (["precision.emulate=maybe"], ["precision.emulate", "'maybe'", "expected one of [auto, on, off]"]),
    (["learning_rate=0.1"], ["learning_rate", "+learning_rate=0.1"]),
    (["scaler.foo=1"], ["scaler.foo", "DynamicScalerConf"]),
    (["+scaler.foo=1"], ["scaler.foo is not a setting of DynamicLossScaler", "init_scale"]),
    (["precision=fp32", "scaler=static"], ["scaler=StaticLossScaler", "not allowed with precision='fp32'"]),
    (["precision=bf16_pure", "precision.master_weights=true"], ["precision.master_weights=True", "bf16_pure"]),
    (
        ["precision=fp16_pure", "precision.autocast=true"],
        ["precision.autocast=True contradicts precision='fp16_pure'", "precision='fp16_autocast'"],
    ),
    (["trainer.max_steps=abc"], ["trainer.max_steps", "abc", "Integer"]),
    (["trainer.limit_val_batches=1.5"], ["trainer.limit_val_batches=1.5", "[0.0, 1.0]"]),
    (["ckpt_path=missing.ckpt"], ["ckpt_path='missing.ckpt'", "no such file"]),
    (["ckpt_path=corrupt.ckpt"], ["ckpt_path='corrupt.ckpt'", "cannot be read as a checkpoint"]),
    (["recipe.lr=abc"], ["recipe.lr='abc'", "a finite number > 0"]),
    (["recipe.lr=nan"], ["recipe.lr=nan", "a finite number > 0"]),
    (["recipe.batch_size=0"], ["recipe.batch_size=0", "integer >= 1"]),
    (["recipe.model=rnn"], ["recipe.model='rnn'", "'mlp', 'cnn'"]),
]


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Every CLI_CASES row through train.py's real entry point, all in one subprocess."""
    work = tmp_path_factory.mktemp("cli")
    (work / "corrupt.ckpt").write_bytes(b"\x00 truncated")
    ops = [
        {"kind": "run", "name": f"run{i}", "args": [*args, "trainer.max_steps=1"]}
        for i, (args, _) in enumerate(CLI_CASES)
    ]
    results = run_batch(work, ops)
    return [results[f"run{i}"] for i in range(len(CLI_CASES))]


@pytest.mark.slow
@pytest.mark.xdist_group("cli_results")  # one worker runs the module's batch of CLI runs
@pytest.mark.parametrize("index", range(len(CLI_CASES)), ids=[" ".join(a) for a, _ in CLI_CASES])
def test_bad_input_through_the_cli_exits_nonzero_with_a_short_message(cli_results, index):
    result, expected = cli_results[index], CLI_CASES[index][1]
    stderr = result["stderr"]
    assert result["code"] not in (0, None)
    for part in expected:
        assert part in stderr
    assert "Traceback" not in stderr + result["stdout"]
    assert "HYDRA_FULL_ERROR=1" in stderr
    assert len(stderr.split("\n\n")) <= 4  # a paragraph or two (Hydra adds a search-path block), not a wall
    # Nothing that looks like a finished run: Hydra may have created the directory, but no
    # checkpoints, metrics or summary, and a FAILED note when the job itself started.
    if result["listing"] is not None:
        assert not set(result["listing"]) & {"checkpoints", "logs", "summary.json", "training_curves.png"}
        assert "FAILED" in result["listing"]


def run_cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["precision=fp17"], "Available options in 'precision'"),
        (["scaler.growth_factor=0.5"], "scaler.growth_factor=0.5"),
    ],
)
def test_cli_process_exits_with_status_1(tmp_path, args, expected):
    run_dir = tmp_path / "run"
    proc = run_cli([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 1
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    # what the refused run was given and why it failed; no train.log (it is created by its first line)
    assert not run_dir.exists() or sorted(p.name for p in run_dir.iterdir()) == [".hydra", "FAILED"]


@pytest.mark.slow
def test_hydra_full_error_shows_the_traceback(tmp_path):
    proc = run_cli(["scaler.hysteresis=0", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, HYDRA_FULL_ERROR="1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_console_script_finds_the_configs(monkeypatch, tmp_path):
    from amp_plugin.app.cli import config_dir

    assert Path(config_dir()) == CONFIG_DIR
    mine = tmp_path / "configs"
    mine.mkdir()
    (mine / "train.yaml").write_text("defaults:\n  - train_schema\n")
    monkeypatch.setenv("AMP_PLUGIN_CONFIG_DIR", str(mine))
    assert Path(config_dir()) == mine


def test_composed_config_round_trips_to_yaml(compose_config):
    cfg = compose_config("precision=bf16", "scaler=static")
    text = OmegaConf.to_yaml(cfg)
    assert "amp_plugin.StaticLossScaler" in text and "precision: bf16" in text


# ------------------------------------------------------------------------------ one pass, Lightning last
_BEFORE_LIGHTNING = """
import sys
from hydra import compose, initialize_config_dir
from amp_plugin.app.build import prepare
from amp_plugin.app.cli import run_job
from amp_plugin.app.schema import register_configs

register_configs()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    good = compose("train", overrides=["precision=bf16", "scaler=static", "output_dir=" + sys.argv[2]])
    bad = compose("train", overrides=["scaler.growth_factor=0.5", "output_dir=" + sys.argv[2]])
print("prepared", prepare(good).describe())
try:
    run_job(bad)
except SystemExit as exit:
    print("exit", exit.code)
print("lightning", sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning")))
"""


@pytest.mark.slow
def test_a_bad_command_line_fails_before_lightning_is_imported(tmp_path):
    """The scaler and the precision settings are built, and checked, before Lightning is imported."""
    proc = subprocess.run(
        [sys.executable, "-c", _BEFORE_LIGHTNING, str(CONFIG_DIR), str(tmp_path)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "prepared BF16 weights and compute, FP32 master weights, static loss scale 65536" in lines
    assert "exit 1" in lines and "lightning []" in lines
    assert "Invalid configuration: scaler.growth_factor=0.5 is not allowed" in proc.stderr


def test_one_cli_run_validates_once(tmp_path, monkeypatch, compose_config):
    from amp_plugin.app import build as build_module
    from amp_plugin.app.cli import run_job

    calls = []
    monkeypatch.setattr(build_module, "validate", lambda cfg: calls.append(cfg) or validate(cfg))
    result = run_job(
        compose_config(
            "trainer.max_steps=2",
            "trainer.limit_val_batches=1",
            "callbacks=none",
            "trainer.enable_progress_bar=false",
            "plot=false",
            output_dir=tmp_path,
        )
    )
    assert result["steps"] == 2 and len(calls) == 1


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "soon"])
def test_a_bad_fused_build_timeout_is_a_config_error(value, monkeypatch, compose_config):
    monkeypatch.setenv("AMP_PLUGIN_FUSED_BUILD_TIMEOUT", value)
    with pytest.raises(ConfigError) as info:
        validate(compose_config())
    message = str(info.value)
    assert f"AMP_PLUGIN_FUSED_BUILD_TIMEOUT={value!r} is not allowed" in message and "a finite number > 0" in message
    assert "\n" not in message


@pytest.mark.slow
def test_a_bad_fused_build_timeout_through_the_cli_is_one_line_before_training(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["trainer.max_steps=1", f"hydra.run.dir={run_dir}"], cwd=tmp_path, AMP_PLUGIN_FUSED_BUILD_TIMEOUT="nan"
    )
    assert proc.returncode == 1
    assert "AMP_PLUGIN_FUSED_BUILD_TIMEOUT='nan' is not allowed" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists() or sorted(p.name for p in run_dir.iterdir()) == [".hydra", "FAILED"]
