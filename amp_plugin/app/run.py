"""``train(cfg)``: build a run from a composed config, fit it, and report what happened.

The config flows one way: :func:`~amp_plugin.app.build.prepare` (checks, scaler, precision
settings; no Lightning) -> :func:`~amp_plugin.app.build.build` (recipe, plugin, callbacks,
loggers, trainer) -> ``trainer.fit`` -> :mod:`~amp_plugin.app.report`. Everything that can
reject the config runs before ``trainer.fit``, so a mistake ends the run before a checkpoint
or a metric is written. Such a mistake is a :class:`~amp_plugin.app.validation.ConfigError`;
the run directory then holds a ``FAILED`` file with the message, never a ``summary.json``.

Files of a run (``cfg.output_dir``, the Hydra run directory; see also
:mod:`amp_plugin.app.report`)::

    logs/metrics.csv          per-step metrics (CSV logger; TensorBoard event files with logger=tensorboard)
    logs/scale_events.csv     every loss-scale change (LossScaleMonitor)
    checkpoints/last.ckpt     resume with ckpt_path=... (written atomically: AtomicCheckpointIO)
    checkpoints/last-good.ckpt  the last healthy state, to resume from after a loss-scale collapse
    training_curves.csv       loss, loss scale, skipped steps and LR per step, validation metrics
    training_curves.png       the same, plotted
    summary.json              what train() returns, minus the live objects ("status": "failed" when the
                              run reached its last step without training: see failed_training)
    FAILED                    the error that stopped the run (instead of summary.json), or why it failed
    .amp_run                  the run's id, which its checkpoints carry (resuming in place checks it)
"""

from __future__ import annotations

import math
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig

from amp_plugin.app import rundir
from amp_plugin.app.build import Run, build, resolve_output_dir
from amp_plugin.app.config_nodes import entries, naming_key, plain
from amp_plugin.app.outcome import RunFailed
from amp_plugin.app.report import FAILED_FILE, format_summary, mark_failed, summarize, write_outputs, write_summary
from amp_plugin.app.resume import keep_history
from amp_plugin.app.validation import ConfigError, forget_checkpoints
from amp_plugin.fused import build_seconds
from amp_plugin.lightning import pl
from amp_plugin.settings import PrecisionSettings

__all__ = ["train"]


def train(cfg: DictConfig, settings: PrecisionSettings | None = None, *, clear_outputs: bool = False) -> dict[str, Any]:
    """Build the run, train, write the plot and ``summary.json``, print the summary.

    Nothing is written into the run directory (``FAILED``, Hydra's ``.hydra/`` record) or deleted from it
    before every check has passed (:func:`take_over`).

    Args:
        cfg: the composed config.
        settings: :func:`~amp_plugin.app.build.prepare`'s result when the caller already ran it.
        clear_outputs: delete the outputs of the run the directory holds first (``overwrite=true``;
            :func:`~amp_plugin.app.reuse.check_reuse` said they may go), once every check has passed.

    Returns:
        The summary (JSON-friendly: ``final_metrics``, ``loss_scale``, ``skipped_steps``,
        ``steps``, ``wall_time_s``, ``paths``, ...) plus the live ``trainer``, ``module`` and
        ``plugin`` objects.

    Raises:
        ConfigError: a bad value, before anything is trained or written (apart from ``FAILED``).
    """
    output_dir = resolve_output_dir(cfg)
    try:
        run = build(cfg, settings, output_dir)
        check_writable(run, cfg)
        take_over(output_dir, cfg, clear_outputs, spawned=rundir.spawned_by_owner(output_dir))
    except ConfigError as err:
        mark_failed(output_dir, err)
        raise
    finally:
        forget_checkpoints()
    threads = torch.get_num_threads()
    late = LateSignals()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    try:
        with warnings.catch_warnings():
            # The recipes keep their data in memory; worker processes would only add start-up time.
            warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
            if run.resume_in_place and run.trainer.is_global_zero:
                keep_history(run.loggers, cast(int, run.resume_step), run.recorder)  # set when resuming
            if run.trainer.is_global_zero and not rundir.spawned_by_owner(output_dir):
                rundir.write_run_id(output_dir, cast(str, run.run_id))  # its checkpoints carry the same id
            start, building = time.perf_counter(), build_seconds()
            run.trainer.fit(run.module, ckpt_path=run.ckpt_path)
            late.hold(run)  # from here until the outputs are written, SIGTERM and SIGHUP wait
            # A first run on a machine compiles the fused kernels inside fit: not training time.
            wall = time.perf_counter() - start - (build_seconds() - building)
            metrics = dict(run.trainer.callback_metrics)  # trainer.validate() below drops the train/* entries
            _final_validation(run)
            metrics.update(run.trainer.callback_metrics)
    except BaseException as err:
        late.release()
        if isinstance(err, OSError) and not isinstance(err, rundir.RunDirGone) and not output_dir.is_dir():
            raise rundir.RunDirGone(output_dir) from err  # a write failed because the directory is gone
        interrupted = _interrupted(run, err)
        if interrupted is not None:
            mark_failed(output_dir, interrupted)
            raise interrupted from None
        setup_error = _setup_error(err, run, cfg)
        mark_failed(output_dir, setup_error or err)
        if setup_error is not None:
            raise setup_error from err
        raise
    finally:
        torch.set_num_threads(threads)
    try:
        summary = summarize(run, wall, metrics)
        failure = failed_training(summary, run.plugin.scaler)
        if failure is not None:
            summary["status"], summary["failure"] = "failed", failure
        noted = bool(late.received)
        if noted:
            summary["notes"] = [*summary.get("notes", []), late.note(summary)]
        if run.trainer.is_global_zero:
            (output_dir / FAILED_FILE).unlink(missing_ok=True)  # a stale note from an earlier attempt here
            write_outputs(run, summary)
            if late.received and not noted:  # a signal while the outputs were written: summary.json says it too
                summary["notes"] = [*summary.get("notes", []), late.note(summary)]
                write_summary(run, summary)
            print(format_summary(summary), flush=True)
    finally:
        late.release()
    if late.received:
        print(late.note(summary), file=sys.stderr, flush=True)
    if failure is not None:
        stopped = RunFailed(failure)
        mark_failed(output_dir, stopped)
        raise stopped
    # late_signals: what LateSignals held (the run finished): a caller that runs more (amp-gate) stops there
    live = {"trainer": run.trainer, "module": run.module, "plugin": run.plugin, "late_signals": list(late.received)}
    return {**summary, **live}


def take_over(output_dir: Path, cfg: DictConfig, clear_outputs: bool, spawned: bool = False) -> None:
    """Every check passed: delete the outputs ``overwrite=true`` replaces, stop protecting the directory,
    and write Hydra's record of the run (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``).

    Raises:
        RunDirError: the outputs may not be deleted after all (a file appeared since the check).
    """
    if spawned:
        return  # a DDP child: the launching process took the directory over
    if clear_outputs:
        from amp_plugin.app.reuse import clear_outputs as clear

        clear(output_dir)
    rundir.adopt(output_dir)
    rundir.write_hydra_record(output_dir, cfg)


class LateSignals:
    """SIGTERM or SIGHUP after the last step began: the run finishes that step (GracefulInterrupt lets a
    last step finish), validates and writes its outputs, says so on stderr and in ``summary.json``'s
    ``notes``, and ends as it would have (exit 0 when it trained): nothing is cut off half-written.
    A signal that arrives after the outputs are written stops the process as before (143, 129)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def hold(self, run: Run) -> None:
        """From now on record SIGTERM and SIGHUP instead of acting on them; note one that arrived in the last step."""
        from amp_plugin.lightning.interrupt import GracefulInterrupt

        pending = next((c.requested for c in run.trainer.callbacks if isinstance(c, GracefulInterrupt)), None)
        if pending:
            self.received.append(int(pending))
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGHUP):
                self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: Any) -> None:
        self.received.append(int(signum))

    def release(self) -> None:
        """Put the handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def note(self, summary: dict[str, Any]) -> str:
        name = signal.Signals(self.received[0]).name
        return (
            f"{name} received after the last step began: the run finished it (step {summary.get('global_step')}), "
            "validated and wrote its outputs (summary.json, checkpoints/last.ckpt); nothing was cut short."
        )


STALLED_STEPS = 10
"""A run that ends with this many skipped steps in a row failed (a healthy dynamic scale skips about one
step per growth, and ten backoffs in a row mean 2**10 too high a scale or gradients that stay inf/NaN); so
does one whose every step was skipped, however short, one that took no step, and one that ends with more
than half of its steps skipped in a row at the scaler's ``min_scale``, where the scale cannot back off further."""


def failed_training(summary: dict[str, Any], scaler: Any) -> str | None:
    """Why a run that reached its last step did not train, or None: its final losses are not finite,
    it took no step, or it ended on :data:`STALLED_STEPS` or more skipped steps in a row, on a streak
    that covers all of its steps, or on more than half of its steps at ``min_scale``."""
    final = summary.get("final_metrics") or {}
    nonfinite = [k for k in ("train/loss", "val/loss") if k in final and not math.isfinite(float(final[k]))]
    if nonfinite:
        shown = ", ".join(f"{k} {float(final[k])}" for k in nonfinite)
        return (
            f"it ended with {shown}: the weights or the loss went non-finite, so the last checkpoint holds no "
            "usable model. Look at the first non-finite step in logs/metrics.csv; with a pure half-precision "
            "preset, try one with FP32 master weights (fp16, bf16) or a larger optimizer eps."
        )
    steps, streak = int(summary["steps"]), int(getattr(scaler, "consecutive_skips", 0))
    if steps == 0:
        return (
            "it took no optimizer step (trainer.max_steps, trainer.max_epochs or the data left nothing to train), so "
            "it has no trained model to report. Check trainer.max_steps, trainer.limit_train_batches and the recipe's "
            "data."
        )
    floor = getattr(scaler, "min_scale", None)
    stuck = floor is not None and scaler.is_enabled() and scaler.get_scale() <= floor  # it cannot back off further
    streak = streak if scaler.is_enabled() else 0
    if streak >= STALLED_STEPS or streak >= steps or (stuck and streak > steps / 2):
        first = int(summary["global_step"]) - streak
        return (
            f"the last {streak} of its {steps} steps were all skipped (every step from step {first} on overflowed), "
            f"so nothing has trained since step {first}; the loss scale is {scaler.get_scale():g}. Resume from a "
            "checkpoint before that step with a lower recipe.lr, or look for inf/NaN in the data and the loss."
        )
    return None


def _final_validation(run: Run) -> None:
    """Validate the final weights unless the last validation already ran at the last step.

    ``max_steps`` usually ends a run mid-epoch, after the last scheduled validation; the
    summary and ``compare`` should report metrics of the weights the run ends with.
    """
    trainer, module = run.trainer, run.module
    has_val = type(module).validation_step is not pl.LightningModule.validation_step
    if not has_val or trainer.limit_val_batches == 0 or trainer.interrupted:
        return
    if trainer.global_step == run.recorder.start_step:
        return
    last_val = max(
        (step for step, row in run.recorder.rows.items() if any(k.startswith("val/") for k in row)), default=None
    )
    if last_val != trainer.global_step:
        trainer.validate(module, verbose=False)


def _interrupted(run: Run, err: BaseException) -> BaseException | None:
    """The :class:`~amp_plugin.lightning.interrupt.RunInterrupted` a signal caused, also when Lightning's
    ``SIGTERMException`` (a ``SystemExit`` with status 0) ended the run before it was raised; or the
    ``KeyboardInterrupt`` that Lightning turned into ``sys.exit(1)``."""
    from amp_plugin.lightning.interrupt import GracefulInterrupt, RunInterrupted

    if isinstance(err, RunInterrupted):
        return err
    if isinstance(err, SystemExit) and isinstance(err.__context__, KeyboardInterrupt):
        return err.__context__  # Lightning turns Ctrl+C into sys.exit(1)
    if type(err).__name__ != "SIGTERMException":
        return None
    pending = next((c.pending for c in run.trainer.callbacks if isinstance(c, GracefulInterrupt)), None)
    return pending


def _setup_error(err: BaseException, run: Run, cfg: DictConfig) -> ConfigError | None:
    """A Trainer argument that Lightning rejects while it sets up the run (before the first step), as
    a :class:`ConfigError` naming the key; for example ``trainer.val_check_interval`` larger than
    an epoch."""
    if run.recorder.started or not isinstance(err, (ValueError, TypeError)) or isinstance(err, ConfigError):
        return None
    trainer = plain(cfg.trainer)
    message = naming_key("trainer", trainer, err)
    return ConfigError(message) if message.startswith("trainer.") and "=" in message.split()[0] else None


def check_writable(run: Run, cfg: DictConfig) -> None:
    """Every directory the run will write into can be written now, not only after an epoch.

    Raises:
        ConfigError: naming the key that sets the directory, the path and the reason.
    """
    targets = [("hydra.run.dir", run.output_dir)]
    for logger in run.loggers:
        if getattr(logger, "log_dir", None):
            targets.append(("logger.save_dir", Path(logger.log_dir)))
    names = [name for name, _ in entries(cfg.callbacks)]
    for name, callback in zip(names, run.callbacks):
        if isinstance(callback, pl.callbacks.ModelCheckpoint) and callback.dirpath:
            targets.append((f"callbacks.{name}.dirpath", Path(callback.dirpath)))
    for key, directory in targets:
        created = [p for p in (directory, *directory.parents) if not p.exists()]
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-test-")
            os.close(fd)
            os.unlink(probe)
            for path in created:  # leave no empty directory behind: the run creates its own
                path.rmdir()
        except OSError as err:
            reason = f"[Errno {err.errno}] {err.strerror}" if err.errno else str(err)
            raise ConfigError(
                f"{key}: the run cannot write to {directory} ({reason}). Make it writable, or point the run at "
                f"a writable place (hydra.run.dir=..., or {key}=...)."
            ) from err
