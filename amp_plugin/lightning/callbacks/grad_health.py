"""``GradientHealthMonitor``: how much of each gradient FP16 flushes, and how close it is to overflow."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin.dtypes import FP16_MAX, FP16_MIN_NORMAL
from amp_plugin.fsdp import local_grad, reduce_stats
from amp_plugin.lightning.callbacks._common import CsvLog, find_plugin
from amp_plugin.lightning.namespace import Callback, rank_zero_info
from amp_plugin.lightning.plugin import MixedPrecisionPlugin
from amp_plugin.master_weights import MasterWeightOptimizer

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FP16_MAX", "FP16_MIN_NORMAL", "GradientHealthMonitor", "ParamGradHealth"]


HEADER = (
    "step",
    "param",
    "numel",
    "zero_frac",
    "underflow_frac_scale1",
    "underflow_frac_current",
    "amax",
    "headroom_bits",
)


@dataclass(frozen=True)
class ParamGradHealth:
    """One parameter's gradient statistics at one step (a row of ``grad_health.csv``).

    ``g`` is the unscaled FP32 gradient the optimizer is about to use and ``S`` the loss
    scale its backward ran with (1 without a scaler).

    Attributes:
        step: ``trainer.global_step`` of the optimizer step (0-based).
        param: the parameter's name in ``pl_module.named_parameters()``.
        numel: its number of elements.
        zero_frac: fraction of elements with ``g == 0``.
        underflow_frac_scale1: fraction of elements with ``|g| < 2**-14``: those that are zero
            or subnormal in FP16 without loss scaling. Exact zeros count (they are included
            in ``zero_frac`` too); subnormals keep fewer than 10 mantissa bits, and values
            below ``2**-25`` flush to zero.
        underflow_frac_current: the same for ``|g| * S``, i.e. for the scaled gradient that
            backward produced in the half-precision model at the current scale.
        amax: ``max |g|`` (inf/NaN when the gradient had them).
        headroom_bits: ``log2(65504 / (amax * S))``: how many doublings of the scale are left
            before the largest scaled gradient overflows FP16 (negative: it overflowed;
            ``inf`` when ``amax == 0``).
    """

    step: int
    param: str
    numel: int
    zero_frac: float
    underflow_frac_scale1: float
    underflow_frac_current: float
    amax: float
    headroom_bits: float

    def row(self) -> tuple[Any, ...]:
        return (
            self.step,
            self.param,
            self.numel,
            self.zero_frac,
            self.underflow_frac_scale1,
            self.underflow_frac_current,
            self.amax,
            self.headroom_bits,
        )


def headroom_bits(amax: float, scale: float) -> float:
    """``log2(65504 / (amax * scale))``; ``inf`` for ``amax == 0``, ``-inf`` for ``amax == inf``."""
    if amax == 0:
        return math.inf
    if math.isnan(amax):
        return math.nan
    if math.isinf(amax):
        return -math.inf
    return math.log2(FP16_MAX / (amax * scale))


@torch.no_grad()
def measure(grads: list[torch.Tensor], scale: float) -> list[list[float]]:
    """Per gradient ``[zero_count, underflow_count_scale1, underflow_count_current, amax]``.

    All statistics are computed as tensors and read back with one ``.tolist()``: one host
    sync per call, whatever the number of parameters. DTensor gradients (FSDP2) are measured
    on each rank's shard and reduced to whole-tensor statistics (two collectives: call it on
    every rank).
    """
    if not grads:
        return []
    current = FP16_MIN_NORMAL / scale
    device = local_grad(grads[0]).device
    stats = []
    for g in grads:
        a = local_grad(g.detach()).abs()
        if a.dtype not in (torch.float32, torch.float64):
            a = a.float()  # thresholds like 2**-30 are not representable in half precision
        if a.numel() == 0:  # a rank may hold an empty shard of a small parameter
            stats.append(torch.zeros(4, dtype=torch.float64, device=device))
            continue
        stats.append(
            torch.stack(
                [
                    (a == 0).sum().double(),
                    (a < FP16_MIN_NORMAL).sum().double(),
                    (a < current).sum().double(),
                    a.max().double(),
                ]
            ).to(device)
        )
    return reduce_stats(grads, torch.stack(stats), sum_cols=3).tolist()


class GradientHealthMonitor(Callback):
    """Every ``every_n_steps`` optimizer steps, measure each parameter's gradient against FP16's range.

    Measured in ``on_before_optimizer_step``, where the plugin has already unscaled the
    gradients into FP32 (with master weights: the FP32 master gradients, reported under the
    model parameter's name). Each measurement writes one row per parameter to
    ``grad_health.csv`` in the run's log dir (``trainer.log_dir``, else
    ``trainer.default_root_dir``; see :class:`ParamGradHealth` for the columns), logs a few
    summaries to every logger at that step:

    - ``amp/grad_zero_frac``, ``amp/underflow_frac_scale1``, ``amp/underflow_frac_current``:
      the fractions over all gradient elements of the model;
    - ``amp/worst_underflow_frac_current``: the largest per-parameter
      ``underflow_frac_current`` (the worst layer, named in the console line);
    - ``amp/min_headroom_bits``: the smallest per-parameter headroom;

    and prints one console line (``verbose``). On other steps the hook does one integer
    comparison and returns. A measurement costs a few passes over the gradients and one host
    sync. The FP16 thresholds are used whatever the precision: with bf16 or fp32 the columns
    say what FP16 would do to these gradients.

    Resuming: rows of an existing ``grad_health.csv`` in the log dir from before the resume
    point are kept, later ones dropped, then new rows are appended.

    Args:
        every_n_steps: measure when ``trainer.global_step % every_n_steps == 0``.
        verbose: print one line per measurement.
    """

    reads_master_grads = True  # it reads the optimizer's FP32 gradients, not the module's p.grad

    def __init__(self, every_n_steps: int = 100, verbose: bool = True) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} is not allowed: every_n_steps must be an integer >= 1.")
        self.every_n_steps = every_n_steps
        self.verbose = verbose
        self.last_stats: list[ParamGradHealth] = []
        self.last_summary: dict[str, float] = {}
        self._csv = CsvLog("grad_health.csv", HEADER)
        self._plugin: MixedPrecisionPlugin | None = None
        self._measured_step = -1

    @property
    def csv_path(self) -> str | None:
        """Where ``grad_health.csv`` is written (known once training starts)."""
        return self._csv.path

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._plugin = find_plugin(
            trainer, self, "It measures as if the loss scale were 1 (underflow_frac_current, headroom_bits)."
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        start = trainer.global_step
        self._csv.start(trainer, keep_existing=lambda row: start > 0 and int(row["step"]) < start)
        self._measured_step = -1

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self._measured_step:
            return
        self._measured_step = step
        scale = self._plugin.scaler.get_scale() if self._plugin is not None else 1.0
        names, grads = _named_grads(pl_module, getattr(optimizer, "_optimizer", optimizer))
        stats = [
            ParamGradHealth(
                step,
                name,
                g.numel(),
                zeros / g.numel(),
                u1 / g.numel(),
                uc / g.numel(),
                amax,
                headroom_bits(amax, scale),
            )
            for name, g, (zeros, u1, uc, amax) in zip(names, grads, measure(grads, scale))
        ]
        self.last_stats = stats
        if not stats:
            return
        self._csv.append(s.row() for s in stats)
        self.last_summary = _summary(stats)
        for logger in trainer.loggers:
            logger.log_metrics(self.last_summary, step=step)
        if self.verbose:
            rank_zero_info(_describe(stats, self.last_summary, scale))


def _named_grads(pl_module: pl.LightningModule, optimizer: Optimizer) -> tuple[list[str], list[torch.Tensor]]:
    """The optimizer's gradients (FP32 masters' for a MasterWeightOptimizer) with model names."""
    names_by_id = {id(p): n for n, p in pl_module.named_parameters()}
    if isinstance(optimizer, MasterWeightOptimizer):
        pairs = list(zip(optimizer.model_params(), optimizer.master_params()))
    else:
        pairs = [(p, p) for group in optimizer.param_groups for p in group["params"]]
    names, grads = [], []
    for i, (model_p, p) in enumerate(pairs):
        if p.grad is None or p.grad.numel() == 0 or p.grad.is_sparse:
            continue
        names.append(names_by_id.get(id(model_p), f"param[{i}]"))
        grads.append(p.grad)
    return names, grads


def _summary(stats: list[ParamGradHealth]) -> dict[str, float]:
    total = sum(s.numel for s in stats)
    headrooms = [s.headroom_bits for s in stats if not math.isnan(s.headroom_bits)]
    return {
        "amp/grad_zero_frac": sum(s.zero_frac * s.numel for s in stats) / total,
        "amp/underflow_frac_scale1": sum(s.underflow_frac_scale1 * s.numel for s in stats) / total,
        "amp/underflow_frac_current": sum(s.underflow_frac_current * s.numel for s in stats) / total,
        "amp/worst_underflow_frac_current": max(s.underflow_frac_current for s in stats),
        "amp/min_headroom_bits": min(headrooms) if headrooms else math.nan,
    }


def _describe(stats: list[ParamGradHealth], summary: dict[str, float], scale: float) -> str:
    worst = max(stats, key=lambda s: (s.underflow_frac_current, s.numel))
    tight = min(stats, key=lambda s: s.headroom_bits if not math.isnan(s.headroom_bits) else math.inf)
    return (
        f"amp: grad health at step {stats[0].step} (scale {scale:g}): "
        f"{summary['amp/underflow_frac_scale1']:.1%} of gradient elements underflow FP16 at scale 1, "
        f"{summary['amp/underflow_frac_current']:.1%} at the current scale; "
        f"worst {worst.param} ({worst.underflow_frac_current:.1%}); "
        f"least headroom {tight.param} ({tight.headroom_bits:.1f} bits)"
    )
