"""The optimizer-step hooks of :class:`~amp_plugin.lightning.MixedPrecisionPlugin`.

:class:`OptimizerStepHooks` is the plugin's base class: Lightning's ``optimizer_step``,
``clip_gradients`` and ``_clip_gradients`` hooks, run in the order the plugin's module
docstring writes (:mod:`amp_plugin.lightning.plugin`), and the bookkeeping of one iteration
between two scale updates: which optimizers were unscaled (by a clip or by their step: once),
which stepped (in manual optimization the same optimizer stepping again starts a new
iteration), whether a scale update is due (manual optimization updates after
``training_step``), and the gradients shown in the module's ``p.grad`` for the hooks
(:mod:`amp_plugin.lightning.model_grads`). Retries: :mod:`amp_plugin.lightning.retry`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin import fsdp
from amp_plugin.fp8 import Fp8Layers
from amp_plugin.lightning import model_grads
from amp_plugin.lightning.lr_hold import LRHold
from amp_plugin.lightning.namespace import LIGHTNING_MODULES, Precision, trainer_calls
from amp_plugin.lightning.optimizers import unwrap
from amp_plugin.lightning.recovery import save_last_good
from amp_plugin.lightning.retry import manual_attempts, retried_step, retries_on
from amp_plugin.master_weights import MasterWeightOptimizer
from amp_plugin.scaling import LossScaler
from amp_plugin.scaling.dynamic_scaler import LossScaleCollapseError
from amp_plugin.settings import PrecisionSettings

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Optimizable

__all__ = ["OptimizerStepHooks"]


class OptimizerStepHooks(Precision):
    """Unscale once, hooks and clipping on unscaled gradients, step or skip, one scale update
    per iteration (the base of :class:`~amp_plugin.lightning.MixedPrecisionPlugin`, which sets
    :attr:`settings`, :attr:`fp8_layers` and the module being fit)."""

    settings: PrecisionSettings
    fp8_layers: Fp8Layers | None
    _module: Any

    def __init__(self) -> None:
        super().__init__()
        self.last_nonfinite_params: list[tuple[str, int]] = []
        self._pending_update = False
        self._unscaled: set[int] = set()  # optimizers unscaled in this iteration (by clipping or their step)
        self._stepped: set[int] = set()  # optimizers stepped in this iteration (manual optimization)
        self._hooks_read_model_grads: bool | None = None  # worked out at the first step of a fit
        self._shown: dict[int, model_grads.ShownGrads] = {}  # optimizer -> its grads shown in the module's p.grad
        self._lr_hold = LRHold()

    @property
    def scaler(self) -> LossScaler:
        return self.settings.scaler

    @scaler.setter
    def scaler(self, scaler: LossScaler | None) -> None:
        # One scaler for unscale, step and update: replacing it replaces it everywhere.
        self.settings = self.settings.with_scaler(scaler)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if not retries_on(self.scaler, model):
            return self._optimizer_step_once(optimizer, model, closure, **kwargs)
        # DynamicLossScaler(retries=N): an overflowing step runs the closure (the same batch) again.
        return retried_step(self.scaler, model, lambda: self._optimizer_step_once(optimizer, model, closure, **kwargs))

    def attempts(self) -> Generator[int, None, None]:
        """Manual optimization: run a batch's steps again at a lower scale when they overflowed.

        ``DynamicLossScaler(retries=N)``; see :meth:`~amp_plugin.LossScaler.attempts`. In
        ``training_step``::

            for _ in self.trainer.precision_plugin.attempts():
                opt.zero_grad()
                self.manual_backward(self.loss(batch))
                opt.step()

        The scale update that would come after ``training_step`` runs at the end of each
        attempt instead, so the next attempt knows whether to run. A retried attempt's
        ``opt.step()`` calls do not count in ``trainer.global_step``, and the module's buffers
        (BatchNorm's statistics) are put back before it, with the random streams.
        """
        module = self._module
        trainer = module.trainer if module is not None else None

        def end_iteration() -> None:
            if self._pending_update:
                self._pending_update = False
                self._update(trainer)

        yield from manual_attempts(self.scaler, trainer, end_iteration, (module,) if module is not None else ())

    def _optimizer_step_once(
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.settings.precision == "fp32":
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        key = id(unwrap(optimizer))
        if key in self._stepped:  # the same optimizer again in one manual step: a new iteration
            self._pending_update = False
            self._update(model.trainer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward ran, nothing to step
        self._unscale_once(optimizer)
        shown = self._show_unscaled_model_grads(model, optimizer)
        if shown is None:
            self._after_closure(model, optimizer)
        else:
            self._shown[key] = shown
            try:
                self._after_closure(model, optimizer)  # the hooks, then _clip_gradients
            finally:
                del self._shown[key]
            shown.take_edits()  # made by configure_gradient_clipping after it clipped
        scaler = self.scaler
        result = scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self._stepped.add(key)
        self._note_step(model, optimizer)
        self.last_nonfinite_params = self._nonfinite_params(model) if scaler.last_step_skipped else []
        if model.automatic_optimization:
            self._update(model.trainer)
        else:
            self._pending_update = True
        return result

    def _note_step(self, model: Any, optimizer: Any) -> None:
        """Tell the LR hold whether this optimizer's step was taken (:mod:`~amp_plugin.lightning.lr_hold`)."""
        skipped = self.scaler.step_skipped(optimizer)
        trainer = getattr(model, "_trainer", None)
        if model.automatic_optimization and trainer is not None:
            batch_end = trainer.fit_loop.epoch_loop.batch_idx + 1
            self._lr_hold.note_step(optimizer, skipped, trainer.current_epoch, batch_end)
        else:
            self._lr_hold.note_step(optimizer, skipped)

    def _unscale_once(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients into what its step will use, once per iteration.

        Called before clipping (which may come first, from a manual ``self.clip_gradients``)
        and before the step. A disabled scaler still gives master weights their FP32 grads.
        """
        optimizer = unwrap(optimizer)
        if id(optimizer) not in self._unscaled:
            self._unscaled.add(id(optimizer))
            self.scaler.unscale_(optimizer)

    def _show_unscaled_model_grads(self, model: Any, optimizer: Any) -> model_grads.ShownGrads | None:
        """With master weights, when a hook may read the module's ``p.grad``, the unscaled
        gradients written there (:mod:`amp_plugin.lightning.model_grads`)."""
        optimizer = unwrap(optimizer)
        if not isinstance(optimizer, MasterWeightOptimizer):
            return None  # FP32 or pure-half parameters: their own gradients were unscaled in place
        if self._hooks_read_model_grads is None:
            self._hooks_read_model_grads = model_grads.hooks_may_read_grads(model)
        return model_grads.show_unscaled(optimizer) if self._hooks_read_model_grads else None

    @override
    def clip_gradients(self, optimizer: Optimizer, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Clip the gradients the step will use: unscaled, and the FP32 masters' with master weights.

        In manual optimization ``self.clip_gradients(opt, ...)`` comes before ``opt.step()``:
        the gradients are unscaled here first (as ``scaler.unscale_`` before clipping in a plain
        loop), and the step does not unscale them again. Where the module's ``p.grad`` shows
        the gradients (a hook may read them), what a hook changed there is taken first, and
        the clipped gradients are shown there after.
        """
        if clip_val > 0 and self.settings.precision != "fp32":
            self._unscale_once(optimizer)
        shown = self._shown.get(id(unwrap(optimizer)))
        if shown is not None:
            shown.take_edits()  # made in configure_gradient_clipping before it called clip_gradients
        if gradient_clip_algorithm is None:
            super().clip_gradients(optimizer, clip_val)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if shown is not None and clip_val > 0:
            shown.show_again()  # the module's p.grad shows the clipped gradients, as in an FP32 run

    @override
    def _clip_gradients(
        self, model: Any, optimizer: Any, clip_val: float | None = None, gradient_clip_algorithm: Any = None
    ) -> None:
        # Lightning's own version checks for its namespace's LightningModule only; the
        # plugin serves both namespaces (amp_plugin.lightning.namespace).
        if not isinstance(model, LIGHTNING_MODULES) or not model.automatic_optimization:
            return
        shown = self._shown.get(id(unwrap(optimizer)))
        if shown is not None:
            shown.take_edits()  # made by the on_before_optimizer_step hooks, before Lightning clips
        trainer_calls(model)._call_lightning_module_hook(
            model.trainer,
            "configure_gradient_clipping",
            optimizer,
            gradient_clip_val=clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
        )

    def _update(self, trainer: pl.Trainer | None) -> None:
        """``scaler.update()``; if the scale collapses, save the last good state first.

        The FP8 scales update once per iteration: not after an attempt that is retried, whose
        amaxes go back with the module's buffers (a retried batch records the retry's only)."""
        self._unscaled.clear()
        self._stepped.clear()
        try:
            self.scaler.update()
        except LossScaleCollapseError as err:
            self._update_fp8()
            if trainer is None:
                raise
            path = save_last_good(trainer)
            raise LossScaleCollapseError(err.scale, err.iteration, err.consecutive_skips, path) from None
        if not self.scaler.retrying:
            self._update_fp8()

    def _update_fp8(self) -> None:
        if self.fp8_layers is not None:
            self.fp8_layers.update()  # delayed scales, amax histories, fallback counters

    def _nonfinite_params(self, model: torch.nn.Module, top: int = 5) -> list[tuple[str, int]]:
        """Names and counts of parameters with inf/NaN gradients (only run on skipped steps).

        Counts are over whole tensors: under FSDP2 they are summed across the shards (a
        collective on every rank, which all skip together)."""
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if not named:
            return []
        local = torch.stack([(~torch.isfinite(fsdp.local_grad(g))).sum().double() for _, g in named])
        bad = fsdp.reduce_stats([g for _, g in named], local.unsqueeze(1), sum_cols=1)[:, 0].tolist()  # one sync
        counts = sorted(((name, int(n)) for (name, _), n in zip(named, bad) if n), key=lambda item: -item[1])
        return counts[:top]
