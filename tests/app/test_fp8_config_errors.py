"""Bad FP8 settings are refused as every bad config is: one line naming the full key and the value.

- A range error of ``Fp8Recipe`` names ``precision.fp8.<key>``, not the bare ``<key>`` (the FP8
  settings are a node nested in the precision group); any nested node's keys are named in full.
- A ``precision.fp8.*`` override under a preset without FP8 settings is refused in one line before
  Hydra composes the run (it failed inside OmegaConf with ``AssertionError: Unexpected type for
  root: NoneType`` and a traceback), and nothing is written.
- A ``keep_bf16`` pattern that matches no linear layer of the recipe is refused while the run is
  built, before it takes its directory (it failed inside ``trainer.fit`` with Lightning's
  traceback, after ``.amp_run``, ``logs/`` and ``train.log`` were written).
"""

from __future__ import annotations

import pytest
from _cli_batch import run_batch
from _cli_procs import QUIET

from amp_plugin.app import overrides
from amp_plugin.app.build import build, prepare
from amp_plugin.app.config_nodes import naming_key
from amp_plugin.app.validation import ConfigError

# ------------------------------------------------------------------------------ A: the full key
BAD_FP8_VALUES = [
    ("precision.fp8.margin=20", "precision.fp8.margin=20 is not allowed: margin must be an integer in [0, 14]"),
    ("precision.fp8.margin=-1", "precision.fp8.margin=-1 is not allowed"),
    ("precision.fp8.amax_history_len=0", "precision.fp8.amax_history_len=0 is not allowed: amax_history_len must be"),
    ("precision.fp8.amax_floor=0", "precision.fp8.amax_floor=0.0 is not allowed: amax_floor must be a finite number"),
    ("precision.fp8.fallback_saturation=1.5", "precision.fp8.fallback_saturation=1.5 is not allowed"),
    ("precision.fp8.fallback_steps=-1", "precision.fp8.fallback_steps=-1 is not allowed"),
    ("precision.fp8.min_features=0", "precision.fp8.min_features=0 is not allowed"),
    ("precision.fp8.multiple_of=0", "precision.fp8.multiple_of=0 is not allowed: multiple_of must be an integer >= 1"),
    ("+precision.fp8.foo=1", "precision.fp8.foo=1 is not allowed: unknown FP8 setting(s) ['foo']"),
]


@pytest.mark.parametrize("override, expected", BAD_FP8_VALUES, ids=[o for o, _ in BAD_FP8_VALUES])
def test_a_bad_fp8_value_names_the_full_key(override, expected, compose_config):
    with pytest.raises(ConfigError) as info:
        prepare(compose_config("precision=fp8", override))
    assert str(info.value).startswith(expected), str(info.value)


def test_a_key_of_any_nested_node_is_named_in_full():
    config = {"lr": 0.1, "optimizer": {"eps": 0.0, "betas": [0.9, 0.999]}, "head": {"norm": {"eps": 1e-5}}}
    assert naming_key("recipe", config, ValueError("lr=-1 is not allowed: lr must be > 0.")).startswith("recipe.lr=-1")
    # the shallowest node with the key; among equals, the one whose value the message repeats
    assert (
        naming_key("recipe", config, ValueError("eps=0.0 is not allowed")) == "recipe.optimizer.eps=0.0 is not allowed"
    )
    assert (
        naming_key("recipe", {"a": {"eps": 1}, "b": {"eps": 2}}, ValueError("eps=2 is bad")) == "recipe.b.eps=2 is bad"
    )
    # a key of the node itself comes before a nested one of the same name
    assert naming_key("x", {"eps": 1, "sub": {"eps": 2}}, ValueError("eps=2 is bad")) == "x.eps=2 is bad"
    # a name the config does not hold stays as it was
    assert naming_key("recipe", config, ValueError("gamma=3 is not allowed")) == "gamma=3 is not allowed"


def test_scaler_errors_still_name_their_key(compose_config):
    with pytest.raises(ConfigError, match=r"^scaler.growth_factor=0.5 is not allowed"):
        prepare(compose_config("scaler.growth_factor=0.5"))


# ------------------------------------------------------------------------------ B: fp8 keys without fp8
@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["precision=bf16_lean", "precision.fp8.margin=3"],
            "precision.fp8.margin=3 is not allowed with precision=bf16_lean",
        ),
        (
            ["precision.fp8.keep_bf16=[a]"],
            "precision.fp8.keep_bf16=[a] is not allowed with precision=fp16",
        ),  # the default
        (["precision=bf16", "++precision.fp8.margin=3"], "precision.fp8.margin=3 is not allowed with precision=bf16"),
        (["precision=bf16", "precision.fp8={margin:3}"], "precision.fp8={margin:3} is not allowed with precision=bf16"),
        (
            ["-m", "precision=fp8,bf16_pure", "precision.fp8.margin=1"],
            "precision.fp8.margin=1 is not allowed with precision=bf16_pure",  # one job of a sweep
        ),
    ],
)
def test_fp8_keys_under_another_preset_are_refused_in_one_line(argv, expected):
    message = overrides.fp8_without_fp8(argv)
    assert message is not None and message.startswith(expected), message
    assert message.endswith("precision.fp8.* applies only to precision=fp8 (drop it, or choose precision=fp8).")


@pytest.mark.parametrize(
    "argv",
    [
        ["precision=fp8", "precision.fp8.margin=3"],
        ["precision=fp8", "precision.fp8={margin:3}"],
        ["precision=bf16", "precision.fp8=null"],  # nothing to set: fp8 is null already
        ["precision=bf16", "precision.emulate=on"],
        ["-m", "precision=fp8", "precision.fp8.margin=1,2"],
    ],
)
def test_fp8_keys_with_the_fp8_preset_pass(argv):
    assert overrides.fp8_without_fp8(argv) is None


# ------------------------------------------------------------------------------ C: keep_bf16 against the model
def test_a_keep_bf16_pattern_that_matches_no_layer_is_a_config_error_at_build(compose_config):
    with pytest.raises(ConfigError) as info:
        build(compose_config("precision=fp8", "recipe=digits", "precision.fp8.keep_bf16=[nonexistent.*]"))
    message = str(info.value)
    assert message.startswith("precision.fp8.keep_bf16=['nonexistent.*'] is not allowed: its pattern 'nonexistent.*'")
    assert "The model's 3 linear layers: 'net.1', 'net.4', 'net.7'." in message and "\n" not in message


def test_a_keep_bf16_pattern_that_matches_builds(compose_config):
    run = build(compose_config("precision=fp8", "recipe=digits", "precision.fp8.keep_bf16=[net.4]"))
    assert run.plugin.settings.fp8.keep_bf16 == ("net.4",)


def test_a_refused_keep_bf16_writes_only_the_failure_note(tmp_path, compose_config):
    from amp_plugin.app.run import train

    out = tmp_path / "run"
    out.mkdir()
    cfg = compose_config("precision=fp8", "recipe=digits", "precision.fp8.keep_bf16=[nonexistent.*]", output_dir=out)
    with pytest.raises(ConfigError, match=r"^precision.fp8.keep_bf16="):
        train(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["FAILED"]  # no .amp_run, logs/, checkpoints


# ------------------------------------------------------------------------------ B and C through the CLI
CLI = {
    "fp8_key_bf16_lean": (
        ["precision=bf16_lean", "precision.fp8.margin=3"],
        "Invalid configuration: precision.fp8.margin=3 is not allowed with precision=bf16_lean: precision.fp8.* "
        "applies only to precision=fp8",
    ),
    "keep_bf16_no_match": (
        ["recipe=digits", "precision=fp8", "precision.fp8.keep_bf16=[nonexistent.*]", "trainer.max_steps=5"],
        "Invalid configuration: precision.fp8.keep_bf16=['nonexistent.*'] is not allowed",
    ),
    "margin_20": (
        ["precision=fp8", "precision.fp8.margin=20", "trainer.max_steps=1"],
        "Invalid configuration: precision.fp8.margin=20 is not allowed",
    ),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8_cli")
    return run_batch(work, [{"kind": "run", "name": name, "args": [*args, *QUIET]} for name, (args, _) in CLI.items()])


@pytest.mark.slow
@pytest.mark.xdist_group("fp8_config_errors_cli")
@pytest.mark.parametrize("name", list(CLI))
def test_bad_fp8_input_through_the_cli_is_one_line_and_writes_no_run(cli_results, name):
    result, expected = cli_results[name], CLI[name][1]
    output = result["stderr"] + result["stdout"]
    assert result["code"] == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert any(line.startswith(expected) for line in result["stderr"].splitlines()), result["stderr"][-3000:]
    if name == "fp8_key_bf16_lean":  # refused before Hydra composes the run: no directory at all
        assert result["listing"] is None
    else:  # refused as any bad config: what it was given and why, nothing of a run
        assert result["listing"] == [".hydra", "FAILED"]
