"""The app end to end: ``train(cfg)`` per preset and recipe, resume, multirun + compare, the default run.

In-process runs use a few steps (``trainer.max_steps=3``, one validation batch). The CLI runs
(multirun + compare, and the true no-argument default, about a minute) are marked slow.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amp_plugin.app.compare import collect_runs, format_table
from amp_plugin.app.compare import main as compare_main
from amp_plugin.app.plots import plot_run, read_history, write_history
from amp_plugin.app.report import format_summary
from amp_plugin.app.run import train
from amp_plugin.lightning import pl
from amp_plugin.settings import PRESETS

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
QUICK = ["trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"]


def csv_header(path: str | Path) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f))


def training_rows(path: str | Path) -> list[dict[str, str]]:
    """The rows of a metrics.csv that hold training metrics."""
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("train/loss")]


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_and_writes_its_outputs(tmp_path, preset, capsys, compose_config):
    # fp16_pure needs an eps FP16 can hold (the digits recipe's 1e-8 is 0 in FP16: NaN weights, a failed run)
    eps = ["recipe.adam_eps=1e-4"] if preset == "fp16_pure" else []
    result = train(compose_config(f"precision={preset}", *QUICK, *eps, output_dir=tmp_path))
    expected = PRESETS[preset]
    plugin = result["plugin"]
    assert (plugin.amp_precision, plugin.master_weights, plugin.autocast) == (
        expected.precision,
        expected.master_weights,
        expected.autocast,
    )
    assert result["status"] == "ok" and result["precision"] == preset and result["recipe"] == "digits"
    assert result["steps"] == result["global_step"] == 3
    assert {"train/loss", "val/loss", "val/acc"} <= set(result["final_metrics"])
    scaled = preset.startswith("fp16")
    assert result["scaler"] == ("dynamic" if scaled else "none")
    assert (result["loss_scale"]["start"] == 2.0**16) if scaled else (result["loss_scale"]["start"] is None)
    assert ("no loss scaling" in result["plugin_settings"]["describe"]) == (not scaled)

    paths = {k: Path(v) for k, v in result["paths"].items() if v is not None}
    for key in ("metrics", "last_checkpoint", "history", "plot", "summary"):
        assert paths[key].is_file(), key
    assert paths["metrics"] == tmp_path / "logs" / "metrics.csv"
    if scaled:  # LossScaleMonitor has nothing to record without a scaler
        assert csv_header(paths["scale_events"]) == ["step", "old_scale", "new_scale", "reason", "nonfinite_params"]
        assert [bool(row["amp/loss_scale"]) for row in training_rows(paths["metrics"])] == [True] * 3
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every file the run wrote is in the summary: FP8Monitor's statistics with fp8
    assert ("fp8_stats" in paths) == (preset == "fp8")
    if preset == "fp8":
        assert csv_header(paths["fp8_stats"])[:3] == ["step", "layer", "operand"]
    history = read_history(paths["history"])
    assert [row["step"] for row in history] == [1, 2, 3]
    assert not (tmp_path / "FAILED").exists()

    summary = json.loads(paths["summary"].read_text())
    assert summary["final_metrics"].keys() == result["final_metrics"].keys()
    assert summary["loss_scale"] == result["loss_scale"] and summary["skipped_steps"] == result["skipped_steps"]
    printed = capsys.readouterr().out
    assert "amp_plugin run summary" in printed and str(tmp_path) in printed
    assert ("fp8 stats  logs/fp8_stats.csv" in printed) == (preset == "fp8")
    # the bytes of training state per parameter the preset buys (digits: ~2% of parameters are FP32 norms)
    total = {"bf16_lean": 10, "bf16_sr": 8, "bf16_split": 14, "fp16": 16, "bf16": 16}.get(preset)
    state = summary["state_bytes_per_param"]
    assert state == result["state_bytes_per_param"] and f"{state['total']:.2f} bytes of training state" in printed
    if total is not None:
        assert total <= state["total"] < total + 0.4, state


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml")))
def test_every_recipe_trains_a_few_steps(tmp_path, recipe, compose_config):
    overrides = [
        f"recipe={recipe}",
        "trainer.max_steps=2",
        "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false",
        "callbacks=none",
        "plot=false",
    ]
    if recipe == "char_gpt":
        overrides.append("recipe.max_chars=20000")  # a small corpus keeps the test quick
    result = train(compose_config(*overrides, output_dir=tmp_path))
    # the summary names the recipe's module: bert_grad_drop is the bert recipe in other settings
    assert result["recipe"] == {"bert_grad_drop": "bert"}.get(recipe, recipe) and result["steps"] == 2
    assert "train/loss" in result["final_metrics"] and "val/loss" in result["final_metrics"]
    assert result["paths"]["plot"] is None and not (tmp_path / "training_curves.png").exists()


@pytest.mark.parametrize(
    "overrides, scaled",
    [(["precision=fp16_autocast"], True), (["precision=bf16", "scaler=dynamic"], True), (["precision=bf16"], False)],
)
def test_a_short_run_shows_its_loss_scale(tmp_path, overrides, scaled, compose_config):
    """A 20-step run logs every step; ``amp/loss_scale`` wherever there is a scaler."""
    result = train(
        compose_config(
            *overrides,
            "trainer.max_steps=20",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            "plot=false",
            output_dir=tmp_path,
        )
    )
    rows = training_rows(tmp_path / "logs" / "metrics.csv")
    assert [int(row["step"]) for row in rows] == list(range(20))
    assert all(row.get("amp/loss_scale") == "65536.0" for row in rows) == scaled
    summary = format_summary(result)
    assert ("dynamic loss scaling" in summary) == scaled and ("no loss scaling" in summary) == (not scaled)


def test_tensorboard_logger_and_diagnostic_callbacks(tmp_path, compose_config):
    result = train(
        compose_config(
            "logger=tensorboard",
            "callbacks=diagnostics",
            "callbacks.grad_health_monitor.every_n_steps=1",
            *QUICK,
            output_dir=tmp_path,
        )
    )
    logs = tmp_path / "logs"
    assert any(p.name.startswith("events.out.tfevents") for p in logs.iterdir())
    assert (logs / "scale_events.csv").is_file()
    assert csv_header(logs / "grad_health.csv")[:3] == ["step", "param", "numel"]
    assert result["paths"]["metrics"] is None  # TensorBoard keeps its own files
    assert "logs" in format_summary(result)


def test_no_callbacks_still_summarizes_and_plots(tmp_path, compose_config):
    result = train(compose_config("callbacks=none", *QUICK, output_dir=tmp_path))
    assert result["paths"]["last_checkpoint"] is None and not (tmp_path / "checkpoints").exists()
    assert result["loss_scale"]["end"] == 2.0**16 and result["skipped_steps"] == 0
    assert (tmp_path / "training_curves.png").is_file()


@pytest.mark.slow
def test_resume_from_checkpoint_continues_step_count_and_loss_scale(tmp_path, compose_config):
    # growth_interval=2 makes the scale move, so a resume that forgot it would show.
    first = train(
        compose_config(
            "scaler.growth_interval=2",
            "trainer.max_steps=6",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            output_dir=tmp_path / "a",
        )
    )
    assert first["loss_scale"]["end"] > first["loss_scale"]["start"]
    ckpt = first["paths"]["last_checkpoint"]
    assert ckpt is not None
    second = train(
        compose_config(
            "scaler.growth_interval=2",
            "trainer.max_steps=10",
            "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false",
            f"ckpt_path={ckpt}",
            output_dir=tmp_path / "b",
        )
    )
    assert second["resumed_from"] == ckpt
    assert (second["global_step"], second["steps"]) == (10, 4)
    assert second["loss_scale"]["start"] == first["loss_scale"]["end"]
    assert [row["step"] for row in read_history(second["paths"]["history"])] == [7, 8, 9, 10]
    assert "resumed at step 6" in format_summary(second)


def test_resume_past_max_steps_is_rejected_before_training(tmp_path, compose_config):
    from amp_plugin.app.validation import ConfigError

    first = train(compose_config(*QUICK, output_dir=tmp_path / "a"))
    out = tmp_path / "b"
    out.mkdir()
    with pytest.raises(ConfigError, match=r"trainer.max_steps=3 leaves nothing to train.*already at step 3"):
        train(compose_config(*QUICK, f"ckpt_path={first['paths']['last_checkpoint']}", output_dir=out))
    assert sorted(p.name for p in out.iterdir()) == ["FAILED"]


def test_compare_reads_runs_and_reports_failures(tmp_path, capsys):
    for name, acc in (("0", 0.9), ("1", 0.95)):
        run = tmp_path / name
        run.mkdir()
        rows = [
            {"step": 1.0, "train_loss": 2.0, "loss_scale": 65536.0, "skipped_steps": 0.0, "lr": 0.1},
            {
                "step": 2.0,
                "train_loss": 1.0,
                "loss_scale": 32768.0,
                "skipped_steps": 1.0,
                "lr": 0.1,
                "val/loss": 1.1,
                "val/acc": acc,
            },
        ]
        write_history(rows, run / "training_curves.csv")
        plot_run(rows, run / "training_curves.png", title=name)
        (run / "summary.json").write_text(
            json.dumps(
                {
                    "status": "ok",
                    "precision": "fp16",
                    "scaler": "dynamic",
                    "recipe": "digits",
                    "steps": 2,
                    "final_metrics": {"train/loss": 1.0, "val/loss": 1.1, "val/acc": acc},
                    "skipped_steps": 1,
                    "loss_scale": {"start": 65536.0, "end": 32768.0},
                    "wall_time_s": 1.5,
                }
            )
        )
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "FAILED").write_text("ConfigError: scaler.hysteresis=0 is not allowed\n")
    runs = collect_runs([tmp_path])
    assert [Path(r["dir"]).name for r in runs] == ["0", "1", "2"]
    table = format_table(runs)
    assert "val/acc" in table and "0.9500" in table and "32768" in table and "FAILED" in table
    assert compare_main([str(tmp_path)]) == 1  # a failed run makes the exit status non-zero
    assert (tmp_path / "compare.png").is_file() and (tmp_path / "compare.csv").is_file()
    assert "scaler.hysteresis=0" in capsys.readouterr().out


def test_compare_reports_a_resume_in_place_that_failed_after_an_earlier_summary(tmp_path, compose_config):
    """A finished run resumed in its own directory, the resume stopped by a NaN loss: the directory keeps the
    first attempt's ``summary.json`` ("ok") beside the resume's ``FAILED``, and the comparison reads the last
    attempt's. It read the stale summary as a good run."""
    overrides = ["precision=bf16", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"]
    first = train(compose_config(*overrides, "trainer.max_steps=3", output_dir=tmp_path))
    ckpt = first["paths"]["last_checkpoint"]
    with pytest.raises(Exception, match="(?i)nan"):
        train(
            compose_config(
                *overrides, "trainer.max_steps=6", f"ckpt_path={ckpt}", "fault.nan_loss_at=[5]", output_dir=tmp_path
            )
        )
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "ok"  # the first attempt's, kept
    (run,) = collect_runs([tmp_path])
    assert run["status"] == "failed" and "nan" in run["error"].lower()
    assert compare_main([str(tmp_path)]) == 1


@pytest.mark.parametrize("damage", [bytes(range(256)) * 12, b"step\n" + b"7" * 200_000], ids=["bytes", "huge_field"])
def test_a_resume_in_place_keeps_a_damaged_metrics_csv_aside_and_goes_on(tmp_path, compose_config, capsys, damage):
    """A ``metrics.csv`` that is not CSV text (other bytes; a field beyond the csv module's limit) stopped a
    resume in place with a traceback, after the directory was taken over. The resume goes on: the damaged
    file is kept byte for byte beside (Lightning's logger deletes ``metrics.csv`` when it starts), one line
    on stderr says so, the new ``metrics.csv`` starts at the checkpoint, and ``overwrite=true`` still takes
    the directory later (no file a run does not write)."""
    from amp_plugin.app.reuse import foreign_files

    first = train(compose_config(*QUICK, output_dir=tmp_path))
    (tmp_path / "logs" / "metrics.csv").write_bytes(damage)
    second = train(
        compose_config(
            *QUICK[1:], "trainer.max_steps=5", f"ckpt_path={first['paths']['last_checkpoint']}", output_dir=tmp_path
        )
    )
    assert second["global_step"] == 5
    assert (tmp_path / "logs" / "metrics.csv.unreadable").read_bytes() == damage
    assert "metrics.csv could not be read" in capsys.readouterr().err
    assert [int(row["step"]) for row in training_rows(tmp_path / "logs" / "metrics.csv")] == [3, 4]
    assert foreign_files(tmp_path) == []


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_multirun_of_two_presets_then_compare(tmp_path):
    # fp32 x static is a contradiction: that job fails, the sweep goes on, the exit status is 1.
    sweep = tmp_path / "multi"
    proc = run_cli(
        str(ROOT / "train.py"),
        "-m",
        "precision=fp32,fp16",
        "scaler=none,static",
        *QUICK,
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.count("amp_plugin run summary") == 3
    assert "1 job(s) of this sweep failed" in proc.stderr and "Traceback" not in proc.stderr
    (failed,) = sweep.glob("*/FAILED")
    assert "is not allowed with precision='fp32'" in failed.read_text()
    assert not (failed.parent / "checkpoints").exists()
    assert len(list(sweep.glob("*/checkpoints/last.ckpt"))) == 3

    proc = run_cli("-m", "amp_plugin.app.compare", str(sweep), cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]  # one run failed
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["run", "precision", "scaler", "recipe"]
    assert any(line.startswith("precision=fp32 scaler=none ") and " fp32 " in line for line in lines)
    assert any(line.startswith("precision=fp16 scaler=static ") and " static " in line for line in lines)
    assert any(line.startswith("precision=fp32 scaler=static ") and "FAILED" in line for line in lines)
    assert (sweep / "compare.png").is_file() and (sweep / "compare.csv").is_file()


@pytest.mark.slow
def test_the_default_run(tmp_path):
    """``python train.py`` with no arguments: digits, FP16, dynamic scaling, FP32 master weights."""
    proc = run_cli(str(ROOT / "train.py"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "amp_plugin run summary" in out
    assert "FP16 weights and compute, FP32 master weights, dynamic loss scaling" in out
    for label in ("final", "loss scale   start 65536", "skipped", "outputs", "checkpoint", "plot"):
        assert label in out
    (summary_file,) = (tmp_path / "outputs").glob("*/*/summary.json")
    summary = json.loads(summary_file.read_text())
    assert (summary["precision"], summary["scaler"], summary["recipe"]) == ("fp16", "dynamic", "digits")
    assert summary["plugin_settings"]["master_weights"] is True
    assert summary["final_metrics"]["val/acc"] > 0.9
    run_dir = summary_file.parent
    for name in ("logs/metrics.csv", "logs/scale_events.csv", "checkpoints/last.ckpt", "training_curves.png"):
        assert (run_dir / name).is_file(), name


@pytest.mark.slow
def test_the_cli_runs_on_pytorch_lightning(tmp_path):
    """Configs name lightning.pytorch classes; with AMP_PLUGIN_LIGHTNING=pytorch_lightning the app builds
    pytorch_lightning's instead, and the run trains and logs."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["AMP_PLUGIN_LIGHTNING"] = "pytorch_lightning"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "trainer.max_steps=5",
            *QUICK[1:],
            "plot=false",
            "+callbacks.probe._target_=test_app.NamespaceProbe",
            f"+callbacks.probe.path={tmp_path / 'probe.json'}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe == {
        "trainer": "pytorch_lightning",
        "loggers": ["pytorch_lightning"],
        "ModelCheckpoint": "pytorch_lightning",
    }
    assert [int(row["step"]) for row in training_rows(run_dir / "logs" / "metrics.csv")] == [0, 1, 2, 3, 4]
    assert "amp_plugin run summary" in proc.stdout


class NamespaceProbe(pl.Callback):
    """Writes which package the run's trainer, loggers and ModelCheckpoint come from (``lightning`` or
    ``pytorch_lightning``); ``pl`` is the namespace of the process that imports this module."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        checkpoint = next(c for c in trainer.callbacks if type(c).__name__ == "ModelCheckpoint")
        packages = {"trainer": trainer, "loggers": trainer.loggers, "ModelCheckpoint": checkpoint}
        Path(self.path).write_text(
            json.dumps(
                {
                    key: [_package(o) for o in obj] if isinstance(obj, list) else _package(obj)
                    for key, obj in packages.items()
                }
            )
        )


def _package(obj: object) -> str:
    return type(obj).__module__.split(".")[0]


def test_a_run_that_ends_with_nan_losses_fails(tmp_path, compose_config):
    """fp16_pure with the digits recipe's eps=1e-8 (0 in FP16): NaN weights after the first update."""
    from amp_plugin.app.outcome import RunFailed

    with pytest.raises(RunFailed, match="non-finite"):
        train(compose_config("precision=fp16_pure", *QUICK, output_dir=tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "val/loss nan" in summary["failure"]
    assert "non-finite" in (tmp_path / "FAILED").read_text()


class _Scaler:
    def __init__(self, skips, scale, enabled=True):
        self.consecutive_skips, self._scale, self.min_scale, self._enabled = skips, scale, 1.0, enabled

    def is_enabled(self):
        return self._enabled

    def get_scale(self):
        return self._scale


@pytest.mark.parametrize(
    "skips, scale, steps, enabled, fails",
    [
        (10, 64.0, 100, True, True),  # ten backoffs in a row at the end: whatever the scale
        (9, 64.0, 100, True, False),
        (6, 1.0, 10, True, True),  # more than half of a short run, stuck at min_scale
        (6, 2.0, 10, True, False),
        (0, 1.0, 10, False, False),  # no scaler: nothing skipped
    ],
)
def test_a_run_ending_on_skipped_steps_fails(skips, scale, steps, enabled, fails):
    from amp_plugin.app.run import failed_training

    summary = {"steps": steps, "global_step": steps, "final_metrics": {"train/loss": 0.5, "val/loss": 0.6}}
    assert (failed_training(summary, _Scaler(skips, scale, enabled)) is not None) == fails


def test_non_finite_final_losses_fail_the_run():
    from amp_plugin.app.run import failed_training

    for final in ({"train/loss": float("nan"), "val/loss": 0.6}, {"train/loss": 0.5, "val/loss": float("inf")}):
        assert "non-finite" in failed_training({"steps": 3, "global_step": 3, "final_metrics": final}, _Scaler(0, 1.0))


def scale_changes(history_rows, after_step, start, last_step=math.inf):
    """Growths and backoffs of the loss scale over the history's rows past ``after_step`` (up to ``last_step``),
    from ``start``."""
    scales = [start] + [row["loss_scale"] for row in history_rows if after_step < row["step"] <= last_step]
    pairs = list(itertools.pairwise(scales))
    return sum(b > a for a, b in pairs), sum(b < a for a, b in pairs)


def test_a_run_resumed_in_place_counts_the_scale_changes_of_its_own_steps(tmp_path, compose_config):
    """Resumed in its own directory, a run's history goes back to step 1, but its summary's loss scale is this
    process's, as ``steps`` and ``skipped_steps`` are: from the scale it resumed at to the end. The count took
    the whole history behind the resumed scale, and so found a change at the join that never happened."""
    overrides = ["scaler.growth_interval=2", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false"]
    first = train(compose_config(*overrides, "trainer.max_steps=6", output_dir=tmp_path))
    ckpt = first["paths"]["last_checkpoint"]
    second = train(compose_config(*overrides, "trainer.max_steps=12", f"ckpt_path={ckpt}", output_dir=tmp_path))
    rows = read_history(second["paths"]["history"])
    assert [row["step"] for row in rows] == list(range(1, 13))  # the whole run's curves
    growths, backoffs = scale_changes(rows, 6, first["loss_scale"]["end"])
    assert growths > 0
    assert second["loss_scale"]["start"] == first["loss_scale"]["end"]
    assert (second["loss_scale"]["growths"], second["loss_scale"]["backoffs"]) == (growths, backoffs)
    assert second["loss_scale"]["changes"] == growths + backoffs
    assert (first["loss_scale"]["growths"], first["loss_scale"]["backoffs"]) == scale_changes(rows, 0, 2.0**16, 6)


def test_a_signal_while_the_outputs_are_written_is_noted_in_the_summary_too(tmp_path, compose_config, monkeypatch):
    """SIGTERM after the last step began lets the run finish and says so in ``summary.json``'s ``notes``
    (docs/runs.md); one that came while the curves and the plot were written was said on stderr only."""
    import signal

    import amp_plugin.app.run as run_module

    written = run_module.write_outputs

    def write_then_signal(run, summary):
        written(run, summary)
        signal.raise_signal(signal.SIGTERM)  # held by the run until its outputs are written

    monkeypatch.setattr(run_module, "write_outputs", write_then_signal)
    result = train(compose_config(*QUICK, "precision=bf16", output_dir=tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and result["late_signals"] == [signal.SIGTERM]
    assert any(note.startswith("SIGTERM received after the last step began") for note in summary["notes"])
