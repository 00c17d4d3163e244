"""Structured-config schemas for ``train.py``, registered in Hydra's ConfigStore.

Each YAML file under ``configs/`` starts from one of the dataclasses below (its defaults list
names ``/schema_<group>@_here_``), so OmegaConf rejects a wrong type or an unknown
key while Hydra composes the config: ``scaler.init_scale=abc`` or ``scaler.foo=1`` never
reach Python code. What a type cannot say (ranges, choices, contradictions) is checked by
:func:`amp_plugin.app.validation.validate`.

Nothing here imports Lightning, so a bad command line fails in a fraction of the time a
training run takes to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

__all__ = [
    "DynamicScalerConf",
    "FAULT_STEP_KEYS",
    "FaultConf",
    "NoScalerConf",
    "PRESETS",
    "PrecisionConf",
    "StaticScalerConf",
    "TrainConf",
    "TrainerConf",
    "register_configs",
]

@dataclass
class PrecisionConf:
    """Arguments of :class:`amp_plugin.lightning.MixedPrecisionPlugin` (the scaler comes from ``scaler``)."""

    _target_: str = "amp_plugin.lightning.MixedPrecisionPlugin"
    name: str = "custom"  # preset name; a known preset's keys must keep their meaning
    precision: str = "fp16"  # fp16 | bf16 | fp32: dtype of the model's weights and activations
    master_weights: bool = True  # the optimizer updates FP32 copies of half-precision weights
    autocast: bool = False  # FP32 weights, forward under torch.autocast instead
    emulate: str = "auto"  # auto | on | off: CPU half matmuls computed in FP32, rounded once
    skip_lr_on_overflow: bool = True  # a skipped step does not advance step-wise LR schedulers


@dataclass
class DynamicScalerConf:
    """Arguments of :class:`amp_plugin.DynamicLossScaler` (defaults: torch's GradScaler)."""

    _target_: str = "amp_plugin.DynamicLossScaler"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    hysteresis_reset: str = "growth"
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    on_min_scale: str = "raise"


@dataclass
class StaticScalerConf:
    """Arguments of :class:`amp_plugin.StaticLossScaler`."""

    _target_: str = "amp_plugin.StaticLossScaler"
    scale: float = 2.0**16


@dataclass
class NoScalerConf:
    """No loss scaling: the plugin gets ``scaler=None``."""


@dataclass
class TrainerConf:
    """The ``lightning.pytorch.Trainer`` arguments the app types and range-checks.

    Any other Trainer argument can be added from the command line with ``+trainer.NAME=VALUE``.
    ``devices``, ``limit_*_batches`` and ``val_check_interval`` accept an int or a float (or
    ``"auto"``/a list for ``devices``), so they are typed ``Any`` and checked by :func:`validate`.
    """

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "auto"
    devices: Any = 1
    num_nodes: int = 1
    strategy: str = "auto"
    max_steps: int = -1
    max_epochs: Optional[int] = None
    min_steps: Optional[int] = None
    max_time: Optional[str] = None
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    val_check_interval: Any = None
    check_val_every_n_epoch: Optional[int] = 1
    num_sanity_val_steps: Optional[int] = None
    log_every_n_steps: Optional[int] = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: Optional[str] = None
    deterministic: Optional[bool] = None
    benchmark: Optional[bool] = None
    enable_progress_bar: Optional[bool] = None
    enable_model_summary: Optional[bool] = None


@dataclass
class FaultConf:
    """Arguments of :class:`amp_plugin.callbacks.FaultInjector`; all null means no injector.

    Every field is null by default, so both ``fault.inject_inf_at=[3,7]`` and Hydra's
    ``+fault.inject_inf_at=[3,7]`` work. Steps are ``trainer.global_step`` values (0-based
    optimizer steps, skipped ones included).
    """

    inject_inf_at: Optional[list[int]] = None  # steps whose gradient gets +inf
    inject_nan_at: Optional[list[int]] = None  # steps whose gradient gets a NaN
    nan_loss_at: Optional[list[int]] = None  # steps whose loss becomes NaN before backward
    nan_input_at: Optional[list[int]] = None  # steps whose batch gets a NaN (float inputs only)
    inject_inf_from: Optional[int] = None  # every step from this one on gets +inf (persistent overflow)
    param: Optional[str] = None  # the parameter to corrupt; null = the first with a gradient
    rank: Optional[int] = None  # the only global rank that injects; null = every rank


FAULT_STEP_KEYS = ("inject_inf_at", "inject_nan_at", "nan_loss_at", "nan_input_at", "inject_inf_from")
"""The ``fault`` keys that make the injector do something (``param`` and ``rank`` only refine them)."""


@dataclass
class TrainConf:
    """The primary config (``configs/train.yaml``)."""

    precision: PrecisionConf = MISSING
    scaler: Any = MISSING  # DynamicScalerConf | StaticScalerConf | NoScalerConf
    recipe: Any = MISSING  # a LightningModule's arguments plus its _target_
    trainer: TrainerConf = MISSING
    logger: Any = None
    callbacks: Any = None
    seed: int = 0
    num_threads: Optional[int] = None  # torch.set_num_threads for the run; None keeps PyTorch's default
    ckpt_path: Optional[str] = None
    fault: FaultConf = field(default_factory=FaultConf)
    output_dir: str = "${hydra:runtime.output_dir}"
    plot: bool = True


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent).

    They are stored as top-level configs (``train_schema``, ``schema_precision``,
    ``schema_scaler_dynamic``, ...), not in a config group, so they never appear among the
    choices that ``--help`` or a typo's error message lists.
    """
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConf)
    cs.store(name="schema_precision", node=PrecisionConf)
    cs.store(name="schema_trainer", node=TrainerConf)
    cs.store(name="schema_scaler_dynamic", node=DynamicScalerConf)
    cs.store(name="schema_scaler_static", node=StaticScalerConf)
    cs.store(name="schema_scaler_none", node=NoScalerConf)


# ---------------------------------------------------------------------------------- presets
PRESETS: dict[str, tuple[str, bool, bool]] = {
    # name: (precision, master_weights, autocast)
    "fp32": ("fp32", False, False),
    "fp16": ("fp16", True, False),
    "bf16": ("bf16", True, False),
    "fp16_autocast": ("fp16", False, True),
    "bf16_autocast": ("bf16", False, True),
    "fp16_pure": ("fp16", False, False),
    "bf16_pure": ("bf16", False, False),
}
"""What each ``configs/precision`` preset means; overriding a key against it is an error."""
