"""``FP8Monitor``: per FP8 layer and operand, amax, scale, saturated and flushed-to-zero fractions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from typing_extensions import override

from amp_plugin.fp8 import Fp8Stat
from amp_plugin.lightning.callbacks._common import CsvLog, find_plugin
from amp_plugin.lightning.namespace import Callback, rank_zero_info

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from amp_plugin.fp8 import Fp8Layers

__all__ = ["FP8Monitor"]

HEADER = ("step", "layer", "operand", "amax", "scale", "saturated_frac", "flushed_frac", "numel")


class FP8Monitor(Callback):
    """Every ``every_n_steps`` optimizer steps, read the FP8 layers' statistics (one host sync).

    The layers count on the device as they cast (:class:`~amp_plugin.fp8.Fp8Linear`); this
    callback reads the counts of the steps since its last read and starts a new window. Each
    read writes one row per FP8 layer and operand (``input``, ``weight``, ``grad_output``) to
    ``fp8_stats.csv`` in the run's log dir, with a header row:
    ``step,layer,operand,amax,scale,saturated_frac,flushed_frac,numel`` (``amax``: the largest
    ``|x|`` of the window; ``scale``: the one in use; the fractions are over the window's
    values; ``step``: the optimizer steps done, the one read included), and logs to every logger at
    Lightning's step of that optimizer step (``step - 1``, the row of its ``train/loss``):

    - ``fp8/max_saturated_frac``, ``fp8/max_flushed_frac``: the worst layer and operand;
    - ``fp8/min_scale``: the smallest scale in use;
    - ``fp8/bf16_fallbacks``: how many layers have fallen back to BF16 so far;
    - ``fp8/fp8_layers``: how many linear layers compute in FP8 now.

    At the start of training it prints which layers run in FP8 and why the others are BF16
    (:meth:`~amp_plugin.fp8.Fp8Layers.describe`). A layer's fallback to BF16 is also printed once
    when this callback first sees it. Without ``precision="fp8"`` the callback does nothing.

    Resuming: rows of an existing ``fp8_stats.csv`` up to the checkpoint's step are kept (the resumed
    run reads from the step after it).

    Args:
        every_n_steps: read when ``trainer.global_step % every_n_steps == 0`` (after the step).
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} is not allowed: every_n_steps must be an integer >= 1.")
        self.every_n_steps = every_n_steps
        self.last_stats: list[Fp8Stat] = []
        self.last_summary: dict[str, float] = {}
        self._csv = CsvLog("fp8_stats.csv", HEADER)
        self._layers: Fp8Layers | None = None
        self._reported = 0

    @property
    def csv_path(self) -> str | None:
        """Where ``fp8_stats.csv`` is written (known once training starts)."""
        return self._csv.path

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = find_plugin(trainer, self, "It has no FP8 layers to read.")
        self._layers = plugin.fp8_layers if plugin is not None else None
        start = trainer.global_step  # a row's step counts the steps done with it: the checkpoint's own kept
        self._csv.start(trainer, keep_existing=lambda row: start > 0 and int(row["step"]) <= start)
        self._reported = len(self._layers.fallbacks) if self._layers is not None else 0
        if self._layers is not None:
            rank_zero_info(f"amp: FP8: {self._layers.describe()}")
            self._layers.read_stats(reset=True)  # a fresh window from the first step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        layers = self._layers
        step = trainer.global_step  # optimizer steps done, the one of this batch included
        if layers is None or step % self.every_n_steps:
            return
        for fallback in layers.fallbacks[self._reported :]:
            rank_zero_info(f"amp: FP8 layer {fallback.layer!r} fell back to BF16 at step {fallback.step}")
        self._reported = len(layers.fallbacks)
        stats = layers.read_stats(reset=True)
        self.last_stats = stats
        rows = [(step, s.layer, s.operand, s.amax, s.scale, s.saturated_frac, s.flushed_frac, s.numel) for s in stats]
        self._csv.append(rows)
        self.last_summary = {
            "fp8/bf16_fallbacks": float(len(layers.fallbacks)),
            "fp8/fp8_layers": float(len(layers.active())),
        }
        if stats:
            self.last_summary.update(
                {
                    "fp8/max_saturated_frac": max(s.saturated_frac for s in stats),
                    "fp8/max_flushed_frac": max(s.flushed_frac for s in stats),
                    "fp8/min_scale": min(s.scale for s in stats),
                }
            )
        for logger in trainer.loggers:  # at Lightning's step of this optimizer step, with its train/loss
            logger.log_metrics(self.last_summary, step=step - 1)
