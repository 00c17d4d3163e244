"""``MixedPrecisionPlugin``: loss scaling and FP32 master weights as a Lightning precision plugin.

One optimizer step, in this order (written once, here)::

    closure (forward, scaled backward)
    -> unscale into FP32 master grads (one fused pass with the inf check)
    -> on_before_optimizer_step hooks and gradient clipping see unscaled FP32 grads
    -> step, or skip when a gradient is inf/NaN (all ranks agree)
    -> scale update (once per iteration, also with several optimizers)
    -> masters copied back into the half-precision model (only after a real step)

A skipped step does not advance "step"-interval LR schedulers (``skip_lr_on_overflow``).
``trainer.global_step`` counts optimizer steps *attempted*, skipped ones included, so
``max_steps`` bounds the iterations; the scheduler has then stepped
``global_step - scaler.skipped_steps`` times.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from amp_plugin.lightning._namespace import LIGHTNING_MODULES, Precision, rank_zero_info, trainer_calls
from amp_plugin._checks import check_choice
from amp_plugin.dynamic_scaler import DynamicLossScaler, LossScaleCollapseError
from amp_plugin.emulation import CpuHalfEmulation, should_emulate
from amp_plugin.half_module import cast_floating, cast_module
from amp_plugin.master_weights import MasterWeightOptimizer
from amp_plugin.scaler import LossScaler

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Optimizable

__all__ = ["MixedPrecisionPlugin", "CHECKPOINT_KEY"]

CHECKPOINT_KEY = "amp_plugin"
"""Where the plugin's state lives in a Lightning checkpoint (stable across class renames)."""

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_EMULATE = ("auto", "on", "off")


class _Default:
    def __repr__(self) -> str:
        return "<default>"


DEFAULT = _Default()


class MixedPrecisionPlugin(Precision):
    """Mixed precision for the Lightning ``Trainer``: ``Trainer(plugins=[MixedPrecisionPlugin()])``.

    Args:
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``. FP16 really is FP16, on CPU too.
        master_weights: keep the model's parameters in the half dtype (normalisation layers
            stay FP32) and let the optimizer update FP32 master copies
            (:class:`~amp_plugin.MasterWeightOptimizer`).
        autocast: run forward under ``torch.autocast`` with FP32 parameters (the FP32
            parameters are the master copy), like Lightning's ``16-mixed``.
            ``master_weights=False, autocast=False`` is pure half precision (``16-true``).
            With ``precision="fp32"`` both are ignored.
        scaler: a :class:`~amp_plugin.LossScaler`, or ``None`` for no loss scaling. The
            default is ``DynamicLossScaler()`` for fp16 and none for bf16/fp32.
        emulate: ``"auto"`` computes half-precision matmuls on CPU in FP32 and rounds the
            result (:class:`~amp_plugin.CpuHalfEmulation`, GPU Tensor Core numerics at FP32
            speed); ``"on"`` forces it; ``"off"`` uses the native (slow) CPU kernels.
        skip_lr_on_overflow: a skipped step does not advance "step"-interval LR schedulers.
    """

    def __init__(
        self,
        precision: str = "fp16",
        master_weights: bool = True,
        autocast: bool = False,
        scaler: LossScaler | None | _Default = DEFAULT,
        emulate: str = "auto",
        skip_lr_on_overflow: bool = True,
    ) -> None:
        self.amp_precision = check_choice("precision", precision, _DTYPES)
        self.compute_dtype = _DTYPES[precision]
        self.emulate = check_choice("emulate", emulate, _EMULATE)
        for name, value in (("master_weights", master_weights), ("autocast", autocast),
                            ("skip_lr_on_overflow", skip_lr_on_overflow)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} is not allowed: {name} must be True or False.")
        half = precision != "fp32"
        if half and master_weights and autocast:
            raise ValueError(
                "master_weights=True and autocast=True cannot be combined: autocast keeps FP32 "
                "parameters, which already are the master copy. Choose one (or neither for pure half)."
            )
        self.master_weights = half and master_weights
        self.autocast = half and autocast
        if scaler is DEFAULT:
            scaler = DynamicLossScaler() if precision == "fp16" else None
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise TypeError(
                f"scaler={scaler!r} is not allowed: scaler must be an amp_plugin LossScaler "
                "(DynamicLossScaler, StaticLossScaler) or None."
            )
        if scaler is not None and precision == "fp32":
            raise ValueError(
                f"scaler={scaler!r} is not allowed with precision='fp32': FP32 gradients do not "
                "underflow, so there is nothing to scale. Use scaler=None."
            )
        self.scaler: LossScaler | None = scaler
        self._scaler: LossScaler = scaler if scaler is not None else DynamicLossScaler(enabled=False)
        self.skip_lr_on_overflow = skip_lr_on_overflow
        self.precision = self._lightning_precision()
        self.last_nonfinite_params: list[tuple[str, int]] = []
        self.emulating = False
        self._device_type = "cpu"
        self._module: pl.LightningModule | None = None
        self._pending_update = False
        self._emulation_hold: Any = None
        self._described = False

    # ------------------------------------------------------------------ setup
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.amp_precision != "fp32" and not self.autocast:
            cast_module(module, self.compute_dtype, keep_norm_fp32=self.master_weights)
        return module

    @override
    def connect(
        self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Optimizer], list[Any]]:
        if self.master_weights:
            optimizers = [o if isinstance(o, MasterWeightOptimizer) else MasterWeightOptimizer(o) for o in optimizers]
        param = next(model.parameters(), None)
        self._device_type = param.device.type if param is not None else "cpu"
        if self.emulate == "on" or (self.emulate == "auto" and should_emulate(self._device_type, self.compute_dtype)):
            self.emulating = self.amp_precision != "fp32"
        if self.emulating and self._emulation_hold is None:
            # Keep the emulation kernels registered for the whole run: each forward/backward
            # context then costs a counter update instead of a kernel registration.
            self._emulation_hold = CpuHalfEmulation.keep_installed()
            self._emulation_hold.__enter__()
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        if isinstance(module, LIGHTNING_MODULES):
            self._module = module
            self._hold_schedulers_on_skip(module, lr_schedulers)
        if not self._described:  # once per plugin, not once per fit/validate stage
            self._described = True
            rank_zero_info(f"amp_plugin: {self.describe()}")
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        if self._emulation_hold is not None:
            self._emulation_hold.__exit__(None, None, None)
            self._emulation_hold = None

    def describe(self) -> str:
        """One line saying what this plugin does on this run."""
        if self.amp_precision == "fp32":
            return "precision=fp32 (no loss scaling, no master weights)"
        where = (
            "FP32 master weights, half-precision model" if self.master_weights
            else "autocast over FP32 parameters" if self.autocast else "pure half precision, no master weights"
        )
        emulation = (
            "CPU half-precision emulation on (FP32 matmul, one rounding)" if self.emulating
            else "native half-precision kernels"
        )
        return f"precision={self.amp_precision}, {where}, loss scaler={self.scaler!r}, {emulation}"

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
        if self.scaler is not None:
            # The scaled loss is FP32 (the scale is an FP32 tensor). A loss computed in half
            # precision still receives a gradient of S in its own dtype, which overflows FP16
            # at S = 2**16: compute losses in FP32 (PreflightChecks warns otherwise).
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        with self._emulation():
            super().backward(tensor, model, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ the optimizer step
    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.amp_precision == "fp32":
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError("LBFGS re-evaluates the closure inside step() and cannot be used with mixed precision.")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward ran, nothing to step
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # type: ignore[arg-type]
        elif isinstance(optimizer, MasterWeightOptimizer):
            optimizer.sync_grads()
        self._after_closure(model, optimizer)
        result = self._scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        self.last_nonfinite_params = self._nonfinite_params(model) if self._scaler.last_step_skipped else []
        if model.automatic_optimization:
            self._update(model.trainer)
        else:
            self._pending_update = True
        return result

    @override
    def _clip_gradients(
        self, model: Any, optimizer: Any, clip_val: float | None = None, gradient_clip_algorithm: Any = None
    ) -> None:
        # Lightning's own version checks for its namespace's LightningModule only; the
        # plugin serves both namespaces (amp_plugin.lightning._namespace).
        if not isinstance(model, LIGHTNING_MODULES) or not model.automatic_optimization:
            return
        trainer_calls(model)._call_lightning_module_hook(
            model.trainer, "configure_gradient_clipping", optimizer,
            gradient_clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
        )

    def _update(self, trainer: pl.Trainer | None) -> None:
        """``scaler.update()``; if the scale collapses, save the last good state first."""
        try:
            self._scaler.update()
        except LossScaleCollapseError as err:
            if trainer is None:
                raise
            path = self._save_last_good(trainer)
            raise LossScaleCollapseError(err.scale, err.iteration, err.consecutive_skips, path) from None

    @staticmethod
    def _save_last_good(trainer: pl.Trainer) -> str:
        """Skipped steps change nothing, so the current state is the last good one."""
        callback = trainer.checkpoint_callback
        directory = getattr(callback, "dirpath", None) or os.path.join(trainer.default_root_dir, "checkpoints")
        path = os.path.join(directory, "last-good.ckpt")
        trainer.save_checkpoint(path)
        return path

    def _nonfinite_params(self, model: torch.nn.Module, top: int = 5) -> list[tuple[str, int]]:
        """Names and counts of parameters with inf/NaN gradients (only run on skipped steps)."""
        named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
        if not named:
            return []
        bad = torch.stack([(~torch.isfinite(g)).sum() for _, g in named]).tolist()  # one host sync
        counts = sorted(((name, n) for (name, _), n in zip(named, bad) if n), key=lambda item: -item[1])
        return counts[:top]

    def _hold_schedulers_on_skip(self, module: pl.LightningModule, configs: list[Any]) -> None:
        """Wrap the module's ``lr_scheduler_step`` so step-interval schedulers hold on a skip.

        The wrapper is installed once per module and reads the current plugin's scaler and
        schedulers from the module at call time, so fitting the same module again with
        another plugin holds with the new one.
        """
        hold = self.skip_lr_on_overflow and self.scaler is not None
        step_interval = {id(c.scheduler) for c in configs if getattr(c, "interval", None) == "step"}
        module._amp_plugin_lr_hold = (self._scaler, step_interval) if hold else None
        if getattr(module, "_amp_plugin_lr_wrapped", False):
            return
        original = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            current = module._amp_plugin_lr_hold
            if current is not None and id(scheduler) in current[1] and current[0].last_step_skipped:
                return  # the optimizer did not step: neither does its schedule
            original(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
        module._amp_plugin_lr_wrapped = True

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {}  # saved under CHECKPOINT_KEY by on_save_checkpoint, not under the class name

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "version": 1,
            "precision": self.amp_precision,
            "master_weights": self.master_weights,
            "autocast": self.autocast,
            "scaler_type": type(self.scaler).__name__ if self.scaler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            # The FP32 masters are part of each optimizer's state dict ("master_params").
            "master_params_in": "optimizer_states[i]['master_params']" if self.master_weights else None,
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return
        ours = {
            "precision": self.amp_precision,
            "master_weights": self.master_weights,
            "autocast": self.autocast,
            "scaler_type": type(self.scaler).__name__ if self.scaler is not None else None,
        }
        differs = {k: (saved.get(k), v) for k, v in ours.items() if saved.get(k) != v}
        if differs:
            detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in differs.items())
            warnings.warn(
                f"Resuming with a different mixed-precision setup ({detail}). The model weights and "
                "optimizer state are reused; the checkpoint's loss-scaler state is "
                + ("not restored (different scaler type)." if "scaler_type" in differs else "restored."),
                stacklevel=2,
            )
        if self.scaler is not None and "scaler_type" not in differs and saved.get("scaler"):
            self._restore_scaler(saved["scaler"])

    def _restore_scaler(self, saved: dict[str, Any]) -> None:
        """Continue the checkpoint's scale and trackers under the settings configured now."""
        configured = self.scaler.state_dict()
        state, changed = dict(saved), []
        for key in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "hysteresis_reset",
                    "min_scale", "max_scale", "on_min_scale"):
            if key in state and state[key] != configured[key]:
                changed.append(f"{key}: {state[key]!r} -> {configured[key]!r}")
                state[key] = configured[key]
        self.scaler.load_state_dict(state)
        if changed:
            warnings.warn(
                "Loss-scaler settings changed since the checkpoint (" + ", ".join(changed) + "); the scale "
                "and its trackers continue from the checkpoint under the new settings.",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ internals
    def _lightning_precision(self) -> str:
        if self.amp_precision == "fp32":
            return "32-true"
        prefix = "16" if self.amp_precision == "fp16" else "bf16"
        return f"{prefix}-mixed" if self.autocast else f"{prefix}-true"

    def _emulation(self) -> contextlib.AbstractContextManager:
        return CpuHalfEmulation() if self.emulating else contextlib.nullcontext()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self._device_type, dtype=self.compute_dtype, cache_enabled=False)

    def __repr__(self) -> str:
        return (
            f"MixedPrecisionPlugin(precision={self.amp_precision!r}, master_weights={self.master_weights}, "
            f"autocast={self.autocast}, scaler={self.scaler!r}, emulate={self.emulate!r}, "
            f"skip_lr_on_overflow={self.skip_lr_on_overflow})"
        )
