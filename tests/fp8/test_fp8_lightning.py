"""The ``fp8`` preset in Lightning and in the app: conversion, per-step updates, FP8Monitor, resume."""

from __future__ import annotations

import csv
import json
import logging

import pytest
import torch
from _models import TinyClassifier, as_lightning, quiet_trainer

from amp_plugin import MixedPrecisionPlugin
from amp_plugin.app.report import format_summary
from amp_plugin.app.run import train
from amp_plugin.app.validation import ConfigError
from amp_plugin.callbacks import FP8Monitor
from amp_plugin.fp8 import Fp8Linear, Fp8NothingConvertedWarning
from amp_plugin.lightning.plugin import CHECKPOINT_KEY

# TinyClassifier's two Linear layers (8 -> 16 -> 2) both convert with these settings.
SMALL = {"keep_first_last": False, "min_features": 1, "multiple_of": 1, "amax_history_len": 4}


def make(pl, **fp8):
    pl.seed_everything(0)
    model = as_lightning(pl, TinyClassifier)(n=24, step_keyed=True)
    return model, MixedPrecisionPlugin("fp8", fp8={**SMALL, **fp8})


def test_plugin_converts_updates_and_monitors(pl, tmp_path):
    model, plugin = make(pl)
    monitor = FP8Monitor(every_n_steps=2)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=5, callbacks=[monitor], default_root_dir=tmp_path)
    trainer.fit(model)
    assert isinstance(model.net[0], Fp8Linear) and isinstance(model.net[3], Fp8Linear)
    assert model.net[0].weight.dtype == torch.bfloat16
    layers = plugin.fp8_layers
    assert layers is not None and layers.steps == 5  # one update per optimizer step
    assert all(torch.count_nonzero(m.fp8_amax_history) > 0 for m in layers.layers.values())
    with open(monitor.csv_path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "layer", "operand", "amax", "scale", "saturated_frac", "flushed_frac", "numel"]
    assert [r[0] for r in rows[1:]] == ["2"] * 6 + ["4"] * 6  # 2 layers x 3 operands, every 2 steps
    assert {r[1] for r in rows[1:]} == {"net.0", "net.3"}
    assert {"fp8/max_saturated_frac", "fp8/min_scale", "fp8/bf16_fallbacks"} <= set(monitor.last_summary)
    assert monitor.last_summary["fp8/fp8_layers"] == 2.0
    assert "FP8" in plugin.describe()


def test_resume_continues_the_amax_histories_bit_for_bit(pl, tmp_path):
    model, plugin = make(pl)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=8, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(model)
    full = plugin.fp8_layers.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)
    assert saved[CHECKPOINT_KEY]["fp8"]["steps"] == 3

    model, plugin = make(pl)
    trainer = quiet_trainer(pl, plugins=[plugin], max_steps=8)
    trainer.fit(model, ckpt_path=tmp_path / "epoch=0.ckpt")  # saved after step 3 of 8
    resumed = plugin.fp8_layers.state_dict()
    assert resumed["steps"] == full["steps"] == 8
    for name, entry in full["layers"].items():
        assert torch.equal(entry["amax_history"], resumed["layers"][name]["amax_history"]), name
        assert torch.equal(entry["scale"], resumed["layers"][name]["scale"]), name
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b)


def test_a_layer_that_keeps_saturating_falls_back_once(pl, caplog):
    class Exploding(as_lightning(pl, TinyClassifier)):  # type: ignore[misc]
        def forward(self, x):
            return self.net(x * 8.0 ** (self.global_step + 1))  # beyond every delayed scale

    pl.seed_everything(0)
    model = Exploding(n=24, step_keyed=True)
    plugin = MixedPrecisionPlugin("fp8", fp8={**SMALL, "fallback_steps": 2})
    with caplog.at_level(logging.WARNING, logger="amp_plugin.fp8"):
        quiet_trainer(pl, plugins=[plugin], max_steps=6).fit(model)
    assert "net.0" in [f.layer for f in plugin.fp8_layers.fallbacks]
    assert not model.net[0].fp8_active
    assert sum("'net.0' falls back to BF16" in r.getMessage() for r in caplog.records) == 1


def test_the_app_trains_char_gpt_with_fp8(tmp_path, compose_config):
    result = train(
        compose_config(
            "precision=fp8",
            "recipe=char_gpt",
            "recipe.max_chars=20000",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=2",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            "precision.fp8.scaling=current",
            "plot=false",
            output_dir=tmp_path,
        )
    )
    assert result["status"] == "ok" and result["precision"] == "fp8" and result["steps"] == 4
    layers = result["plugin"].fp8_layers
    assert layers.recipe.scaling == "current"
    assert "model.blocks.0.mlp.0" in layers.layers and "model.head" not in layers.layers
    assert torch.isfinite(torch.tensor(result["final_metrics"]["val/loss"]))
    with open(tmp_path / "logs" / "fp8_stats.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["step"] for r in rows} == {"2", "4"} and {r["operand"] for r in rows} == {
        "input",
        "weight",
        "grad_output",
    }
    with open(tmp_path / "logs" / "metrics.csv", newline="") as f:
        assert "fp8/max_saturated_frac" in next(csv.reader(f))
    # The summary counts what ran in FP8: 2 blocks x 4 linears, the first and the head kept.
    expected = {
        "layers": 9,
        "fp8": 7,
        "bf16": 2,
        "fp8_types": {"Linear": 7},
        "bf16_reasons": {"first_last": 2},
        "bf16_layers": {"model.blocks.0.attn.qkv": "first_last", "model.head": "first_last"},
    }
    assert result["fp8"] == expected
    assert json.loads((tmp_path / "summary.json").read_text())["fp8"] == expected
    assert "  fp8 layers   7 of 9 linear layers in FP8 (7 Linear); 2 in BF16: 2 first/last" in format_summary(result)


@pytest.mark.slow
def test_the_app_says_when_fp8_converts_nothing(tmp_path, compose_config, capsys):
    # A CNN whose one linear layer is its head (kept BF16 as the last layer): no FP8 GEMM at all.
    with pytest.warns(Fp8NothingConvertedWarning, match=r"all 1 of its linear layers stay BF16.*'net.9'"):
        result = train(
            compose_config(
                "precision=fp8",
                "recipe=digits",
                "recipe.model=cnn",
                "recipe.hidden_sizes=[16,16]",
                "trainer.max_steps=2",
                "trainer.limit_val_batches=1",
                "trainer.enable_progress_bar=false",
                "plot=false",
                output_dir=tmp_path,
            )
        )
    assert result["fp8"]["fp8"] == 0 and result["fp8"]["bf16_layers"] == {"net.9": "first_last"}
    assert json.loads((tmp_path / "summary.json").read_text())["fp8"]["fp8"] == 0
    printed = capsys.readouterr().out
    assert "fp8 layers   0 of 1 linear layers in FP8; 1 in BF16: 1 first/last layer (keep_first_last) (no FP8 GEMM" in (
        printed
    )


@pytest.mark.slow
def test_a_bf16_run_has_no_fp8_summary(tmp_path, compose_config):
    result = train(
        compose_config(
            "precision=bf16",
            "trainer.max_steps=1",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            "plot=false",
            output_dir=tmp_path,
        )
    )
    assert result["fp8"] is None and "fp8 layers" not in format_summary(result)


def test_the_app_names_a_bad_fp8_setting(compose_config):
    for override, message in [
        ("precision.fp8.margin=1000", r"margin=1000 is not allowed: margin must be an integer in \[0, 14\]"),
        ("precision.fp8.margin=-1", r"margin=-1 is not allowed"),
    ]:
        with pytest.raises(ConfigError, match=message):
            train(compose_config("precision=fp8", override))


def test_a_resume_in_place_keeps_the_fp8_rows_of_the_checkpoints_step(tmp_path, compose_config):
    """Resumed in place from step 3, the run's ``fp8_stats.csv`` and the ``fp8/*`` rows of ``metrics.csv`` are
    those of an uninterrupted run. The rows of the checkpoint's own step were dropped: ``fp8_stats.csv``
    counts a row's step as the steps done (the row of step 3 is the checkpoint's), and ``metrics.csv``
    had the ``fp8/*`` values one step after Lightning's row of the same optimizer step."""
    quick = ["precision=fp8", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1", "plot=false"]

    def fp8_files(out):
        with open(out / "logs" / "fp8_stats.csv", newline="") as f:
            stats = list(csv.reader(f))
        with open(out / "logs" / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        losses = [r["step"] for r in rows if r.get("train/loss")]
        return stats, [(r["step"], r["fp8/min_scale"]) for r in rows if r.get("fp8/fp8_layers")], losses

    train(compose_config(*quick, "trainer.max_steps=6", output_dir=tmp_path / "straight"))
    first = train(compose_config(*quick, "trainer.max_steps=3", output_dir=tmp_path / "resumed"))
    ckpt = first["paths"]["last_checkpoint"]
    train(compose_config(*quick, "trainer.max_steps=6", f"ckpt_path={ckpt}", output_dir=tmp_path / "resumed"))
    stats, metrics, losses = fp8_files(tmp_path / "straight")
    assert sorted({row[0] for row in stats[1:]}) == ["1", "2", "3", "4", "5", "6"]
    assert [step for step, _ in metrics] == losses == ["0", "1", "2", "3", "4", "5"]  # an optimizer step's rows
    assert fp8_files(tmp_path / "resumed") == (stats, metrics, losses)
