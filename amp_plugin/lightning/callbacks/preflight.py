"""``PreflightChecks``: the :mod:`amp_plugin.preflight` checks, run by Lightning at the start of ``fit``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from amp_plugin.checks import check_choice, check_number
from amp_plugin.half_module import NORM_TYPES
from amp_plugin.lightning.namespace import LIGHTNING_AUTOCAST_PLUGINS, Callback, rank_zero_warn
from amp_plugin.lightning.plugin import MixedPrecisionPlugin
from amp_plugin.preflight import (
    CHECKS,
    PreflightError,
    PreflightProblem,
    PreflightWarning,
    check_anomaly_detection,
    check_grad_scaler,
    check_half_params_under_autocast,
    check_loss_dtype,
    check_optimizer_eps,
    check_weight_range,
    find_grad_scalers,
)
from amp_plugin.scaling import LossScaler
from amp_plugin.scaling.dynamic_scaler import DynamicLossScaler

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PreflightChecks"]

_ON_PROBLEM = ("warn", "raise")


class PreflightChecks(Callback):
    """Catch half-precision setups that are known to fail, each reported with its fix.

    When, and what (names for ``skip``):

    - ``setup``, before the precision plugin casts the model: ``weight_range``, FP16 chosen
      for weights FP16 cannot hold (``|w| >= 65520``, or many nonzero ``|w| < 6.1e-5``).
    - ``on_fit_start``, once the model is cast and the optimizers are built:
      ``optimizer_eps`` (an ``eps`` that is 0 in the optimizer state's dtype),
      ``half_params_autocast`` (half-precision parameters under autocast),
      ``grad_scaler_half_grads`` (a ``torch.amp.GradScaler`` attribute of the module, or
      Lightning's ``16-mixed`` scaler, with FP16 parameters),
      ``anomaly_detection`` (``torch.autograd.set_detect_anomaly(True)`` or
      ``Trainer(detect_anomaly=True)`` with a dynamic loss scaler: the overflows it expects
      raise inside ``backward`` instead of being skipped).
    - the first training batch: ``half_loss`` (the loss the training step returned is
      FP16/BF16; read in ``on_before_backward`` and, because a loss scaler hands that hook
      the scaled FP32 loss, again from the batch outputs in ``on_train_batch_end``).

    Works with amp_plugin's :class:`~amp_plugin.plugin.MixedPrecisionPlugin` and with
    Lightning's own precision settings (``"16-mixed"``, ``"16-true"``, ``"bf16-*"``). Each
    problem is reported once per ``fit``.

    Args:
        on_problem: ``"warn"`` issues a :class:`~amp_plugin.preflight.PreflightWarning`;
            ``"raise"`` raises :class:`~amp_plugin.preflight.PreflightError`.
        skip: names of checks not to run (see above).
        tiny_weight_frac: the share of nonzero weights below FP16's normal range tolerated
            by ``weight_range``.
    """

    def __init__(self, on_problem: str = "warn", skip: Iterable[str] = (), tiny_weight_frac: float = 0.01) -> None:
        self.on_problem = check_choice("on_problem", on_problem, _ON_PROBLEM)
        if isinstance(skip, str):
            skip = (skip,)
        self.skip = frozenset(check_choice("skip", s, CHECKS) for s in skip)
        self.tiny_weight_frac = check_number("tiny_weight_frac", tiny_weight_frac, ge=0.0, le=1.0)
        self.problems: list[PreflightProblem] = []
        self._loss_checked = False

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.problems, self._loss_checked = [], False
        precision, _, keeps_norm_fp32 = _settings(trainer.precision_plugin)
        if precision == "fp16" and "weight_range" not in self.skip:
            fp32_kept = {
                id(p)
                for m in pl_module.modules()
                if keeps_norm_fp32 and isinstance(m, NORM_TYPES)
                for p in m.parameters(recurse=False)
            }
            weights = [(n, p) for n, p in pl_module.named_parameters() if id(p) not in fp32_kept]
            self._report(check_weight_range(weights, self.tiny_weight_frac))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        _, autocast, _ = _settings(plugin)
        params = list(pl_module.named_parameters())
        if "optimizer_eps" not in self.skip:
            for i, opt in enumerate(trainer.optimizers):
                name = f"optimizer {i} ({type(getattr(opt, 'optimizer', opt)).__name__})"
                self._report(check_optimizer_eps(opt, name))
        if autocast and "half_params_autocast" not in self.skip:
            self._report(check_half_params_under_autocast(params))
        if "grad_scaler_half_grads" not in self.skip:
            where = [f"pl_module.{name}" for name, _ in find_grad_scalers(pl_module)]
            scaler = getattr(plugin, "scaler", None)
            if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled():
                where.append(f"the {type(plugin).__name__} precision plugin ({plugin.precision!r})")
            self._report(check_grad_scaler(where, params))
        if "anomaly_detection" not in self.skip:
            scaler = getattr(plugin, "scaler", None)
            dynamic = isinstance(scaler, (DynamicLossScaler, torch.amp.GradScaler)) and scaler.is_enabled()
            enabled = torch.is_anomaly_enabled() or bool(getattr(trainer, "_detect_anomaly", False))
            self._report(check_anomaly_detection(dynamic, enabled))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if not self._loss_checked:
            self._check_loss(trainer, loss)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._loss_checked:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            self._check_loss(trainer, loss)
            self._loss_checked = True

    # ------------------------------------------------------------------ internals
    def _check_loss(self, trainer: pl.Trainer, loss: Any) -> None:
        if "half_loss" in self.skip or any(p.check == "half_loss" for p in self.problems):
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = scaler.get_scale() if isinstance(scaler, LossScaler) and scaler.is_enabled() else None
        self._report(check_loss_dtype(loss, scale))

    def _report(self, problems: list[PreflightProblem]) -> None:
        for problem in problems:
            self.problems.append(problem)
            if self.on_problem == "raise":
                raise PreflightError(str(problem))
            rank_zero_warn(str(problem), category=PreflightWarning)


def _settings(plugin: Any) -> tuple[str, bool, bool]:
    """``(precision, autocast, keeps_norm_fp32)`` of amp_plugin's or Lightning's precision plugin."""
    if isinstance(plugin, MixedPrecisionPlugin):
        return plugin.amp_precision, plugin.autocast, plugin.master_weights or plugin.autocast
    name = str(getattr(plugin, "precision", "32-true"))
    precision = "fp16" if name.startswith("16") else "bf16" if name.startswith("bf16") else "fp32"
    autocast = isinstance(plugin, LIGHTNING_AUTOCAST_PLUGINS) or name.endswith("-mixed")
    return precision, autocast, autocast
