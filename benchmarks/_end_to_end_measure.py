"""How ``bench_end_to_end.py`` measures a configuration: per-step wall and CPU time
(:func:`time_config`), memory in this process (:func:`measure_memory`) or in a fresh one
(:func:`measure_memory_subprocess`, which runs the script with ``--memory-child``), and where the
time goes per op (:func:`profile_config`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _end_to_end_configs import Config
from _harness import StepTimer, quiet_trainer, skipped_steps
from _memory import MemoryProbe

from amp_plugin.lightning import pl

__all__ = ["CpuStepTimer", "measure_memory", "measure_memory_subprocess", "profile_config", "time_config"]

SCRIPT = Path(__file__).resolve().with_name("bench_end_to_end.py")


class CpuStepTimer(StepTimer):
    """Wall time (``times``) and process CPU time (``cpu_times``) of each training step."""

    def __init__(self) -> None:
        super().__init__()
        self.cpu_times: list[float] = []
        self._cpu_start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cpu_start = time.process_time()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.cpu_times.append(time.process_time() - self._cpu_start)


def _trainer(steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    return quiet_trainer(steps, callbacks, limit_val_batches=0, **kwargs)


def time_config(
    make_module: Callable[[], pl.LightningModule], config: Config, steps: int, warmup: int
) -> tuple[list[float], list[float], int]:
    """Fit a fresh module for ``steps`` steps; per-step (wall, cpu) seconds after warmup, skipped steps."""
    pl.seed_everything(0, verbose=False)
    timer = CpuStepTimer()
    trainer = _trainer(steps, [timer], **config.trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(make_module())
    skipped = skipped_steps(trainer)  # -1: Lightning's 16-mixed, whose skipped steps are not public
    return timer.times[warmup:], timer.cpu_times[warmup:], -1 if skipped is None else skipped


def measure_memory(make_module: Callable[[], pl.LightningModule], config: Config, steps: int = 4) -> dict[str, Any]:
    """Train ``steps`` steps; RSS on the next-to-last, tensors on the last (the first ones allocate state)."""
    pl.seed_everything(0, verbose=False)
    probe = MemoryProbe(rss_step=steps - 2, tensor_step=steps - 1)
    module = make_module()
    trainer = _trainer(steps, [probe], **config.trainer_kwargs())
    with warnings.catch_warnings(), open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return probe.result


class _Profile(pl.Callback):
    """Profile the training steps after ``warmup`` (CPU, self time per op)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.profiler: Any = None
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.profiler is not None:
            self.steps += 1

    def on_train_end(self, trainer, pl_module) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)


def profile_config(
    make_module: Callable[[], pl.LightningModule], config: Config, steps: int, warmup: int, top: int = 14
) -> str:
    """Top ops by self CPU time per step (all threads), as a Markdown table."""
    pl.seed_everything(0, verbose=False)
    prof = _Profile(warmup)
    trainer = _trainer(warmup + steps, [prof], **config.trainer_kwargs())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(make_module())
    averages = sorted(prof.profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in averages)
    lines = [
        f"### {config.name}: {total / 1e3 / prof.steps:.1f} ms self CPU per step (profiled)\n",
        "| op | self CPU ms/step | share | calls/step |",
        "|---|---:|---:|---:|",
    ]
    for e in averages[:top]:
        lines.append(
            f"| {e.key} | {e.self_cpu_time_total / 1e3 / prof.steps:.2f} "
            f"| {e.self_cpu_time_total / total:.1%} | {e.count / prof.steps:.0f} |"
        )
    return "\n".join(lines)


def measure_memory_subprocess(recipe: str, config: Config, threads: int, n_embd: int | None) -> dict[str, Any]:
    cmd = [sys.executable, str(SCRIPT), "--memory-child", recipe, config.name, "--threads", str(threads)]
    if n_embd is not None:
        cmd += ["--n-embd", str(n_embd)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"memory run failed for {recipe} / {config.name}:\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])
