"""Command-line entry points: ``train.py`` and the ``amp-train`` console script.

Both compose the same configs (``configs/train.yaml`` and its groups) and call
:func:`run_job`, which turns a bad config (:class:`~amp_plugin.app.validation.ConfigError`), a
refused run directory, or a run that stopped (a collapsed loss scale, non-finite weights, a
checkpoint that could not be written) into one short message on stderr and exit status 1, with
no traceback, and a ``FAILED`` note in the run directory; SIGTERM and SIGINT end it with 143 and
130 and a note that says how to resume (:mod:`amp_plugin.app.outcome`). ``HYDRA_FULL_ERROR=1``
shows the full traceback instead. A value that the schemas reject while
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

import atexit
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from amp_plugin.app import reuse, rundir
from amp_plugin.app.build import prepare
from amp_plugin.app.outcome import catch_sigterm, refused_jobs, report_end, restore_sigterm
from amp_plugin.app.schema import register_configs
from amp_plugin.app.validation import ConfigError, show

__all__ = [
    "LIGHTNING_LOGGERS",
    "RunDirGuard",
    "SweepFailures",
    "config_dir",
    "detach_job_log",
    "main",
    "route_lightning_logs",
    "run_job",
]

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
        raise ConfigError(
            f"AMP_PLUGIN_CONFIG_DIR={chosen} {where}. Point it at a directory holding {CONFIG_NAME}.yaml "
            "(a copy of the package's configs/), or unset it to use the package's own configs."
        )
    candidates = [package.parents[1] / "configs", package / "configs"]
    for candidate in candidates:
        if (candidate / f"{CONFIG_NAME}.yaml").is_file():
            return str(candidate.resolve())
    raise ConfigError(
        "no configs found (looked in " + ", ".join(str(c) for c in candidates) + "). Set "
        "AMP_PLUGIN_CONFIG_DIR to a directory holding train.yaml."
    )


def _hydra_runtime() -> tuple[Path | None, bool]:
    """The job's output directory and whether it is one job of a multirun (``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hydra_cfg = HydraConfig.get()
    except ValueError:  # not running under @hydra.main
        return None, False
    return Path(hydra_cfg.runtime.output_dir), hydra_cfg.mode == RunMode.MULTIRUN


def check_sweep_job(cfg: DictConfig) -> None:
    """A job of a local sweep (Hydra's basic launcher runs the jobs one after another in this process) must be
    one process: Lightning starts a job's other ranks with this process's command line, ``-m`` included, so
    each of them started the sweep again (refused by the sweep's lock, and Lightning then killed the sweep:
    exit status 137). A launcher that runs each job elsewhere (submitit on SLURM) starts its ranks itself."""
    from hydra.core.hydra_config import HydraConfig

    from amp_plugin.app.validation import CLUSTER_ENV, process_count

    launcher = str(HydraConfig.get().launcher.get("_target_", ""))
    processes = (process_count(cfg.trainer) or 1) * cfg.trainer.num_nodes
    if launcher.endswith(".BasicLauncher") and processes > 1 and not any(os.environ.get(k) for k in CLUSTER_ENV):
        raise ConfigError(
            f"trainer.devices={show(cfg.trainer.devices)} is not allowed in a sweep (-m) run by Hydra's local "
            f"launcher: the job would run {processes} processes, and Lightning starts the others with this command "
            "line, -m included, so each would start the sweep again. Run the multi-process jobs one by one "
            "(without -m), or sweep with a launcher that starts each job itself (hydra/launcher=submitit_slurm)."
        )


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


def detach_job_log(directory: Path) -> None:
    """Close the log handlers Hydra opened for this job inside ``directory`` (its ``train.log``)."""
    root = os.path.realpath(directory)
    for logger in (logging.getLogger(), *(logging.getLogger(n) for n in logging.root.manager.loggerDict)):
        for handler in list(getattr(logger, "handlers", [])):
            name = getattr(handler, "baseFilename", None)
            if isinstance(handler, logging.FileHandler) and name and os.path.realpath(name).startswith(root + os.sep):
                logger.removeHandler(handler)
                handler.close()


LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")


def route_lightning_logs() -> None:
    """Lightning's log lines once, through Hydra's handlers (its console format and the job's
    ``train.log``): Lightning gives its loggers console handlers of their own, which under Hydra
    printed every INFO line a second time."""
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """The body of a Hydra job: check and train, and report bad input without a traceback.

    A single run exits with status 1 on a bad config, a refused run directory or a run that
    stopped (see the module docstring), and with 128 + signal when SIGTERM or SIGINT stopped it.
    In a multirun a failed job leaves its message in ``FAILED`` and the sweep goes on (any error,
    not only the ones above); the process exits with status 1 at the end
    (:class:`SweepFailures`). A signal stops the sweep.
    """
    out, multirun = _hydra_runtime()
    previous = catch_sigterm()
    try:
        check_environment()
        if multirun:
            check_sweep_job(cfg)
        clear = False
        if out is not None:
            try:
                rundir.claim(out)
                clear = reuse.check_reuse(out, cfg.ckpt_path, bool(cfg.get("overwrite", False)))
            except ConfigError:
                detach_job_log(out)  # the directory is not this job's: Hydra's log file there gets no line
                raise
            if reuse.outputs_in(out):
                rundir.protect(out)  # another run's outputs until every check passed (train() adopts it)
        settings = prepare(cfg)  # every check and the scaler, before importing Lightning: a typo fails fast
        from amp_plugin.app.run import train

        route_lightning_logs()
        result = train(cfg, settings, clear_outputs=clear)
        return {k: v for k, v in result.items() if k not in ("trainer", "module", "plugin", "late_signals")}
    except BaseException as err:
        report_end(err, cfg, out, multirun)
        return None
    finally:
        restore_sigterm(previous)
        if out is not None:
            rundir.release(out)


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
            name = str(config.hydra.sweep.dir)
        except Exception:
            return
        try:
            check_environment()
            rundir.check_empty(name, "hydra.sweep.dir")
            directory = Path(name)
            rundir.claim(directory, "hydra.sweep.dir")
            atexit.register(rundir.release, directory)  # the sweep's end (SweepFailures may exit 1 first)
            self._check_sweep(directory, bool(config.get("overwrite", False)))
        except ConfigError as err:
            self._refuse(err, name)
        # Each job overwrites only its own directory, once it has passed every check (run_job).

    @staticmethod
    def _taken(directory: Path) -> list[Path]:
        if not directory.is_dir():
            return []
        return [job for job in sorted(directory.iterdir()) if job.is_dir() and reuse.outputs_in(job)]

    def _check_sweep(self, directory: Path, overwrite: bool) -> None:
        """Before the first job: no job directory may be a live run's, and a sweep that does not
        overwrite may not mix with an earlier one."""
        if directory.is_dir():
            for lock in sorted(directory.rglob(rundir.LOCK_FILE)):
                live = rundir.holder(lock.parent)
                if live is not None and lock.parent != directory:
                    raise rundir.RunDirError(
                        f"hydra.sweep.dir={directory} holds {lock.parent}, the directory of a run that is still "
                        f"writing to it ({live}); this sweep would write its jobs' files there. Wait for that run to "
                        "end, or drop hydra.sweep.dir= for a fresh directory."
                    )
        taken = self._taken(directory)
        if taken and not overwrite:
            raise rundir.RunDirError(
                f"hydra.sweep.dir={directory} already holds a sweep ({len(taken)} job directories with outputs, "
                f"e.g. {taken[0].name}/); this sweep would overwrite or mix with it. Drop hydra.sweep.dir= for a "
                "fresh directory, or add overwrite=true to replace its jobs' outputs (each job replaces only its "
                "own directory's)."
            )

    def _guard(self, directory: str, config: DictConfig, key: str) -> None:
        try:
            check_environment()
            rundir.check_empty(directory, key)
            rundir.claim(directory, key)
            reuse.check_reuse(directory, config.get("ckpt_path"), bool(config.get("overwrite", False)), key)
        except ConfigError as err:
            self._refuse(err, directory)

    @staticmethod
    def _refuse(err: ConfigError, directory: str) -> None:
        """Say why, drop the lock this process took (a refused run leaves the directory as it was), exit 1."""
        rundir.release(directory)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise err
        kind = "Run directory refused" if isinstance(err, rundir.RunDirError) else "Invalid configuration"
        print(f"{kind}: {err}", file=sys.stderr, flush=True)
        sys.exit(1)


class SweepFailures(Callback):
    """Hydra callback: after a multirun, list the jobs of this sweep that failed and exit with status 1.

    Only this sweep's jobs count: the ``FAILED`` of a directory beside them that this sweep did not
    run (an earlier sweep's job) is not this sweep's failure."""

    def __init__(self) -> None:
        self.jobs: list[Path] = []
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs, self.started = [], time.time()

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.jobs.append(Path(config.hydra.runtime.output_dir))

    def _failed(self, sweep_dir: Path) -> dict[Path, str]:
        if self.jobs:  # an in-process launcher: the jobs it ran
            notes = [job / rundir.FAILED_FILE for job in self.jobs]
        else:  # a launcher that runs the jobs elsewhere: the notes written since the sweep started
            notes = [p for p in sweep_dir.glob(f"*/{rundir.FAILED_FILE}") if p.stat().st_mtime >= self.started - 1]
        failed = {}
        for note in notes:
            try:
                failed[note.parent] = (note.read_text().strip().splitlines() or [""])[0]
            except OSError:
                continue
        return failed

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        failed = self._failed(sweep_dir)
        failed.update(refused_jobs())  # refused directories get no FAILED: they are not the job's
        if not failed:
            return
        lines = [f"{len(failed)} job(s) of this sweep failed:"]
        for job, first in sorted(failed.items()):
            lines.append(f"  {job}: {first[:160]}")
        lines.append(f"Compare the runs with: amp-compare {sweep_dir}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    """The ``amp-train`` console script: the same CLI as ``python train.py``."""
    import hydra

    from amp_plugin.app.overrides import check_overrides

    register_configs()
    check_overrides()
    try:
        configs = config_dir()
    except ConfigError as err:
        print(f"Invalid configuration: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    hydra.main(config_path=configs, config_name=CONFIG_NAME, version_base="1.3")(run_job)()


if __name__ == "__main__":
    main()
