"""Shared benchmark harness: time Lightning training steps in-process, same conditions.

Also what the Lightning benchmarks build alike: a quiet CPU ``Trainer`` (:func:`quiet_trainer`),
Lightning's ``16-mixed`` really in FP16 on a CPU (:func:`lightning_16_mixed_cpu`), the skipped
steps of a run (:func:`skipped_steps`) and the CPU's name (:func:`cpu_model`).
"""

from __future__ import annotations

import platform
import resource
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from amp_plugin.lightning import pl


def quiet_trainer(
    steps: int, callbacks: list[pl.Callback], accelerator: str = "cpu", devices: int = 1, **kwargs: Any
) -> pl.Trainer:
    """A ``Trainer`` for ``steps`` optimizer steps with no logger, checkpoints, progress bar or model summary."""
    return pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def lightning_16_mixed_cpu() -> dict[str, Any]:
    """Trainer arguments for Lightning's ``16-mixed`` with an explicit ``torch.amp.GradScaler("cpu")``:
    given only ``precision="16-mixed"`` on a CPU, Lightning silently runs ``bf16-mixed`` instead."""
    MixedPrecision = pl.plugins.precision.MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}


def skipped_steps(trainer: pl.Trainer) -> int | None:
    """The steps the precision plugin's scaler skipped: 0 without a scaler, ``None`` for a
    ``torch.amp.GradScaler`` (Lightning's ``16-mixed``), whose skips are not public."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None:
        return 0
    if isinstance(scaler, torch.amp.GradScaler):
        return None
    return int(scaler.skipped_steps)


def cpu_model() -> str:
    """``lscpu``'s model name (else ``platform.processor()``, else ``"unknown"``)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class StepTimer(pl.Callback):
    """Wall time of each training step (forward, backward, optimizer step), data loading excluded."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._start)


def fit_steps(make_module: Callable[[], pl.LightningModule], steps: int, **trainer_kwargs: Any) -> list[float]:
    """Fit a fresh module for ``steps`` optimizer steps; return the per-step times."""
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = quiet_trainer(steps, [timer], limit_val_batches=0, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(make_module())
    return timer.times


def median_ms(times: list[float], skip: int = 3) -> float:
    """Median step time in ms, skipping warm-up steps."""
    return statistics.median(times[skip:] if len(times) > skip else times) * 1e3


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rotated(items: list, round_: int) -> list:
    """``items`` starting ``round_`` places later, wrapping around: over the rounds no item
    always runs first, or always right after the same other one."""
    k = round_ % len(items) if items else 0
    return items[k:] + items[:k]


def alternate(configs: dict[str, Callable[[], list[float]]], rounds: int) -> dict[str, list[float]]:
    """Run every config once per round, in turn (:func:`rotated`), so machine noise hits all of them alike."""
    results: dict[str, list[float]] = {name: [] for name in configs}
    for round_ in range(rounds):
        for name in rotated(list(configs), round_):
            times = configs[name]()
            results[name] += times[3:] if len(times) > 3 else times  # drop warm-up steps
    return results
