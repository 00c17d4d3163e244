"""Shared benchmark harness: time Lightning training steps in-process, same conditions."""

from __future__ import annotations

import resource
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

from amp_plugin.lightning import pl


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
    trainer = pl.Trainer(
        accelerator=trainer_kwargs.pop("accelerator", "cpu"),
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
        **trainer_kwargs,
    )
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
