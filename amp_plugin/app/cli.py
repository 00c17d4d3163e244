"""Command-line entry points: ``train.py`` and the ``amp-train`` console script.

Both compose the same configs (``configs/train.yaml`` and its groups) and call
:func:`run_job`, which turns a bad config (:class:`~amp_plugin.app.validation.ConfigError`), a
refused run directory, or a run that stopped (a collapsed loss scale, non-finite weights, a
checkpoint that could not be written) into one short message on stderr and exit status 1, with
no traceback, and a ``FAILED`` note in the run directory. ``HYDRA_FULL_ERROR=1`` shows the full
traceback instead.

A run stopped by SIGTERM (how SLURM and Kubernetes pre-empt) or SIGINT (Ctrl+C) saves a
checkpoint at the step it was in, writes ``FAILED`` naming the signal, the step and the exact
command that resumes it, and exits with ``128 + signal``: 143 for SIGTERM, 130 for SIGINT
(:mod:`amp_plugin.lightning.interrupt`). A sweep stops there too. A value that the schemas reject while
Hydra composes the config (a wrong type, an unknown key, a value outside a choice) never reaches
:func:`run_job`: Hydra prints its message (the key, the value, the allowed values) and exits
with status 1.

Where ``amp-train`` finds the configs, first match wins:

1. ``$AMP_PLUGIN_CONFIG_DIR`` (when set, it must hold ``train.yaml``);
2. ``configs/`` of the source checkout the package was imported from (``pip install -e .``);
3. ``amp_plugin/app/configs`` inside an installed wheel (packaged from the same ``configs/``).

Hydra's ``--config-dir DIR`` adds a directory of your own presets on top of these.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from amp_plugin.app import rundir
from amp_plugin.app.build import prepare
from amp_plugin.app.schema import register_configs
from amp_plugin.app.validation import ConfigError
from amp_plugin.dynamic_scaler import LossScaleCollapseError

__all__ = ["RunDirGuard", "SweepFailures", "config_dir", "main", "run_job"]

CONFIG_NAME = "train"


def config_dir() -> str:
    """The directory holding ``train.yaml`` (see the module docstring for the search order).

    Raises:
        ConfigError: ``AMP_PLUGIN_CONFIG_DIR`` is set but holds no ``train.yaml``, or no configs anywhere.
    """
    package = Path(__file__).resolve().parent
    chosen = os.environ.get("AMP_PLUGIN_CONFIG_DIR")
    if chosen:
        if (Path(chosen) / f"{CONFIG_NAME}.yaml").is_file():
            return str(Path(chosen).resolve())
        where = "is not a directory" if not Path(chosen).is_dir() else f"holds no {CONFIG_NAME}.yaml"
        raise ConfigError(f"AMP_PLUGIN_CONFIG_DIR={chosen} {where}. Point it at a directory holding {CONFIG_NAME}.yaml "
                          "(a copy of the package's configs/), or unset it to use the package's own configs.")
    candidates = [package.parents[1] / "configs", package / "configs"]
    for candidate in candidates:
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return str(candidate.resolve())
    raise ConfigError("no configs found (looked in " + ", ".join(str(c) for c in candidates) + "). Set "
                      "AMP_PLUGIN_CONFIG_DIR to a directory holding train.yaml.")


def _hydra_runtime() -> tuple[Path | None, bool]:
    """The job's output directory and whether it is one job of a multirun (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not running under @hydra.main
        return None, False
    return Path(hydra_cfg.runtime.output_dir), hydra_cfg.mode == RunMode.MULTIRUN


def check_environment() -> None:
    """A rank variable left in the environment of a single process would make Lightning treat it as a
    rank other than 0, which logs nothing (no ``metrics.csv``). Refuse it."""
    world = os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or "1"
    for key in ("LOCAL_RANK", "RANK"):
        value = os.environ.get(key)
        if value not in (None, "", "0") and world.strip() in ("", "1"):
            raise ConfigError(
                f"{key}={value} is set in the environment, but this is a single process (WORLD_SIZE is not set): "
                f"Lightning would run it as rank {value} and write no metrics.csv. Unset {key} (a leftover of a "
                "distributed launcher?), or start the processes with torchrun, SLURM or trainer.devices=N."
            )


# An error that stops a run and is the user's to fix: one message, no traceback.
_STOPS = (LossScaleCollapseError, FloatingPointError)
_DISK = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """The body of a Hydra job: check and train, and report bad input without a traceback.

    A single run exits with status 1 on a bad config, a refused run directory or a run that
    stopped (see the module docstring), and with 128 + signal when SIGTERM or SIGINT stopped it.
    In a multirun a failed job leaves its message in ``FAILED`` and the sweep goes on (any error,
    not only the ones above); the process exits with status 1 at the end
    (:class:`SweepFailures`). A signal stops the sweep.
    """
    out, multirun = _hydra_runtime()
    try:
        check_environment()
        if out is not None:
            rundir.claim(out)
            rundir.check_reuse(out, cfg.ckpt_path, bool(cfg.get("overwrite", False)))
        settings = prepare(cfg)  # every check and the scaler, before importing Lightning: a typo fails fast
        from amp_plugin.app.run import train

        result = train(cfg, settings)
        return {k: v for k, v in result.items() if k not in ("trainer", "module", "plugin")}
    except BaseException as err:  # noqa: BLE001 - each kind is reported or re-raised below
        return _report(err, cfg, out, multirun)
    finally:
        if out is not None:
            rundir.release(out)


def _report(err: BaseException, cfg: DictConfig, out: Path | None, multirun: bool) -> None:
    """Say why the job ended (see :func:`run_job`), write ``FAILED``, exit or return."""
    signum = _signal_of(err)
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
    if details:
        message = f"{kind}: {type(err).__name__}: {' '.join(text.split())[:600]}"
    else:
        message = f"{kind}: {text}"
    if out is not None and not isinstance(err, rundir.RunDirError):  # a refused directory is not ours to mark
        rundir.mark_failed(out, err, f"{type(err).__name__}: {text}\n" + (f"\n{details}" if details else ""))
    if multirun:
        print(f"{message}\n(This job failed; the sweep goes on.)", file=sys.stderr, flush=True)
        return
    print(f"{message}\n\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.",
          file=sys.stderr, flush=True)
    sys.exit(1)


def _recovery_hint(checkpoint: str, cfg: DictConfig, out: Path) -> str:
    """Which step the recovery checkpoint holds, and the command that resumes from it."""
    try:
        import torch

        step = torch.load(checkpoint, map_location="cpu", weights_only=False).get("global_step")
    except Exception:  # the message stands without it
        return ""
    return (f"\nIt holds step {step}, the last healthy state; resuming from it restarts the loss scale at "
            f"scaler.init_scale. Add the change you try (say a lower recipe.lr=...) to: "
            f"{resume_command(cfg, checkpoint, out)}")


def _wait_for_launcher(timeout: float = 15.0) -> None:
    """Wait (a little) for the launching process to exit before this DDP child does: Lightning's
    launcher watches its children and kills itself when one exits non-zero, which would cut its
    own ``FAILED`` note and exit status short."""
    import time

    parent, deadline = os.getppid(), time.monotonic() + timeout
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.1)


def _signal_of(err: BaseException) -> int | None:
    """The signal that stopped the run: ours (RunInterrupted), Lightning's SIGTERM, or Ctrl+C."""
    if type(err).__name__ == "RunInterrupted":  # amp_plugin.lightning.interrupt (not imported before training)
        return int(err.signum)
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


def _interrupted_note(signum: int, step: int | None, checkpoint: str | None, cfg: DictConfig,
                      out: Path | None) -> str:
    name = signal.Signals(signum).name
    lines = []
    if checkpoint and os.path.isfile(checkpoint) and out is not None:
        lines.append(f"Interrupted by {name} at step {step}: the run stopped after that step and saved a checkpoint.")
        lines.append(f"  checkpoint  {checkpoint}")
        lines.append(f"  resume with {resume_command(cfg, checkpoint, out)}")
    else:
        last = out / "checkpoints" / "last.ckpt" if out is not None else None
        where = "before training started" if step is None and not (last and last.is_file()) else "outside a training step"
        lines.append(f"Interrupted by {name} {where}; no new checkpoint was written.")
        if last is not None and last.is_file():
            lines.append(f"  latest checkpoint {last}")
            lines.append(f"  resume with {resume_command(cfg, str(last), out)}")
    lines.append(f"Exit status {128 + signum} (128 + {name}).")
    return "\n".join(lines) + "\n"


class RunDirGuard(Callback):
    """Hydra callback: lock the run (or sweep) directory and refuse a finished run's, before Hydra
    writes ``.hydra/`` into it (:mod:`amp_plugin.app.rundir`)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            directory = str(config.hydra.run.dir)
        except Exception:  # an interpolation only a running job can resolve: run_job checks it
            return
        self._guard(directory, config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            directory = Path(str(config.hydra.sweep.dir))
        except Exception:
            return
        try:
            rundir.claim(directory, "hydra.sweep.dir")
        except rundir.RunDirError as err:
            self._refuse(str(err))
        taken = [job for job in sorted(directory.iterdir()) if job.is_dir() and rundir.outputs_in(job)] \
            if directory.is_dir() else []
        if taken and not config.get("overwrite", False):
            self._refuse(
                f"hydra.sweep.dir={directory} already holds a sweep ({len(taken)} job directories with outputs, "
                f"e.g. {taken[0].name}/); this sweep would overwrite or mix with it. Drop hydra.sweep.dir= for a "
                "fresh directory, or add overwrite=true to replace it."
            )
        for job in taken:
            rundir.clear_outputs(job)

    def _guard(self, directory: str, config: DictConfig, key: str) -> None:
        try:
            rundir.claim(directory, key)
            rundir.check_reuse(directory, config.get("ckpt_path"), bool(config.get("overwrite", False)), key)
        except rundir.RunDirError as err:
            self._refuse(str(err))

    @staticmethod
    def _refuse(message: str) -> None:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise rundir.RunDirError(message)
        print(f"Run directory refused: {message}", file=sys.stderr, flush=True)
        sys.exit(1)

class SweepFailures(Callback):
    """Hydra callback: after a multirun, list the jobs that failed and exit with status 1."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        failed = sorted(p.parent for p in sweep_dir.glob("*/FAILED"))
        if not failed:
            return
        lines = [f"{len(failed)} job(s) of this sweep failed:"]
        for job in failed:
            first = (job / "FAILED").read_text().strip().splitlines()[0]
            lines.append(f"  {job}: {first[:160]}")
        lines.append(f"Compare the runs with: amp-compare {sweep_dir}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    """The ``amp-train`` console script: the same CLI as ``python train.py``."""
    import hydra

    register_configs()
    try:
        configs = config_dir()
    except ConfigError as err:
        print(f"Invalid configuration: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    hydra.main(config_path=configs, config_name=CONFIG_NAME, version_base="1.3")(run_job)()


if __name__ == "__main__":
    main()
