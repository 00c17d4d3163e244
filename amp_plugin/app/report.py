"""What a run reports: the per-step recorder, ``summary.json``, the printed summary, ``FAILED``.

Files a run writes besides Lightning's own (all in the run's ``output_dir``)::

    training_curves.csv       loss, loss scale, skipped steps and LR per step, validation metrics
    training_curves.png       the same, plotted
    summary.json              what train() returns, minus the live objects
    FAILED                    instead of summary.json: the error that stopped the run
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from typing_extensions import override

from amp_plugin.app import plots
from amp_plugin.app.rundir import FAILED_FILE, mark_failed
from amp_plugin.app.state_bytes import COMPONENTS, per_parameter
from amp_plugin.fp8.select import describe_summary
from amp_plugin.lightning.namespace import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from amp_plugin.app.build import Run
    from amp_plugin.lightning.plugin import MixedPrecisionPlugin
    from amp_plugin.scaling import LossScaler
else:
    from amp_plugin.lightning import pl

__all__ = [
    "FAILED_FILE",
    "RunRecorder",
    "format_summary",
    "mark_failed",
    "summarize",
    "to_json",
    "write_outputs",
    "write_summary",
]


HISTORY_FILE = "training_curves.csv"
PLOT_FILE = "training_curves.png"
SUMMARY_FILE = "summary.json"


class RunRecorder(Callback):
    """Records loss, loss scale, skipped steps and LR after every training step.

    Reads the plugin's public state (``trainer.precision_plugin.scaler``), so the summary and
    the plot work with any logger and without the monitoring callbacks. Without loss scaling
    the recorded scale is NaN (nothing to plot).

    With ``history_path``, the rows so far are written there after every validation, so a run
    that is killed keeps them. The rows also travel in checkpoints (``state_dict``). A run
    resumed in its own directory (``continue_history``) starts from them, and ``kept`` (rows
    read back by :func:`amp_plugin.app.resume.keep_history`) adds what the interrupted run
    recorded up to its checkpoint; a run resumed elsewhere records its own steps only, as its
    ``metrics.csv`` does.
    """

    def __init__(self, history_path: str | Path | None = None, continue_history: bool = False) -> None:
        self.history_path = Path(history_path) if history_path is not None else None
        self.continue_history = continue_history
        self.kept: dict[int, dict[str, float]] = {}  # rows of an interrupted run resumed in place
        self.rows: dict[int, dict[str, float]] = {}
        self.start_scale = math.nan
        self.start_step = 0
        self.start_skipped = 0
        self.start_retried = 0
        self.start_passes = 0
        self.started = False  # whether training got past Lightning's setup

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After a resume the checkpoint's scale and counters are already restored here.
        self.started = True
        for step, row in self.kept.items():  # what the interrupted run recorded up to the checkpoint
            if step <= trainer.global_step:
                merged = self.rows.setdefault(step, {})
                merged.update({k: v for k, v in row.items() if k not in merged})
        scaler = cast("MixedPrecisionPlugin", trainer.precision_plugin).scaler  # the app's plugin
        self.start_scale = _scale(scaler)
        self.start_skipped = scaler.skipped_steps
        self.start_retried, self.start_passes = scaler.retried_steps, scaler.passes
        self.start_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        scaler = cast("MixedPrecisionPlugin", trainer.precision_plugin).scaler  # the app's plugin
        loss = trainer.callback_metrics.get("train/loss")
        if loss is None and isinstance(outputs, Mapping):
            loss = outputs.get("loss")
        row = self.rows.setdefault(trainer.global_step, {})
        row["train_loss"] = _as_float(loss)
        row["loss_scale"] = _scale(scaler)
        row["skipped_steps"] = float(scaler.skipped_steps)
        optimizers = trainer.optimizers
        row["lr"] = float(optimizers[0].param_groups[0]["lr"]) if optimizers else math.nan

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        row = self.rows.setdefault(trainer.global_step, {})
        for key, value in trainer.callback_metrics.items():
            if key.startswith("val/"):
                row[key] = _as_float(value)
        if self.history_path is not None and trainer.is_global_zero and self.history_path.parent.is_dir():
            plots.write_history(self.history(), self.history_path)  # a killed run keeps its curves so far

    def history(self) -> list[dict[str, float]]:
        """One dict per step (``step`` first), sorted by step."""
        return [{"step": float(step), **row} for step, row in sorted(self.rows.items())]

    # The rows travel in checkpoints: a resumed run's training_curves.csv covers the whole run.
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rows": {int(step): dict(row) for step, row in self.rows.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.continue_history:
            self.rows = {int(step): dict(row) for step, row in (state_dict.get("rows") or {}).items()}


def _as_float(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().cpu())
    return float(value)


def _scale(scaler: Any) -> float:
    """The loss scale, NaN without loss scaling (a disabled scaler reads 1.0, which is no scale)."""
    return scaler.get_scale() if scaler.is_enabled() else math.nan


def _or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def _recipe_name(module: Any) -> str:
    """``amp_plugin.recipes.DigitsRecipe`` -> ``digits``: the name of the module that defines the
    recipe's class (as in configs/recipe/)."""
    return type(module).__module__.rsplit(".", 1)[-1]


def summarize(run: Run, wall: float, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The run's summary (``summary.json``), from the plugin's settings and the scaler's public state."""
    trainer, plugin, recorder = run.trainer, run.plugin, run.recorder
    settings, scaler = plugin.settings, plugin.scaler
    history = recorder.history()
    # this process's steps, as "steps" and "skipped_steps" count them: the rows of a run resumed in
    # place go back to its first step, from scales the start of this process did not see
    scales = [recorder.start_scale] + [
        row.get("loss_scale", math.nan) for row in history if row["step"] > recorder.start_step
    ]
    scales = [s for s in scales if not math.isnan(s)]
    growths = sum(b > a for a, b in itertools.pairwise(scales))
    backoffs = sum(b < a for a, b in itertools.pairwise(scales))
    final = {
        k: _as_float(v)
        for k, v in sorted(metrics.items(), key=_metric_order)
        if isinstance(v, (int, float, torch.Tensor)) and _numel(v) == 1
    }
    steps = trainer.global_step - recorder.start_step
    output_dir = run.output_dir
    log_dir = Path(trainer.log_dir) if trainer.log_dir else output_dir
    checkpoint_dir = output_dir / "checkpoints"
    for cb in run.callbacks:
        if isinstance(cb, pl.callbacks.ModelCheckpoint) and cb.dirpath:
            checkpoint_dir = Path(cb.dirpath)
    last = checkpoint_dir / "last.ckpt"
    paths = {
        "output_dir": output_dir,
        "metrics": log_dir / "metrics.csv" if (log_dir / "metrics.csv").exists() else None,
        "log_dir": log_dir,
        "scale_events": log_dir / "scale_events.csv" if (log_dir / "scale_events.csv").exists() else None,
        "grad_health": log_dir / "grad_health.csv" if (log_dir / "grad_health.csv").exists() else None,
        "fp8_stats": log_dir / "fp8_stats.csv" if (log_dir / "fp8_stats.csv").exists() else None,
        "checkpoints": checkpoint_dir if checkpoint_dir.is_dir() else None,
        "last_checkpoint": last if last.exists() else None,
        "history": output_dir / HISTORY_FILE,
        "plot": output_dir / PLOT_FILE if run.plot else None,
        "summary": output_dir / SUMMARY_FILE,
    }
    recipe = type(run.module)
    return {
        "status": "ok",
        "recipe": _recipe_name(run.module),
        "recipe_target": f"{recipe.__module__}.{recipe.__qualname__}",
        "precision": settings.preset,
        "plugin_settings": {
            "precision": settings.precision,
            "master_weights": settings.master_weights,
            "autocast": settings.autocast,
            "emulating": plugin.emulating,
            "describe": settings.describe(plugin.emulating, sharded=plugin.sharded),
            "compute_path": plugin.compute_path,
        },
        "strategy": {
            "name": type(trainer.strategy).__name__,
            "processes": trainer.world_size,
            "sharded": plugin.sharded,
        },
        "scaler": settings.scaling,
        # precision=fp8: how many linear layers ran in FP8, and why the others stayed BF16.
        "fp8": plugin.fp8_layers.summary() if plugin.fp8_layers is not None else None,
        # bytes of training state per parameter (weights, grads, masters, optimizer state), counted
        # from the tensors the run holds (app/state_bytes.py; per rank under FSDP2)
        "state_bytes_per_param": per_parameter(run.module, trainer.optimizers),
        "seed": run.seed,
        "resumed_from": run.ckpt_path,
        "steps": steps,
        "global_step": trainer.global_step,
        "wall_time_s": round(wall, 3),
        "final_metrics": final,
        "loss_scale": {
            "start": _or_none(recorder.start_scale),
            "end": _or_none(_scale(scaler)),
            "changes": growths + backoffs,
            "growths": growths,
            "backoffs": backoffs,
        },
        "skipped_steps": scaler.skipped_steps - recorder.start_skipped,
        "skipped_steps_total": scaler.skipped_steps,
        # Batches run again at a lower scale (DynamicLossScaler(retries=N)), and the fraction of
        # this process's forward+backward passes that updated nothing (retried or skipped).
        "retried_steps": scaler.retried_steps - recorder.start_retried,
        "wasted_compute": _wasted(scaler, recorder),
        # (step, kind) of each fault written by this process (fault.* options; rank 0's view).
        "faults_injected": [[step, kind] for step, kind in run.injector.injected] if run.injector else [],
        "output_dir": str(output_dir),
        "paths": {k: (str(v) if v is not None else None) for k, v in paths.items()},
    }


def _state_line(per: Mapping[str, Any]) -> str:
    parts = ", ".join(f"{c.replace('_', ' ')} {per[c]:.2f}" for c in COMPONENTS if per.get(c))
    return f"{per['total']:.2f} bytes of training state per parameter ({parts})"


def _wasted(scaler: LossScaler, recorder: RunRecorder) -> float:
    passes = scaler.passes - recorder.start_passes
    wasted = scaler.skipped_steps - recorder.start_skipped + scaler.retried_steps - recorder.start_retried
    return round(wasted / passes, 6) if passes else 0.0


def _metric_order(item: tuple[str, Any]) -> tuple[int, str]:
    key = item[0]
    rank = 0 if key == "train/loss" else 1 if key.startswith("train/") else 2 if key == "val/loss" else 3
    return rank, key


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 1


def write_outputs(run: Run, summary: dict[str, Any]) -> None:
    run.output_dir.mkdir(parents=True, exist_ok=True)
    history = run.recorder.history()
    plots.write_history(history, run.output_dir / HISTORY_FILE)
    if run.plot:
        title = f"{summary['recipe']} | precision={summary['precision']} | scaler={summary['scaler']}"
        plots.plot_run(history, run.output_dir / PLOT_FILE, title=title)
    write_summary(run, summary)


def write_summary(run: Run, summary: dict[str, Any]) -> None:
    """``summary.json`` (the last of the outputs :func:`write_outputs` writes)."""
    (run.output_dir / SUMMARY_FILE).write_text(to_json(summary) + "\n")


def to_json(summary: Mapping[str, Any]) -> str:
    """``summary`` as strict JSON: a NaN or infinite number becomes ``null``, and ``notes`` says which."""
    notes: list[str] = list(summary.get("notes") or [])

    def clean(value: Any, where: str) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            notes.append(f"{where} was {value} (written as null)")
            return None
        if isinstance(value, Mapping):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    cleaned = clean(dict(summary), "")
    if notes:
        cleaned["notes"] = notes
    return json.dumps(cleaned, indent=2, allow_nan=False)


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 1e4 or (0 < abs(value) < 1e-3):
        return f"{value:.4g}"
    return f"{value:.4f}".rstrip("0").rstrip(".") if abs(value) < 10 else f"{value:.4g}"


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-run summary printed by ``train.py``."""
    ls = summary["loss_scale"]
    if ls["start"] is None:
        scale = "none (no loss scaling)"
    else:
        kinds = []
        if ls["growths"]:
            kinds.append(f"{ls['growths']} growth" + ("s" if ls["growths"] != 1 else ""))
        if ls["backoffs"]:
            kinds.append(f"{ls['backoffs']} backoff" + ("s" if ls["backoffs"] != 1 else ""))
        scale = (
            f"start {ls['start']:g}, end {ls['end']:g}, {ls['changes']} change"
            + ("s" if ls["changes"] != 1 else "")
            + (f" ({', '.join(kinds)})" if kinds else "")
        )
    metrics = "  ".join(
        f"{k} {_fmt(v)}" for k, v in summary["final_metrics"].items() if k.startswith(("train/loss", "val/"))
    )
    steps, wall = summary["steps"], summary["wall_time_s"]
    resumed = f" (resumed at step {summary['global_step'] - steps})" if summary["resumed_from"] else ""
    out = Path(summary["output_dir"])
    paths = summary["paths"]

    def rel(key: str) -> str | None:
        value = paths.get(key)
        if value is None:
            return None
        path = Path(value)
        try:
            return str(path.relative_to(out)) + ("/" if path.is_dir() else "")
        except ValueError:
            return str(path)

    lines = [
        "",
        "amp_plugin run summary",
        f"  recipe       {summary['recipe']}",
        f"  precision    {summary['precision']}: {summary['plugin_settings']['describe']}",
        f"  compute      {summary['plugin_settings']['compute_path']}",
        *(
            [f"  state        {_state_line(summary['state_bytes_per_param'])}"]
            if summary.get("state_bytes_per_param")
            else []
        ),
        *([f"  fp8 layers   {describe_summary(summary['fp8'])}"] if summary.get("fp8") else []),
        *(
            [f"  strategy     {summary['strategy']['name']}, {summary['strategy']['processes']} processes"]
            if summary["strategy"]["processes"] > 1
            else []
        ),
        f"  steps        {steps}{resumed} in {wall:.1f} s ({steps / wall if wall > 0 else 0:.1f} steps/s)",
        f"  final        {metrics or '-'}",
        f"  loss scale   {scale}",
        f"  skipped      {summary['skipped_steps']} of {steps} steps",
        *(
            [f"  retried      {summary['retried_steps']} batches run again at a lower scale"]
            if summary.get("retried_steps")
            else []
        ),
        *(
            [f"  wasted       {summary['wasted_compute']:.1%} of forward+backward passes updated nothing"]
            if summary.get("wasted_compute")
            else []
        ),
    ]
    faults = summary.get("faults_injected") or []
    if faults:
        shown = ", ".join(f"{kind} at {step}" for step, kind in faults[:4]) + (", ..." if len(faults) > 4 else "")
        lines.append(f"  faults       {len(faults)} injected: {shown}")
    lines.append(f"  outputs      {out}")
    for label, key in (
        ("metrics", "metrics"),
        ("scale log", "scale_events"),
        ("gradients", "grad_health"),
        ("fp8 stats", "fp8_stats"),
        ("checkpoint", "last_checkpoint"),
        ("plot", "plot"),
        ("summary", "summary"),
    ):
        path_shown = rel(key)
        if path_shown is not None:
            lines.append(f"    {label:<11}{path_shown}")
    if paths.get("metrics") is None and paths.get("log_dir"):
        lines.append(f"    {'logs':<11}{rel('log_dir')}")
    return "\n".join(lines)
