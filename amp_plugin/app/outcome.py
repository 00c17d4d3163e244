"""How a job ends when it does not finish: one message, a ``FAILED`` note, an exit status.

:func:`report_end` is :func:`amp_plugin.app.cli.run_job`'s error path:

- a bad config, an unusable environment or directory
  (:class:`~amp_plugin.app.validation.ConfigError`): ``Invalid configuration: ...``, exit 1;
- a run directory in use or holding another run (:class:`~amp_plugin.app.rundir.RunDirError`):
  ``Run directory refused: ...``, exit 1, nothing written into that directory;
- a run that stopped (a collapsed loss scale, with the step the recovery checkpoint holds and
  the command that resumes from it; non-finite weights without a scaler; a checkpoint or log
  that could not be written; a run directory deleted while the run wrote to it), or a run that
  ended without training (:class:`RunFailed`: its last steps all skipped, or a non-finite
  validation loss): ``Training stopped: ...``, exit 1;
- SIGTERM (how SLURM and Kubernetes pre-empt), SIGHUP (a closed terminal or ssh session) or SIGINT
  (Ctrl+C): the signal, the step, the checkpoint and the exact command that resumes the run in place,
  exit ``128 + signal`` (143, 129, 130), also in a sweep, which stops there. :func:`catch_sigterm`
  covers the time before training starts (checks, building the Trainer, Lightning's setup) and after
  it ends; under DDP only SIGTERM is passed on to the ranks Lightning started;
- in a sweep (``-m``), any other error of one job: ``Job failed: ...``, its traceback in
  ``FAILED``, and the sweep goes on. A job whose directory was refused is counted as failed
  (:func:`refused_jobs`) without a ``FAILED`` in a directory that is not its own; so is a job
  refused by a check in a directory that holds another run's outputs (overwrite, resume in
  place), which it has not taken over yet.

Everything else (a bug in a single run) keeps Python's traceback. The note goes to stderr and,
but for a refused directory, to ``FAILED`` in the run directory.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import threading
import traceback
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, cast

from omegaconf import DictConfig

from amp_plugin.app import rundir
from amp_plugin.app.validation import ConfigError
from amp_plugin.scaling.dynamic_scaler import LossScaleCollapseError

if TYPE_CHECKING:
    from amp_plugin.lightning.interrupt import RunInterrupted

__all__ = [
    "RunFailed",
    "Terminated",
    "catch_sigterm",
    "refused_jobs",
    "report_end",
    "restore_sigterm",
    "resume_command",
    "signal_of",
]


class RunFailed(RuntimeError):
    """The run went to its last step without training: ``summary.json`` says ``"status": "failed"``."""


class Terminated(BaseException):
    """SIGTERM arrived outside a training step (before the first one, or after the last).

    Attributes:
        signum: the signal.
    """

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"{signal.Signals(signum).name} received")


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _forward_sighup(signum: int, frame: FrameType | None) -> None:
    """SIGHUP (a closed terminal or ssh session) stops the run as SIGTERM does, under its own name: the
    SIGTERM handler in place (:class:`~amp_plugin.lightning.interrupt.GracefulInterrupt`'s while training
    runs, :func:`_raise_terminated` before and after) gets it."""
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler) and handler is not _forward_sighup:
        handler(signum, frame)
    else:
        raise Terminated(signum)


def catch_sigterm() -> object:
    """Make SIGTERM raise :class:`Terminated` (main thread only), and SIGHUP go where SIGTERM goes;
    returns the handlers to restore.

    While training runs, :class:`~amp_plugin.lightning.interrupt.GracefulInterrupt` has its own
    handler; Lightning calls this one too when it registers its own during setup."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated), signal.signal(signal.SIGHUP, _forward_sighup)


def restore_sigterm(previous: object) -> None:
    """Put back the handlers :func:`catch_sigterm` replaced."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        term, hup = cast("tuple[signal.Handlers, signal.Handlers]", previous)
        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGHUP, hup)


_refused: dict[Path, str] = {}


def refused_jobs() -> dict[Path, str]:
    """The jobs of this sweep whose run directory was refused, with the message (then forgotten)."""
    jobs = dict(_refused)
    _refused.clear()
    return jobs


# An error that stops a run and is the user's to fix: one message, no traceback.
_STOPS = (LossScaleCollapseError, FloatingPointError, RunFailed, rundir.RunDirGone)
_DISK = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def report_end(err: BaseException, cfg: DictConfig, out: Path | None, multirun: bool) -> None:
    """Say why the job ended (see the module docstring), write ``FAILED``, then exit, re-raise or return."""
    signum = signal_of(err)
    if signum is not None:
        step, checkpoint = getattr(err, "step", None), getattr(err, "checkpoint", None)
        note = _interrupted_note(signum, step, checkpoint, cfg, out)
        if out is not None and rundir.spawned_by_owner(out):
            _wait_for_launcher()  # Lightning's launcher SIGKILLs itself when a child exits non-zero first
            sys.exit(128 + signum)
        if out is not None:
            rundir.mark_failed(out, err, note)
        print(f"\n{note}", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    if isinstance(err, SystemExit) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    details = ""
    if isinstance(err, rundir.RunDirError):
        kind = "Run directory refused"
    elif isinstance(err, ConfigError):
        kind = "Invalid configuration"
    elif isinstance(err, _STOPS) or (isinstance(err, OSError) and (err.errno in _DISK or "checkpoint" in str(err))):
        kind = "Training stopped"
    elif multirun and isinstance(err, Exception):  # a sweep goes on after any error of one job
        kind, details = "Job failed", "".join(traceback.format_exception(err))
    else:
        raise err
    text = str(err)
    if isinstance(err, LossScaleCollapseError) and err.checkpoint_path and out is not None:
        text += _recovery_hint(err.checkpoint_path, cfg, out)
    message = f"{kind}: {type(err).__name__}: {' '.join(text.split())[:600]}" if details else f"{kind}: {text}"
    written = False
    if out is not None and not isinstance(err, rundir.RunDirError):  # a refused directory is not ours to mark
        note = f"{type(err).__name__}: {text}\n" + (f"\n{details}" if details else "")
        written = rundir.mark_failed(out, err, note)  # not into another run's directory (rundir.protect)
        if written and not (out / rundir.HYDRA_RECORD).exists():
            rundir.write_hydra_record(out, cfg)  # what the refused run was given, beside its FAILED
    if out is not None and multirun and not written:
        _refused[out] = message
    if multirun:
        print(f"{message}\n(This job failed; the sweep goes on.)", file=sys.stderr, flush=True)
        return
    print(
        f"{message}\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(1)


def _recovery_hint(checkpoint: str, cfg: DictConfig, out: Path) -> str:
    """Which step the recovery checkpoint holds, and the command that resumes from it."""
    try:
        import torch

        step = torch.load(checkpoint, map_location="cpu", weights_only=False).get("global_step")
    except Exception:  # the message stands without it
        return ""
    return (
        f"\nIt holds step {step}, the last healthy state; resuming from it restarts the loss scale at "
        f"scaler.init_scale. Add the change you try (say a lower recipe.lr=...) to: "
        f"{resume_command(cfg, checkpoint, out)}"
    )


def _wait_for_launcher(timeout: float = 15.0) -> None:
    """Wait (a little) for the launching process to exit before this DDP child does: Lightning's
    launcher watches its children and kills itself when one exits non-zero, which would cut its
    own ``FAILED`` note and exit status short."""
    import time

    parent, deadline = os.getppid(), time.monotonic() + timeout
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.1)


def signal_of(err: BaseException) -> int | None:
    """The signal that stopped the run: ours (RunInterrupted), Lightning's SIGTERM, or Ctrl+C."""
    if type(err).__name__ == "RunInterrupted":  # amp_plugin.lightning.interrupt (not imported before training)
        return int(cast("RunInterrupted", err).signum)
    if isinstance(err, Terminated):
        return err.signum
    if type(err).__name__ == "SIGTERMException":  # Lightning's, raised outside a training step
        return int(signal.SIGTERM)
    if isinstance(err, KeyboardInterrupt):
        return int(signal.SIGINT)
    return None


def resume_command(cfg: DictConfig, checkpoint: str, out: Path) -> str:
    """The command line that resumes this run from ``checkpoint`` in ``out`` (same overrides)."""
    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = list(HydraConfig.get().overrides.task)
    except ValueError:
        overrides = []
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("ckpt_path", "overwrite")]
    argv0 = sys.argv[0]
    entry = [sys.executable, os.path.abspath(argv0)] if argv0.endswith(".py") else ["amp-train"]
    command = [*entry, *keep, f"ckpt_path={os.path.abspath(checkpoint)}", f"hydra.run.dir={out.resolve()}"]
    return f"cd {shlex.quote(os.getcwd())} && {shlex.join(command)}"


def _interrupted_note(signum: int, step: int | None, checkpoint: str | None, cfg: DictConfig, out: Path | None) -> str:
    name = signal.Signals(signum).name
    lines = []
    if checkpoint and os.path.isfile(checkpoint) and out is not None:
        lines.append(f"Interrupted by {name} at step {step}: the run stopped after that step and saved a checkpoint.")
        lines.append(f"  checkpoint  {checkpoint}")
        lines.append(f"  resume with {resume_command(cfg, checkpoint, out)}")
    else:
        last = out / "checkpoints" / "last.ckpt" if out is not None else None
        started = step is not None or (last is not None and last.is_file())
        where = "outside a training step" if started else "before training started"
        lines.append(f"Interrupted by {name} {where}; no new checkpoint was written.")
        if out is not None and last is not None and last.is_file():  # last is None when out is
            lines.append(f"  latest checkpoint {last}")
            lines.append(f"  resume with {resume_command(cfg, str(last), out)}")
    lines.append(f"Exit status {128 + signum} (128 + {name}).")
    return "\n".join(lines) + "\n"
