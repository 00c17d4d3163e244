"""``LossScaleMonitor``: the loss scale, skipped steps and every scale event, made visible."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from typing_extensions import override

from amp_plugin.checks import check_number
from amp_plugin.lightning.callbacks._common import CsvLog, find_plugin
from amp_plugin.lightning.namespace import Callback, rank_zero_info
from amp_plugin.lightning.plugin import MixedPrecisionPlugin
from amp_plugin.scaling import LossScaler, ScaleUpdate
from amp_plugin.scaling.dynamic_scaler import LossScaleCollapseError
from amp_plugin.settings import no_loss_scaling

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LossScaleMonitor", "ScaleEvent"]

_NO_SCALING = no_loss_scaling()

HEADER = ("step", "old_scale", "new_scale", "reason", "nonfinite_params")


@dataclass(frozen=True)
class ScaleEvent:
    """One row of ``scale_events.csv``.

    Attributes:
        step: ``trainer.global_step`` while that optimizer step ran (0-based, the ``step``
            column of Lightning's ``metrics.csv`` for the same step).
        old_scale: the scale the step ran with.
        new_scale: the scale after the update.
        reason: ``"overflow"`` (backed off), ``"growth"``, ``"hysteresis"`` (overflow
            absorbed, scale kept), ``"min_scale"`` (overflow at the floor), ``"manual"``
            (``update(new_scale)``), ``"retry"`` (backed off to run the same batch again, with
            ``DynamicLossScaler(retries=N)``: not a skip) or ``"skipped"`` (a skip the policy
            answered by keeping the scale, e.g. :class:`~amp_plugin.StaticLossScaler`).
        nonfinite_params: on a skipped step, ``(param_name, count)`` of the parameters whose
            gradients had inf/NaN elements (the top few, most first); empty otherwise (and on
            a ``"retry"`` row, whose attempt the last one replaced).
    """

    step: int
    old_scale: float
    new_scale: float
    reason: str
    nonfinite_params: tuple[tuple[str, int], ...] = ()

    def row(self) -> tuple[Any, ...]:
        """The CSV row; ``nonfinite_params`` as ``name:count;name:count``."""
        return (self.step, self.old_scale, self.new_scale, self.reason, format_params(self.nonfinite_params))


def format_params(params: tuple[tuple[str, int], ...] | list[tuple[str, int]]) -> str:
    return ";".join(f"{name}:{count}" for name, count in params)


class LossScaleMonitor(Callback):
    """Log the loss scale and skipped steps; record every scale event in ``scale_events.csv``.

    After each optimizer step (noticed through the scaler's ``update_count``, so gradient
    accumulation logs once per optimizer step) it logs, with ``pl_module.log(on_step=True)``
    to every logger and the progress bar:

    - ``amp/loss_scale``: the scale that optimizer step ran with (its last attempt);
    - ``amp/skipped_steps``: skipped optimizer steps so far, this one included: batches the
      model was not trained on;
    - ``amp/retried_steps``: attempts run again at a lower scale so far
      (``DynamicLossScaler(retries=N)``);
    - ``amp/wasted_compute``: the fraction of all forward and backward passes that updated
      nothing (retried attempts and skipped steps, :attr:`~amp_plugin.LossScaler.wasted_fraction`).

    Every update that did something (see :class:`ScaleEvent` for the reasons) becomes an
    entry of :attr:`events` and a row of ``scale_events.csv`` in the run's log dir
    (``trainer.log_dir``, else ``trainer.default_root_dir``), appended and flushed as it
    happens by global rank 0; a :class:`~amp_plugin.LossScaleCollapseError` that ends the
    run is recorded too. A console line announces each event, rate-limited; skipped steps
    name the parameters whose gradients were non-finite.

    Host syncs: none. It reads the scaler's host-side floats and ints, and logs CPU
    tensors, so Lightning turning them into numbers never waits for the device.

    Resuming: :attr:`events` is saved in the checkpoint. A resumed run rewrites
    ``scale_events.csv`` (in its own, possibly new, log dir) with the events up to the
    checkpoint, then appends, so the file equals that of a run never interrupted.

    Args:
        notice_interval_s: at least this many seconds between two console notices; events in
            between are counted and the count is reported with the next notice (and at the
            end of training). ``0`` prints every event, ``None`` prints none.
        prog_bar: also show the two metrics in the progress bar.
    """

    def __init__(self, notice_interval_s: float | None = 30.0, prog_bar: bool = True) -> None:
        if notice_interval_s is not None:
            notice_interval_s = check_number("notice_interval_s", notice_interval_s, ge=0.0)
        if not isinstance(prog_bar, bool):
            raise TypeError(f"prog_bar={prog_bar!r} is not allowed: prog_bar must be True or False.")
        self.notice_interval_s = notice_interval_s
        self.prog_bar = prog_bar
        self.events: list[ScaleEvent] = []
        self._csv = CsvLog("scale_events.csv", HEADER)
        self._plugin: MixedPrecisionPlugin | None = None
        self._seen_updates = 0
        self._batch_step = 0
        self._last_notice: float | None = None
        self._suppressed = 0

    @property
    def csv_path(self) -> str | None:
        """Where ``scale_events.csv`` is written (known once training starts)."""
        return self._csv.path

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._plugin = find_plugin(trainer, self, "It logs nothing.")
        if self._plugin is not None and not self._plugin.scaler.is_enabled():
            rank_zero_info(
                f"LossScaleMonitor: no loss scaler in use ({self._plugin.amp_precision}), nothing to monitor."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._plugin is None:
            return
        scaler = self._scaler()
        # Events past the resume point (same instance reused) will happen again.
        self.events = [e for e in self.events if e.step < trainer.global_step]
        self._csv.start(trainer, rows=[e.row() for e in self.events])
        self._seen_updates = scaler.update_count
        self._last_notice, self._suppressed = None, 0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        scaler = self._scaler()
        if scaler.update_count == self._seen_updates:
            return  # no optimizer step in this batch (gradient accumulation), or no loss scaling
        update = self._record_update()
        if update is None:
            return
        log: dict[str, Any] = dict(on_step=True, on_epoch=False, prog_bar=self.prog_bar, batch_size=1)
        pl_module.log("amp/loss_scale", torch.tensor(update.old_scale), **log)
        pl_module.log("amp/skipped_steps", torch.tensor(float(scaler.skipped_steps)), **log)
        if scaler.retries:
            pl_module.log("amp/retried_steps", torch.tensor(float(scaler.retried_steps)), **log)
        pl_module.log("amp/wasted_compute", torch.tensor(scaler.wasted_fraction), **{**log, "prog_bar": False})

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # The update that raised LossScaleCollapseError is complete; the batch-end hook never ran.
        scaler = self._scaler()
        if isinstance(exception, LossScaleCollapseError) and scaler.update_count != self._seen_updates:
            self._record_update()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._suppressed:
            rank_zero_info(
                f"amp: {self._suppressed} loss-scale event(s) not shown on the console; all "
                f"{len(self.events)} are in {self.csv_path}"
            )
            self._suppressed = 0

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": [asdict(e) for e in self.events]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.events = [
            ScaleEvent(**{**e, "nonfinite_params": tuple(tuple(p) for p in e["nonfinite_params"])})
            for e in state_dict.get("events", [])
        ]

    # ------------------------------------------------------------------ internals
    def _scaler(self) -> LossScaler:
        # Without the plugin, a disabled scaler: it never updates, so nothing is logged.
        return self._plugin.scaler if self._plugin is not None else _NO_SCALING

    def _record_update(self) -> ScaleUpdate | None:
        """Read the scaler's last iteration (its retries, then its last update); record and
        announce each event. Returns the last update."""
        scaler = self._scaler()
        self._seen_updates = scaler.update_count
        update = scaler.last_update
        for each in scaler.iteration_updates or ((update,) if update is not None else ()):
            if each.reason is None and not each.found_inf:
                continue
            plugin = cast(MixedPrecisionPlugin, self._plugin)  # set: the stand-in scaler never updates
            names = tuple(plugin.last_nonfinite_params) if each.found_inf and each.reason != "retry" else ()
            event = ScaleEvent(self._batch_step, each.old_scale, each.new_scale, each.reason or "skipped", names)
            self.events.append(event)
            self._csv.append([event.row()])
            self._notice(event, scaler.skipped_steps)
        return update

    def _notice(self, event: ScaleEvent, skipped_total: int) -> None:
        if self.notice_interval_s is None:
            return
        now = time.monotonic()
        if self._last_notice is not None and now - self._last_notice < self.notice_interval_s:
            self._suppressed += 1
            return
        text = f"amp: step {event.step}: " + _describe(event, skipped_total)
        if self._suppressed:
            text += f" (+{self._suppressed} earlier event(s) not shown, see {self.csv_path})"
        self._last_notice, self._suppressed = now, 0
        rank_zero_info(text)


def _describe(event: ScaleEvent, skipped_total: int) -> str:
    old, new = f"{event.old_scale:g}", f"{event.new_scale:g}"
    if event.reason == "growth":
        return f"loss scale {old} -> {new} (growth after a run of clean steps)"
    if event.reason == "manual":
        return f"loss scale set {old} -> {new}"
    if event.reason == "retry":
        return f"inf/NaN gradients: loss scale {old} -> {new}, the same batch runs again (not skipped)"
    where = f" in {format_params(event.nonfinite_params)}" if event.nonfinite_params else ""
    then = {
        "overflow": f"loss scale {old} -> {new}",
        "hysteresis": f"loss scale kept at {old} (hysteresis)",
        "min_scale": f"loss scale kept at the minimum {old}",
    }.get(event.reason, f"loss scale kept at {old}")
    return f"inf/NaN gradients{where}: step skipped ({skipped_total} so far), {then}"
