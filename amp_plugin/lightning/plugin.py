"""``MixedPrecisionPlugin``: loss scaling and FP32 master weights as a Lightning precision plugin.

One optimizer step, in this order (written once, here)::

    closure (forward, scaled backward)
    -> inf check and unscale (FP32 master grads made only where something reads them)
    -> on_before_optimizer_step hooks see unscaled grads: FP32 in the optimizer's param
       groups, and, when a hook may read them, the module's own p.grad too (unscaled,
       rounded to the half type); what a hook changed there reaches the step
    -> configure_gradient_clipping: Lightning's clipping clips the FP32 master grads, then
       the module's p.grad shows the clipped values; what the hook changes there after
       that reaches the step too (lightning/model_grads.py, docs/lightning_hooks.md)
    -> step, or skip when a gradient is inf/NaN (all ranks agree)
    -> scale update (once per iteration, also with several optimizers)
    -> masters copied back into the half-precision model (only after a real step)

The hooks that run it are the plugin's base class, :class:`~amp_plugin.lightning.step.OptimizerStepHooks`.

Under FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) the sharded
FP32 parameters are the master weights: no :class:`~amp_plugin.MasterWeightOptimizer` is built,
each unit gets the preset's ``MixedPrecisionPolicy`` (:mod:`amp_plugin.fsdp`), the scaler
unscales each rank's shards and all ranks agree on the skip. With BF16 moments (``bf16_lean``,
``bf16_sr``) the Adam/AdamW is wrapped in :class:`~amp_plugin.fsdp_moments.Bf16MomentsAdam`.

A skipped step does not advance "step"-interval LR schedulers (``skip_lr_on_overflow``,
:mod:`amp_plugin.lightning.lr_hold`). ``trainer.global_step`` counts optimizer steps
*attempted*, skipped ones included, so ``max_steps`` bounds the iterations; the scheduler has
then stepped ``global_step - scaler.skipped_steps`` times.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin import fsdp
from amp_plugin.emulation import CpuHalfEmulation
from amp_plugin.fp8 import Fp8Layers, Fp8Recipe, convert_to_fp8
from amp_plugin.half_module import cast_floating, cast_module
from amp_plugin.lightning import checkpoint_state
from amp_plugin.lightning.checkpoint_state import CHECKPOINT_KEY
from amp_plugin.lightning.compute import compute_path, default_dtype, wants_emulation
from amp_plugin.lightning.finetuning import FinetuningAdapter
from amp_plugin.lightning.namespace import LIGHTNING_MODULES, rank_zero_info, rank_zero_warn
from amp_plugin.lightning.optimizers import wrap_optimizers
from amp_plugin.lightning.step import OptimizerStepHooks
from amp_plugin.master_weights import MasterWeightOptimizer
from amp_plugin.settings import PrecisionSettings, ScalerArg

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR

__all__ = ["CHECKPOINT_KEY", "MixedPrecisionPlugin"]


class MixedPrecisionPlugin(OptimizerStepHooks):
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
        fp8: with ``precision="fp8"``, an :class:`~amp_plugin.fp8.Fp8Recipe` (or its arguments as a
            dict); ``None``: the defaults. The eligible ``nn.Linear`` layers are converted in
            ``convert_module`` and their scales updated once per optimizer step (docs/fp8.md).
        moments_rounding: ``"stochastic"`` (default) or ``"nearest"``: how ``bf16_lean``/``bf16_sr``
            store their BF16 Adam moments (``"nearest"`` cannot shrink a moment at torch's default
            beta2 and warns; kept for comparison).

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
        fp8_layers: the model's :class:`~amp_plugin.fp8.Fp8Layers` with ``precision="fp8"``
            (known once fitting starts), else None.
    """

    def __init__(
        self,
        precision: str = "fp16",
        master_weights: bool | None = None,
        autocast: bool | None = None,
        scaler: ScalerArg = "auto",
        emulate: str = "auto",
        skip_lr_on_overflow: bool = True,
        fp8: Fp8Recipe | dict[str, Any] | None = None,
        moments_rounding: str = "stochastic",
    ) -> None:
        super().__init__()  # the optimizer step's state (lightning/step.py)
        self.settings = PrecisionSettings.build(
            precision,
            master_weights,
            autocast,
            scaler,
            emulate,
            skip_lr_on_overflow,
            fp8,
            moments_rounding,
        )
        self.fp8_layers: Fp8Layers | None = None
        # what Lightning's `trainer.precision` reports ("32-true", "16-mixed", "bf16-true", ...)
        self.precision = cast("_PRECISION_INPUT_STR", self.settings.lightning_precision)
        self.emulating = False
        self.compute_path = ""
        self.sharded = False
        self._bf16_moment_params: list[Tensor] = []  # FSDP2 with moments="bf16": the half-gathered shards
        self._device_type = "cpu"
        self._module: Any = None
        self._emulation_hold: Any = None
        self._described = False
        self._finetuning = FinetuningAdapter()

    @classmethod
    def from_settings(cls, settings: PrecisionSettings) -> MixedPrecisionPlugin:
        """A plugin for already validated settings (what the app builds before importing Lightning)."""
        plugin = cls(
            settings.preset,
            None,
            None,
            settings.scaler,
            settings.emulate,
            settings.skip_lr_on_overflow,
            settings.fp8,
            settings.moments_rounding,
        )
        return plugin

    # ------------------------------------------------------------------ settings
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
            if self.settings.master != "fp32":
                moments = "BF16" if self.settings.moments == "bf16" else "FP32"
                rank_zero_warn(
                    f"precision={self.settings.preset!r} under FSDP2 keeps FP32 master weights: the sharded FP32 "
                    f"parameters are the master weights, so there is no BF16 master to split or round "
                    f"(master={self.settings.master!r} does not apply); Adam's moments are {moments}."
                )
            if self.settings.moments == "bf16":
                self._bf16_moment_params = fsdp.half_gathered_params(module)
            if self.amp_precision != "fp32" and not self.master_weights and not self.autocast:
                module.to(self.compute_dtype)  # pure half: the shards themselves become half
        elif self.amp_precision != "fp32" and not self.autocast:
            cast_module(module, self.compute_dtype, keep_norm_fp32=self.master_weights)
        if self.settings.fp8 is not None:
            if self.sharded:
                raise ValueError("precision='fp8' does not support FSDP2 yet: use DDP or a single device.")
            self.fp8_layers = convert_to_fp8(module, self.settings.fp8)
        return module

    @override
    def connect(
        self, model: torch.nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Optimizer], list[Any]]:
        optimizers = wrap_optimizers(model, optimizers, self.settings, self.sharded, self._bf16_moment_params)
        param = next(model.parameters(), None)
        self._device_type = param.device.type if param is not None else "cpu"
        if wants_emulation(self.emulate, self._device_type, self.compute_dtype):
            self.emulating = self.amp_precision != "fp32"
        self.compute_path = compute_path(self.settings, self._device_type, self.emulating)
        if self.emulating and self._emulation_hold is None:
            # Keep the emulation kernels registered for the whole run: each forward/backward
            # context then costs a counter update instead of a kernel registration.
            self._emulation_hold = CpuHalfEmulation.keep_installed()
            self._emulation_hold.__enter__()
        module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self._module = module if isinstance(module, LIGHTNING_MODULES) else None
        if self.skip_lr_on_overflow:
            manual = self._module is not None and not self._module.automatic_optimization
            self._lr_hold.attach(lr_schedulers, manual=manual)
        if self._module is not None and any(isinstance(o, MasterWeightOptimizer) for o in optimizers):
            self._finetuning.attach(getattr(self._module._trainer, "callbacks", ()))
        self._hooks_read_model_grads = None
        if not self._described:  # once per plugin, not once per fit/validate stage
            self._described = True
            rank_zero_info(f"amp_plugin: {self.describe()}")
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        self._lr_hold.detach()
        self._finetuning.detach()
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

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Pure half presets create tensors (and ``configure_model``'s modules) in the half dtype, as
        Lightning's ``16-true``/``bf16-true``: no FP32 copy first, so no FP32 peak. The others create
        FP32 tensors: the masters, and the FP32 parameters under autocast, start from FP32 values."""
        if self.amp_precision == "fp32" or self.master_weights or self.autocast:
            return contextlib.nullcontext()
        return default_dtype(self.compute_dtype)

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

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

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return {}  # saved under CHECKPOINT_KEY by on_save_checkpoint, not under the class name

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.amp_precision == "fp32" and not self.scaler.is_enabled():
            return  # nothing to restore: the checkpoint is the one Lightning's "32-true" writes
        checkpoint[CHECKPOINT_KEY] = checkpoint_state.section(self.settings)
        if self.sharded and self.master_weights:
            checkpoint[CHECKPOINT_KEY]["master_params_in"] = "state_dict (FSDP2: the FP32 sharded parameters)"
        if self.fp8_layers is not None:
            checkpoint[CHECKPOINT_KEY]["fp8"] = self.fp8_layers.state_dict()
        if self._lr_hold.counts_frequencies:
            checkpoint[CHECKPOINT_KEY]["lr_hold"] = self._lr_hold.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is not None:
            checkpoint_state.restore(self.settings, saved)
            if "lr_hold" in saved:
                self._lr_hold.load_state_dict(saved["lr_hold"])
        if saved is not None and self.fp8_layers is not None and saved.get("fp8") is not None:
            self.fp8_layers.load_state_dict(saved["fp8"])

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
