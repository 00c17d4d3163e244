"""``MixedPrecisionPlugin``: loss scaling and FP32 master weights as a Lightning precision plugin.

One optimizer step, in this order (written once, here)::

    closure (forward, scaled backward)
    -> inf check and unscale (FP32 master grads made only where something reads them)
    -> on_before_optimizer_step hooks and gradient clipping see unscaled grads: FP32 in
       the optimizer's param groups, and, when a hook may read them, the module's own
       p.grad too (unscaled, rounded to the half type; an edit there reaches the step)
    -> step, or skip when a gradient is inf/NaN (all ranks agree)
    -> scale update (once per iteration, also with several optimizers)
    -> masters copied back into the half-precision model (only after a real step)

Under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) the sharded
FP32 parameters are the master weights: no :class:`~amp_plugin.MasterWeightOptimizer` is built,
each unit gets the preset's ``MixedPrecisionPolicy`` (:mod:`amp_plugin.fsdp`), the scaler
unscales each rank's shards and all ranks agree on the skip.

A skipped step does not advance "step"-interval LR schedulers (``skip_lr_on_overflow``,
:mod:`amp_plugin.lightning.lr_hold`). ``trainer.global_step`` counts optimizer steps
*attempted*, skipped ones included, so ``max_steps`` bounds the iterations; the scheduler has
then stepped ``global_step - scaler.skipped_steps`` times.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from amp_plugin import fsdp
from amp_plugin.dynamic_scaler import LossScaleCollapseError
from amp_plugin.emulation import CpuHalfEmulation, cpu_half_path, should_emulate
from amp_plugin.half_module import cast_floating, cast_module
from amp_plugin.lightning import checkpoint_state, model_grads
from amp_plugin.lightning._namespace import LIGHTNING_MODULES, Precision, rank_zero_info, rank_zero_warn, trainer_calls
from amp_plugin.lightning.checkpoint_state import CHECKPOINT_KEY
from amp_plugin.lightning.lr_hold import LRHold
from amp_plugin.lightning.recovery import save_last_good
from amp_plugin.master_weights import MasterWeightOptimizer
from amp_plugin.scaler import LossScaler
from amp_plugin.settings import PrecisionSettings, ScalerArg

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR
    from lightning.fabric.utilities.types import Optimizable

__all__ = ["CHECKPOINT_KEY", "MixedPrecisionPlugin"]


class MixedPrecisionPlugin(Precision):
    """Mixed precision for the Lightning ``Trainer``: ``Trainer(plugins=[MixedPrecisionPlugin()])``.

    Works with ``lightning.pytorch`` and ``pytorch_lightning`` alike.

    Args:
        precision: a preset name: ``"fp16"`` (default), ``"bf16"``, ``"fp32"``,
            ``"fp16_autocast"``, ``"bf16_autocast"``, ``"fp16_pure"``, ``"bf16_pure"`` (the
            same names as the app's ``precision=``; see :mod:`amp_plugin.settings`). FP16
            really is FP16, on CPU too.
        master_weights: keep the model's parameters in the half dtype (normalisation layers
            stay FP32) and let the optimizer update FP32 master copies
            (:class:`~amp_plugin.MasterWeightOptimizer`). ``None`` (default): the preset's.
        autocast: run forward under ``torch.autocast`` with FP32 parameters (the FP32
            parameters are the master copy), like Lightning's ``16-mixed``. ``None``
            (default): the preset's; ``precision="fp16", autocast=True`` is ``"fp16_autocast"``.
            ``master_weights=False, autocast=False`` is pure half precision (``16-true``).
            With ``precision="fp32"`` both are ignored.
        scaler: ``"auto"`` (default: ``DynamicLossScaler()`` for FP16, none for BF16/FP32),
            ``None`` for no loss scaling, a :class:`~amp_plugin.LossScaler`, or a mapping of
            scaler settings (a YAML config's ``scaler: {hysteresis: 2}``): merged into the
            preset's own scaler; ``"type": "dynamic"|"static"`` names one, which a preset
            without a scaler (BF16, FP32) requires.
        emulate: ``"auto"`` picks, per dtype and CPU, the path that is faithful (products
            summed in FP32, rounded once, as on GPU Tensor Cores) and fastest
            (:func:`~amp_plugin.emulation.cpu_half_path`): native oneDNN BF16 on
            ``avx512_bf16``/AMX-BF16, native FP16 on AMX-FP16, otherwise
            :class:`~amp_plugin.CpuHalfEmulation` (FP32 matmuls rounded once). ``"on"`` forces
            the emulation, ``"off"`` the native CPU kernels.
        skip_lr_on_overflow: a skipped step does not advance "step"-interval LR schedulers.

    Attributes:
        settings: the validated :class:`~amp_plugin.settings.PrecisionSettings`.
        scaler: the loss scaler in use; without loss scaling, a disabled one
            (``scaler.is_enabled()`` is False, the scale reads 1.0, nothing is skipped).
        last_nonfinite_params: on a skipped step, ``(name, count)`` of the parameters whose
            gradients were inf/NaN (the top few).
        emulating: whether CPU half emulation is on for this run (known once fitting starts).
        compute_path: how this run's half-precision matmuls run and why, e.g.
            ``"bf16: native (avx512_bf16)"`` (known once fitting starts).
        sharded: whether the module is sharded with FSDP2 (known once fitting starts).
    """

    def __init__(
        self,
        precision: str = "fp16",
        master_weights: bool | None = None,
        autocast: bool | None = None,
        scaler: ScalerArg = "auto",
        emulate: str = "auto",
        skip_lr_on_overflow: bool = True,
    ) -> None:
        self.settings = PrecisionSettings.build(
            precision,
            master_weights,
            autocast,
            scaler,
            emulate,
            skip_lr_on_overflow,
        )
        # what Lightning's `trainer.precision` reports ("32-true", "16-mixed", "bf16-true", ...)
        self.precision = cast("_PRECISION_INPUT_STR", self.settings.lightning_precision)
        self.last_nonfinite_params: list[tuple[str, int]] = []
        self.emulating = False
        self.compute_path = ""
        self.sharded = False
        self._device_type = "cpu"
        self._module: Any = None
        self._pending_update = False
        self._unscaled: set[int] = set()  # optimizers unscaled in this iteration (by clipping or their step)
        self._stepped: set[int] = set()  # optimizers stepped in this iteration (manual optimization)
        self._emulation_hold: Any = None
        self._hooks_read_model_grads: bool | None = None  # worked out at the first step of a fit
        self._described = False
        self._lr_hold = LRHold(lambda: self.settings.skip_lr_on_overflow and self.scaler.last_step_skipped)

    @classmethod
    def from_settings(cls, settings: PrecisionSettings) -> MixedPrecisionPlugin:
        """A plugin for already validated settings (what the app builds before importing Lightning)."""
        plugin = cls(settings.preset, None, None, settings.scaler, settings.emulate, settings.skip_lr_on_overflow)
        return plugin

    # ------------------------------------------------------------------ settings
    @property
    def scaler(self) -> LossScaler:
        return self.settings.scaler

    @scaler.setter
    def scaler(self, scaler: LossScaler | None) -> None:
        # One scaler for unscale, step and update: replacing it replaces it everywhere.
        self.settings = self.settings.with_scaler(scaler)

    @property
    def amp_precision(self) -> str:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``."""
        return self.settings.precision

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.settings.compute_dtype

    @property
    def master_weights(self) -> bool:
        return self.settings.master_weights

    @property
    def autocast(self) -> bool:
        return self.settings.autocast

    @property
    def emulate(self) -> str:
        return self.settings.emulate

    @property
    def skip_lr_on_overflow(self) -> bool:
        return self.settings.skip_lr_on_overflow

    @property
    def mp_policy(self) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` of this preset (:func:`amp_plugin.fsdp.policy_for`)."""
        return fsdp.policy_for(self.settings)

    # ------------------------------------------------------------------ setup
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # FSDP2 units exist only if the user imported FSDP (configure_model ran before this).
        units = fsdp.fsdp2_units(module) if "torch.distributed.fsdp" in sys.modules else []
        self.sharded = bool(units)
        if self.sharded:
            fsdp.check_or_set_policies(units, self.settings)
            if self.settings.master == "bf16_split":
                rank_zero_warn(
                    "precision='bf16_split' under FSDP2 trains as precision='bf16': the sharded FP32 parameters "
                    "are the master weights (16/N bytes per parameter per rank), so there is no BF16 master to split."
                )
            if self.amp_precision != "fp32" and not self.master_weights and not self.autocast:
                module.to(self.compute_dtype)  # pure half: the shards themselves become half
        elif self.amp_precision != "fp32" and not self.autocast:
            cast_module(module, self.compute_dtype, keep_norm_fp32=self.master_weights)
        return module

    @override
    def connect(
        self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Optimizer], list[Any]]:
        if self.amp_precision != "fp32" and any(isinstance(getattr(o, "optimizer", o), LBFGS) for o in optimizers):
            raise ValueError(
                f"LBFGS cannot be used with precision={self.settings.preset!r}: it re-evaluates the closure "
                "several times inside one step(), so a loss-scale skip or an FP32 master copy cannot be "
                "applied per step. Train with precision='fp32', or use another optimizer."
            )
        if self.sharded and any(isinstance(o, MasterWeightOptimizer) for o in optimizers):
            raise TypeError(
                "MasterWeightOptimizer cannot be used with FSDP2: the sharded FP32 parameters already are the "
                "master weights. Return an optimizer over the module's parameters from configure_optimizers."
            )
        if self.master_weights and not self.sharded:
            master = self.settings.master
            optimizers = [
                o if isinstance(o, MasterWeightOptimizer) else MasterWeightOptimizer(o, master=master)
                for o in optimizers
            ]
        param = next(model.parameters(), None)
        self._device_type = param.device.type if param is not None else "cpu"
        if self.emulate == "on" or (self.emulate == "auto" and should_emulate(self._device_type, self.compute_dtype)):
            self.emulating = self.amp_precision != "fp32"
        self.compute_path = self._compute_path()
        if self.emulating and self._emulation_hold is None:
            # Keep the emulation kernels registered for the whole run: each forward/backward
            # context then costs a counter update instead of a kernel registration.
            self._emulation_hold = CpuHalfEmulation.keep_installed()
            self._emulation_hold.__enter__()
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self._module = module if isinstance(module, LIGHTNING_MODULES) else None
        self._lr_hold.attach(lr_schedulers)
        self._hooks_read_model_grads = None
        if not self._described:  # once per plugin, not once per fit/validate stage
            self._described = True
            rank_zero_info(f"amp_plugin: {self.describe()}")
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        self._lr_hold.detach()
        self._module = None
        if self._emulation_hold is not None:
            self._emulation_hold.__exit__(None, None, None)
            self._emulation_hold = None

    def describe(self) -> str:
        """One line saying what this plugin does on this run."""
        if self.amp_precision == "fp32":
            return "precision=fp32 (no loss scaling, no master weights)"
        scaler = repr(self.scaler) if self.scaler.is_enabled() else "none"
        what = self.settings.describe(sharded=self.sharded)
        return f"precision={self.settings.preset}: {what}; loss scaler={scaler}; {self.compute_path}"

    def _compute_path(self) -> str:
        """``"<dtype>: native|emulated (why)"`` for this run's device and settings."""
        dtype = self.amp_precision
        if dtype == "fp32":
            return "fp32"
        if self._device_type != "cpu":
            return f"{dtype}: native ({self._device_type})"
        if self.emulate != "auto":
            how = "emulated (FP32 matmuls rounded once)" if self.emulating else "native CPU kernels"
            return (
                f"{dtype}: {how}, forced by emulate={self.emulate!r} (auto: {cpu_half_path(self.compute_dtype).reason})"
            )
        return f"{dtype}: {cpu_half_path(self.compute_dtype).reason}"

    # ------------------------------------------------------------------ forward / backward
    @override
    def convert_input(self, data: Any) -> Any:
        if self.amp_precision == "fp32" or self.autocast:
            return data
        return cast_floating(data, self.compute_dtype)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self._emulation(), self._autocast():
            yield

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self.forward_context():
            yield
        if self._pending_update:  # manual optimization: one scale update per iteration
            self._pending_update = False
            self._update(self._module.trainer if self._module is not None else None)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # The scaled loss is FP32 (the scale is an FP32 tensor). A loss computed in half
        # precision still receives a gradient of S in its own dtype, which overflows FP16
        # at S = 2**16: compute losses in FP32 (PreflightChecks warns otherwise).
        return super().pre_backward(self.scaler.scale(tensor), module)

    @override
    def backward(  # type: ignore[override]  # lightning.pytorch's own signature, which narrows fabric's
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        with self._emulation():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ the optimizer step
    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.amp_precision == "fp32":
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        key = id(_unwrap(optimizer))
        if key in self._stepped:  # the same optimizer again in one manual step: a new iteration
            self._pending_update = False
            self._update(model.trainer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward ran, nothing to step
        self._unscale_once(optimizer)
        shown = self._show_unscaled_model_grads(model, optimizer)
        self._after_closure(model, optimizer)
        if shown is not None:
            shown.take_edits()
        scaler = self.scaler
        result = scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self._stepped.add(key)
        self.last_nonfinite_params = self._nonfinite_params(model) if scaler.last_step_skipped else []
        if model.automatic_optimization:
            self._update(model.trainer)
        else:
            self._pending_update = True
        return result

    def _unscale_once(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients into what its step will use, once per iteration.

        Called before clipping (which may come first, from a manual ``self.clip_gradients``)
        and before the step. A disabled scaler still gives master weights their FP32 grads.
        """
        optimizer = _unwrap(optimizer)
        if id(optimizer) not in self._unscaled:
            self._unscaled.add(id(optimizer))
            self.scaler.unscale_(optimizer)

    def _show_unscaled_model_grads(self, model: Any, optimizer: Any) -> model_grads.ShownGrads | None:
        """With master weights, when a hook may read the module's ``p.grad``, the unscaled
        gradients written there (:mod:`amp_plugin.lightning.model_grads`)."""
        optimizer = _unwrap(optimizer)
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
        loop), and the step does not unscale them again.
        """
        if clip_val > 0 and self.amp_precision != "fp32":
            self._unscale_once(optimizer)
        if gradient_clip_algorithm is None:
            super().clip_gradients(optimizer, clip_val)
        else:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def _clip_gradients(
        self, model: Any, optimizer: Any, clip_val: float | None = None, gradient_clip_algorithm: Any = None
    ) -> None:
        # Lightning's own version checks for its namespace's LightningModule only; the
        # plugin serves both namespaces (amp_plugin.lightning._namespace).
        if not isinstance(model, LIGHTNING_MODULES) or not model.automatic_optimization:
            return
        trainer_calls(model)._call_lightning_module_hook(
            model.trainer,
            "configure_gradient_clipping",
            optimizer,
            gradient_clip_val=clip_val,
            gradient_clip_algorithm=gradient_clip_algorithm,
        )

    def _update(self, trainer: pl.Trainer | None) -> None:
        """``scaler.update()``; if the scale collapses, save the last good state first."""
        self._unscaled.clear()
        self._stepped.clear()
        try:
            self.scaler.update()
        except LossScaleCollapseError as err:
            if trainer is None:
                raise
            path = save_last_good(trainer)
            raise LossScaleCollapseError(err.scale, err.iteration, err.consecutive_skips, path) from None

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

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {}  # saved under CHECKPOINT_KEY by on_save_checkpoint, not under the class name

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = checkpoint_state.section(self.settings)
        if self.sharded and self.master_weights:
            checkpoint[CHECKPOINT_KEY]["master_params_in"] = "state_dict (FSDP2: the FP32 sharded parameters)"

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            checkpoint_state.restore(self.settings, saved)

    # ------------------------------------------------------------------ internals
    def _emulation(self) -> contextlib.AbstractContextManager:
        return CpuHalfEmulation(dtypes=(self.compute_dtype,)) if self.emulating else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self.compute_dtype, cache_enabled=False)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(precision={self.settings.preset!r}, scaler={self.scaler!r}, "
            f"emulate={self.emulate!r}, skip_lr_on_overflow={self.skip_lr_on_overflow})"
        )


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside a ``LightningOptimizer`` (what ``self.optimizers()`` returns)."""
    return getattr(optimizer, "_optimizer", optimizer)
