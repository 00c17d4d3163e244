"""What the reliability cases share: the child processes they run, the callbacks a child builds
from ``_target_`` strings, and the comparisons of checkpoints and logs.

Children run ``train.py`` with :func:`child_env`, which puts benchmarks/reliability/ on ``PYTHONPATH``, so a case
adds a callback to a run with ``+callbacks.throttle._target_=reliability_harness.Throttle``.
"""

from __future__ import annotations

import csv
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from amp_plugin.lightning import pl

__all__ = [
    "QUIET",
    "ROOT",
    "TINY",
    "FillDisk",
    "K",
    "SlowSetup",
    "Throttle",
    "child_env",
    "differences",
    "finite",
    "load",
    "resumable_args",
    "run",
    "same_logs",
    "same_state",
    "start",
    "train_cmd",
    "train_steps",
    "training_started",
    "wait_for",
]

HERE = Path(__file__).resolve().parent  # benchmarks/reliability/
ROOT = HERE.parents[1]
K = 23  # batches per epoch of the default digits recipe: checkpoints at epoch ends resume exactly
QUIET = ["trainer.enable_progress_bar=false", "plot=false"]
TINY = ["recipe=underflow_demo", "trainer.max_steps=3", *QUIET]


# ---------------------------------------------------------------------------------- callbacks for the child
class Throttle(pl.Callback):
    """Sleep after every step from ``after_step`` on: a window in which to signal the run.

    The training process builds it from ``+callbacks.throttle._target_=reliability_harness.Throttle``.
    """

    def __init__(self, after_step: int, seconds: float) -> None:
        self.after_step, self.seconds = after_step, seconds

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step >= self.after_step:
            time.sleep(self.seconds)


class FillDisk(pl.Callback):
    """From ``at_step`` on, no file may grow past ``limit`` bytes (``RLIMIT_FSIZE``, ``SIGXFSZ``
    ignored): the next larger write fails with EFBIG, as on a full disk with ENOSPC."""

    def __init__(self, at_step: int, limit: int) -> None:
        self.at_step, self.limit = at_step, limit

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


class SlowSetup(pl.Callback):
    """Hold the run between building the Trainer and its first step (``setup``), after writing ``marker``."""

    def __init__(self, marker: str, seconds: float) -> None:
        self.marker, self.seconds = marker, seconds

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        Path(self.marker).write_text("setting up\n")
        time.sleep(self.seconds)


class HoldDirectory(pl.Callback):
    """While job 0 of a sweep sets up, another run takes ``directory`` (job 1's): it writes its
    ``.hydra/config.yaml`` and ``train.log`` there and a process holds the directory's lock (its pid in
    ``pid_file``, for the case to kill)."""

    def __init__(self, directory: str, pid_file: str) -> None:
        self.directory, self.pid_file = Path(directory), Path(pid_file)

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.pid_file.exists():
            return
        (self.directory / ".hydra").mkdir(parents=True, exist_ok=True)
        (self.directory / ".hydra" / "config.yaml").write_text("precision: mine\n")
        (self.directory / "train.log").write_text("mine\n")
        code = (
            "import sys, time; from amp_plugin.app import rundir; rundir.claim(sys.argv[1]); "
            "print('held', flush=True); time.sleep(300)"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("AMP_PLUGIN_RUN_DIR")}
        command = [sys.executable, "-c", code, str(self.directory)]
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        self.pid_file.write_text(str(proc.pid))


# ---------------------------------------------------------------------------------- processes
def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child run: benchmarks/reliability/ first on ``PYTHONPATH`` (its ``_target_`` strings name
    ``reliability_harness`` callbacks), ``HYDRA_FULL_ERROR`` unset (a message, not a traceback), and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT), env.get("PYTHONPATH")]))
    return env | extra


def train_cmd(args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args]


def run(
    args: list[str],
    cwd: Path,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        command or train_cmd(args),
        cwd=cwd,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(train_cmd(args), cwd=cwd, env=child_env(), stdout=out, stderr=subprocess.STDOUT)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended (status {proc.returncode}) or timed out before it was ready")
        time.sleep(0.05)


def training_started(log: Path) -> bool:
    return log.is_file() and "amp_plugin: precision=" in log.read_text(errors="replace")


def resumable_args(steps: int) -> list[str]:
    """A run of ``steps`` steps that checkpoints at every epoch end (every ``K`` steps), where a resume is exact."""
    return [
        f"trainer.max_steps={steps}",
        f"callbacks.model_checkpoint.every_n_train_steps={K}",
        "scaler.growth_interval=10",
        *QUIET,
    ]


# ---------------------------------------------------------------------------------- comparisons
def load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    import torch

    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{path} (keys)"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def same_state(a: Path, b: Path) -> bool:
    x, y = load(a), load(b)
    return all(
        not differences(x[key], y[key])
        for key in ("state_dict", "optimizer_states", "lr_schedulers", "amp_plugin", "global_step")
    )


def train_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "logs" / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]


def same_logs(a: Path, b: Path) -> bool:
    return all(
        (a / n).read_text() == (b / n).read_text()
        for n in ("logs/metrics.csv", "logs/scale_events.csv", "training_curves.csv")
    )


def finite(path: Path) -> bool:
    import torch

    return all(torch.isfinite(t).all() for t in load(path)["state_dict"].values() if t.is_floating_point())
