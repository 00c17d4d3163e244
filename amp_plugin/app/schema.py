"""Structured-config schemas for ``train.py``, registered in Hydra's ConfigStore.

Each YAML file under ``configs/`` starts from one of the schemas below (its defaults list
names ``/schema_<group>@_here_``), so OmegaConf rejects a wrong type, an unknown key or a
value outside a choice while Hydra composes the config: ``scaler.init_scale=abc``,
``scaler.foo=1`` and ``precision.emulate=maybe`` never reach Python code. Ranges and
combinations are the constructors' business (:mod:`amp_plugin.app.build`).

The scaler schemas are read off the scalers' constructors (names, types, defaults), and the
choices come from the library (:data:`amp_plugin.settings.PRESETS`, :class:`~amp_plugin.settings.Emulate`),
so a new scaler setting or preset needs no change here. Nothing here imports Lightning.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from amp_plugin.app.rundir import register_resolver
from amp_plugin.fp8.recipe import AmaxComputeAlgo, Fp8FormatName, Scaling
from amp_plugin.scaling import StaticLossScaler, dynamic_scaler
from amp_plugin.scaling.dynamic_scaler import DynamicLossScaler
from amp_plugin.settings import PRESETS, Emulate, MomentsRounding

__all__ = [
    "ClipAlgorithm",
    "DynamicScalerConf",
    "FaultConf",
    "Fp8Conf",
    "HysteresisReset",
    "NoScalerConf",
    "OnMinScale",
    "PrecisionConf",
    "PresetName",
    "StaticScalerConf",
    "TrainConf",
    "TrainerConf",
    "register_configs",
]


def _choices(name: str, values: typing.Iterable[str]) -> Any:
    """A ``str`` Enum whose members are ``values`` (each member's name is its value)."""
    return Enum(name, [(v, v) for v in values], type=str, module=__name__, qualname=name)


if TYPE_CHECKING:  # built at runtime from lists (the else branch); mypy sees str Enums without members

    class PresetName(str, Enum): ...

    class ClipAlgorithm(str, Enum): ...

else:
    PresetName = _choices("PresetName", PRESETS)
    """``precision.precision``: the preset names of :data:`amp_plugin.settings.PRESETS`."""
    ClipAlgorithm = _choices("ClipAlgorithm", ("norm", "value"))
    """``trainer.gradient_clip_algorithm``: Lightning's ``GradClipAlgorithmType`` values."""

# The lists DynamicLossScaler checks these arguments against, so the two cannot drift apart.
HysteresisReset = _choices("HysteresisReset", [m.value for m in dynamic_scaler.HysteresisReset])
OnMinScale = _choices("OnMinScale", [m.value for m in dynamic_scaler.OnMinScale])  # "raise" is no Python name


def _constructor_schema(cls: type[Any], choices: dict[str, Any], exclude: tuple[str, ...] = ("enabled",)) -> type:
    """A structured config of ``cls``'s constructor arguments: their names, types and defaults.

    ``choices`` maps a ``str`` argument to the Enum that lists its values; ``exclude`` drops
    arguments a config does not set (``enabled``: no loss scaling is ``scaler=none``).
    """
    hints = typing.get_type_hints(cls.__init__)
    fields = [("_target_", str, field(default=f"{cls.__module__}.{cls.__qualname__}"))]
    for name, param in inspect.signature(cls).parameters.items():
        if name in exclude or param.kind not in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            continue
        kind = choices.get(name)
        fields.append((name, kind or hints[name], field(default=kind(param.default) if kind else param.default)))
    return dataclasses.make_dataclass(
        f"{cls.__name__.removesuffix('LossScaler')}ScalerConf",
        fields,
        namespace={"__doc__": f"Arguments of :class:`{cls.__module__}.{cls.__qualname__}` (read off its signature)."},
    )


DynamicScalerConf = _constructor_schema(
    DynamicLossScaler, {"hysteresis_reset": HysteresisReset, "on_min_scale": OnMinScale}
)
StaticScalerConf = _constructor_schema(StaticLossScaler, {})


@dataclass
class NoScalerConf:
    """``scaler=none``: no loss scaling (the plugin gets ``scaler=None``)."""


@dataclass
class Fp8Conf:
    """Arguments of :class:`amp_plugin.fp8.Fp8Recipe` (``precision=fp8``; ranges checked there)."""

    scaling: Scaling = Scaling.delayed
    fp8_format: Fp8FormatName = Fp8FormatName.hybrid
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.max
    amax_floor: float = 1e-12
    fallback_saturation: float = 0.01
    fallback_steps: int = 16
    keep_bf16: list[str] = field(default_factory=list)
    keep_first_last: bool = True
    min_features: int = 16
    multiple_of: int = 16
    reduce_amax: bool = True


@dataclass
class PrecisionConf:
    """Arguments of :meth:`amp_plugin.settings.PrecisionSettings.build` (the scaler comes from ``scaler``).

    ``master_weights``/``autocast`` null take the preset's value; a value that contradicts the
    preset is rejected by ``PrecisionSettings.build``, which names the preset that fits.
    """

    precision: PresetName = MISSING
    master_weights: Optional[bool] = None
    autocast: Optional[bool] = None
    emulate: Emulate = Emulate.auto
    skip_lr_on_overflow: bool = True
    # precision=fp8 only (configs/precision/fp8.yaml). Null for the other presets, where OmegaConf cannot set a
    # precision.fp8.* key: amp_plugin.app.overrides refuses such an override before Hydra composes the run.
    fp8: Optional[Fp8Conf] = None
    # how bf16_lean/bf16_sr store BF16 moments; "nearest" cannot shrink them at beta2 0.999 (for comparison)
    moments_rounding: MomentsRounding = MomentsRounding.stochastic


@dataclass
class TrainerConf:
    """The ``lightning.pytorch.Trainer`` arguments the app types; the Trainer checks their ranges.

    Any other Trainer argument can be added from the command line with ``+trainer.NAME=VALUE``.
    ``devices``, ``limit_*_batches`` and ``val_check_interval`` accept an int or a float (or
    ``"auto"``/a list for ``devices``), so they are typed ``Any``.
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
    log_every_n_steps: Optional[int] = None  # null: the app picks (see configs/trainer/default.yaml)
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = None
    gradient_clip_algorithm: Optional[ClipAlgorithm] = None
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
    overwrite: bool = False  # replace the outputs of a finished run in the same directory


def register_configs() -> None:
    """Store the schemas in Hydra's ConfigStore (idempotent).

    They are stored as top-level configs (``train_schema``, ``schema_precision``,
    ``schema_scaler_dynamic``, ...), not in a config group, so they never appear among the
    choices that ``--help`` or a typo's error message lists. Also registers the
    ``${amp_run_id:}`` resolver that names the default run directories.
    """
    register_resolver()
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConf)
    cs.store(name="schema_precision", node=PrecisionConf)
    cs.store(name="schema_trainer", node=TrainerConf)
    cs.store(name="schema_scaler_dynamic", node=DynamicScalerConf)
    cs.store(name="schema_scaler_static", node=StaticScalerConf)
    cs.store(name="schema_scaler_none", node=NoScalerConf)
