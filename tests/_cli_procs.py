"""Start ``train.py`` as a user or a scheduler would: separate processes, signals, a shared directory.

The callbacks here reach a training process through the CLI's own extension point
(``+callbacks.NAME._target_=_cli_procs.Throttle``): this directory is on the child's PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from amp_plugin.lightning import pl

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
CLI_TESTS = TESTS / "app"  # the CLI test modules, whose callbacks a child names with _target_
QUIET = ["trainer.enable_progress_bar=false", "plot=false"]


class Throttle(pl.Callback):
    """Sleep after every step from ``after_step`` on: a window in which to signal the run."""

    def __init__(self, after_step: int, seconds: float) -> None:
        self.after_step = after_step
        self.seconds = seconds

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.after_step:
            time.sleep(self.seconds)


class Boom(pl.Callback):
    """Raise an unexpected error (a bug, not bad input) when training reaches ``at_step``."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            raise RuntimeError(f"boom at step {self.at_step}")


def throttle(after_step: int, seconds: float) -> list[str]:
    return [
        "+callbacks.throttle._target_=_cli_procs.Throttle",
        f"+callbacks.throttle.after_step={after_step}",
        f"+callbacks.throttle.seconds={seconds}",
    ]


def env(**extra: str) -> dict[str, str]:
    """The environment without HYDRA_FULL_ERROR, with this directory and the CLI tests' on PYTHONPATH."""
    out = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(CLI_TESTS), out.get("PYTHONPATH")]))
    return out | extra


def start(
    args: list[str],
    cwd: Path,
    log: Path,
    *,
    extra_env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    entry: list[str] | None = None,
) -> subprocess.Popen:
    """``python train.py ARGS`` in ``cwd``, stdout and stderr to ``log``."""
    command = entry or [sys.executable, str(ROOT / "train.py")]
    with open(log, "w") as out:  # the child keeps its own handle
        return subprocess.Popen(
            [*command, *args],
            cwd=cwd,
            env=env(**(extra_env or {})),
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )


def run(args: list[str], cwd: Path, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
    """``python train.py ARGS`` to completion; stdout and stderr captured."""
    entry = kwargs.pop("entry", None) or [sys.executable, str(ROOT / "train.py")]
    extra_env = kwargs.pop("extra_env", None) or {}
    return subprocess.run(
        [*entry, *args], cwd=cwd, env=env(**extra_env), capture_output=True, text=True, timeout=timeout, **kwargs
    )


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen | None = None, timeout: float = 240) -> None:
    """Poll ``condition`` until it holds; fail if ``proc`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (status {proc.returncode}) before the condition held")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def logged_steps(log: Path) -> bool:
    """Whether the run logging to ``log`` has started training (its plugin described itself)."""
    return log.is_file() and "amp_plugin: precision=" in log.read_text(errors="replace")
