"""What a mixed-precision run does, decided once: dtype, master weights, autocast, loss scaler.

:class:`PrecisionSettings` owns every rule about these arguments and the scaler default. The
Lightning plugin and the Hydra app both build one, so a preset means the same thing in
``MixedPrecisionPlugin("fp16_autocast")`` as in ``python train.py precision=fp16_autocast``,
and a bad combination gets the same message in both. No Lightning import.

The presets themselves (:data:`PRESETS`, :class:`Preset`) are in :mod:`amp_plugin.presets`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Literal

import torch

from amp_plugin.checks import check_choice
from amp_plugin.fp8.recipe import Fp8Recipe
from amp_plugin.presets import DTYPES, PRESETS, Emulate, MomentsRounding, Preset, preset_name
from amp_plugin.scaling import LossScaler, StaticLossScaler
from amp_plugin.scaling.dynamic_scaler import DynamicLossScaler

__all__ = [
    "PRESETS",
    "SCALER_TYPES",
    "Emulate",
    "MomentsRounding",
    "PrecisionSettings",
    "Preset",
    "no_loss_scaling",
    "preset_name",
]

SCALER_TYPES: dict[str, type[LossScaler] | None] = {
    "dynamic": DynamicLossScaler,
    "static": StaticLossScaler,
    "none": None,
}
"""The scaler types a settings mapping may name with ``"type"`` (``scaler={"type": "dynamic", ...}``)."""

ScalerArg = LossScaler | Mapping[str, Any] | Literal["auto"] | None
"""What ``scaler=`` takes: ``"auto"``, ``None``, a scaler, or a mapping of its settings
(see :meth:`PrecisionSettings.build`)."""


def no_loss_scaling() -> LossScaler:
    """The scaler of a run without loss scaling: a pass-through with the scaler interface
    (``scale`` returns its input, ``step`` steps, the scale reads 1.0, nothing is skipped)."""
    return LossScaler(1.0, enabled=False)


def _value(x: Any) -> Any:
    return x.value if isinstance(x, Enum) else x


def _bool_or_none(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} is not allowed: {name} must be True, False or None (the preset's value).")
    return value


@dataclass(frozen=True)
class PrecisionSettings:
    """A validated mixed-precision setup. Build it with :meth:`build`.

    Attributes:
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``: the compute dtype.
        master_weights: half-precision model parameters, FP32 masters in the optimizer.
        autocast: FP32 parameters, forward under ``torch.autocast``.
        scaler: the loss scaler; a disabled one (:func:`no_loss_scaling`) means no scaling.
        emulate: ``"auto"``, ``"on"`` or ``"off"`` (see :class:`Emulate`).
        skip_lr_on_overflow: skipped steps do not advance step-interval LR schedulers.
        master: how the optimizer stores the masters: ``"fp32"``, ``"bf16_split"`` (the BF16
            weight plus a 16-bit remainder) or ``"stochastic"`` (none: stochastic rounding).
        moments: ``"fp32"`` or ``"bf16"``: the dtype of Adam's moments.
        moments_rounding: how BF16 moments are stored: ``"stochastic"`` (the default, which follows
            FP32 moments for any beta) or ``"nearest"`` (which cannot shrink a moment at a beta above
            ``1 - 2**-9``; kept for comparison). Nothing to do with FP32 moments.
        fp8: the :class:`~amp_plugin.fp8.Fp8Recipe` of the ``fp8`` preset, else None.
    """

    precision: str
    master_weights: bool
    autocast: bool
    scaler: LossScaler
    emulate: str = "auto"
    skip_lr_on_overflow: bool = True
    master: str = "fp32"
    moments: str = "fp32"
    fp8: Fp8Recipe | None = None
    moments_rounding: str = "stochastic"

    @classmethod
    def build(
        cls,
        precision: str = "fp16",
        master_weights: bool | None = None,
        autocast: bool | None = None,
        scaler: ScalerArg = "auto",
        emulate: str = "auto",
        skip_lr_on_overflow: bool = True,
        fp8: Fp8Recipe | dict[str, Any] | None = None,
        moments_rounding: str = "stochastic",
    ) -> PrecisionSettings:
        """Check the arguments and fill in the defaults.

        Args:
            precision: a preset name (:data:`PRESETS`: ``"fp16"``, ``"bf16_autocast"``, ...).
                ``"fp16"``/``"bf16"`` with ``autocast=True`` mean the autocast preset, with
                ``master_weights=False`` the pure one.
            master_weights: ``None`` takes the preset's value; a value that contradicts a
                preset with "autocast" or "pure" in its name is an error naming the preset
                that fits.
            autocast: ``None`` takes the preset's value (see ``master_weights``).
            scaler: ``"auto"`` (dynamic for FP16, none for BF16/FP32), ``None`` for no loss
                scaling, a :class:`~amp_plugin.LossScaler`, or a mapping of scaler settings
                without a class (what a YAML file holds): ``{"hysteresis": 2}`` is merged into
                the preset's own scaler, so one config serves every FP16 preset; ``"type"``
                names the scaler (``{"type": "dynamic", "hysteresis": 2}``, one of
                :data:`SCALER_TYPES`), which is required where the preset runs none (BF16, FP32).
            emulate: ``"auto"``, ``"on"`` or ``"off"``.
            skip_lr_on_overflow: whether skipped steps hold step-interval LR schedulers.
            fp8: the FP8 settings of ``precision="fp8"`` (an :class:`~amp_plugin.fp8.Fp8Recipe` or
                its arguments as a mapping; ``None``: the defaults). Other presets refuse it.
            moments_rounding: ``"stochastic"`` or ``"nearest"``: how the BF16 moments of
                ``bf16_lean``/``bf16_sr`` are stored (see :class:`~amp_plugin.MasterWeightOptimizer`).

        Raises:
            ValueError: an unknown preset, a contradiction, a scaler with FP32, scaler settings
                for a preset that runs no scaler and name none, a setting the scaler does not take.
            TypeError: a value of the wrong type.
        """
        name = check_choice("precision", _value(precision), PRESETS)
        master_weights = _bool_or_none("master_weights", master_weights)
        autocast = _bool_or_none("autocast", autocast)
        if not isinstance(skip_lr_on_overflow, bool):
            raise TypeError(f"skip_lr_on_overflow={skip_lr_on_overflow!r} is not allowed: it must be True or False.")
        emulate = check_choice("emulate", _value(emulate), [e.value for e in Emulate])
        roundings = [r.value for r in MomentsRounding]
        moments_rounding = check_choice("moments_rounding", _value(moments_rounding), roundings)
        preset = PRESETS[name]
        if preset.precision == "fp32":
            resolved = preset  # nothing to keep in FP32 or to autocast: both flags are ignored
        elif name in ("fp16", "bf16") and autocast and master_weights is None:
            resolved = PRESETS[f"{name}_autocast"]  # asked for autocast: the FP32 weights are the masters
        else:
            resolved = Preset(
                preset.precision,
                preset.master_weights if master_weights is None else master_weights,
                preset.autocast if autocast is None else autocast,
                preset.master if master_weights is not False else "fp32",
                preset.moments if master_weights is not False else "fp32",
                preset.fp8 and master_weights is not False,
            )
        if resolved.master_weights and resolved.autocast:
            raise ValueError(
                "master_weights=True and autocast=True cannot be combined: autocast keeps FP32 parameters, "
                f"which already are the master copy. Use precision={preset.precision!r} (half weights, FP32 masters) "
                f"or precision='{preset.precision}_autocast' (FP32 weights under autocast)."
            )
        if name not in ("fp16", "bf16", "fp32") and resolved != preset:
            key = "master_weights" if resolved.master_weights != preset.master_weights else "autocast"
            fitting = preset_name(resolved)
            raise ValueError(
                f"{key}={getattr(resolved, key)!r} contradicts precision={name!r}, which means "
                f"{key}={getattr(preset, key)!r} ({preset.describe()}). For that combination use "
                f"precision={fitting!r}."
            )
        if fp8 is not None and not resolved.fp8:
            raise ValueError(
                f"fp8={fp8!r} is not allowed with precision={name!r}: FP8 settings apply to precision='fp8' only."
            )
        recipe = fp8 if isinstance(fp8, Fp8Recipe) or fp8 is None else None
        if isinstance(fp8, dict):
            recipe = Fp8Recipe.from_dict(fp8)
        elif fp8 is not None and recipe is None:
            raise TypeError(f"fp8={fp8!r} is not allowed: fp8 must be an Fp8Recipe, a dict of its arguments or None.")
        if resolved.fp8 and recipe is None:
            recipe = Fp8Recipe()
        return cls(
            precision=resolved.precision,
            master_weights=resolved.master_weights,
            autocast=resolved.autocast,
            master=resolved.master,
            moments=resolved.moments,
            scaler=_resolve_scaler(scaler, resolved.precision, preset_name(resolved)),
            emulate=emulate,
            skip_lr_on_overflow=skip_lr_on_overflow,
            fp8=recipe,
            moments_rounding=moments_rounding,
        )

    # ------------------------------------------------------------------ derived
    def _preset(self) -> Preset:
        return Preset(
            self.precision,  # type: ignore[arg-type]
            self.master_weights,
            self.autocast,
            self.master,  # type: ignore[arg-type]
            self.moments,  # type: ignore[arg-type]
            self.fp8 is not None,
        )

    @property
    def preset(self) -> str:
        """The preset name these settings amount to."""
        return preset_name(self._preset())

    @property
    def moments_dtype(self) -> torch.dtype:
        """``MasterWeightOptimizer``'s ``moments_dtype``: ``torch.float32`` or ``torch.bfloat16``."""
        return DTYPES[self.moments]

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    @property
    def scaling(self) -> str:
        """``"dynamic"``, ``"static"``, ``"none"`` or the scaler's class name."""
        if not self.scaler.is_enabled():
            return "none"
        if isinstance(self.scaler, DynamicLossScaler):
            return "dynamic"
        if isinstance(self.scaler, StaticLossScaler):
            return "static"
        return type(self.scaler).__name__

    @property
    def lightning_precision(self) -> str:
        """The Lightning ``precision=`` string with the same dtype layout."""
        if self.precision == "fp32":
            return "32-true"
        prefix = "16" if self.precision == "fp16" else "bf16"
        return f"{prefix}-mixed" if self.autocast else f"{prefix}-true"

    def with_scaler(self, scaler: ScalerArg) -> PrecisionSettings:
        """The same settings with another scaler (``None``: no loss scaling), checked as in :meth:`build`."""
        return replace(self, scaler=_resolve_scaler(scaler, self.precision, self.preset))

    def describe(self, emulating: bool = False, sharded: bool = False) -> str:
        """What a run with these settings does, in a few words; ``sharded``: under FSDP2, where the
        FP32 sharded parameters are the master weights."""
        text = self._preset().describe(short=True)
        if sharded and self.master_weights:
            text = f"{self.precision.upper()} compute, FSDP2: the FP32 sharded parameters are the master weights"
            if self.moments == "bf16":
                text += ", BF16 Adam moments"
        if self.moments == "bf16" and self.moments_rounding == "nearest":
            text += " rounded to nearest"
        scaling = self.scaling
        if scaling == "none":
            text += ", no loss scaling"
        elif scaling == "static":
            text += f", static loss scale {self.scaler.get_scale():g}"
        else:
            text += f", {scaling} loss scaling"
        return text + (", CPU half-precision emulation" if emulating else "")


def _resolve_scaler(scaler: Any, precision: str, preset: str) -> LossScaler:
    if isinstance(scaler, str) and scaler == "auto":
        return DynamicLossScaler() if precision == "fp16" else no_loss_scaling()
    if scaler is None:
        return no_loss_scaling()
    if isinstance(scaler, Mapping):
        scaler = _scaler_from_settings(dict(scaler), precision, preset)
    if not isinstance(scaler, LossScaler):
        raise TypeError(
            f"scaler={scaler!r} is not allowed: scaler must be 'auto', None (no loss scaling), an amp_plugin "
            "LossScaler (DynamicLossScaler, StaticLossScaler) or a mapping of scaler settings such as "
            "{'hysteresis': 2}."
        )
    if precision == "fp32" and scaler.is_enabled():
        raise ValueError(
            f"scaler={scaler!r} is not allowed with precision='fp32': FP32 gradients do not underflow, so there "
            "is nothing to scale. Use scaler=None."
        )
    return scaler


def _scaler_from_settings(settings: dict[Any, Any], precision: str, preset: str) -> LossScaler:
    """A scaler from a mapping of its settings: ``"type"`` names it, or the preset's own is meant."""
    shown = dict(settings)
    kind = settings.pop("type", None)
    if kind is None:
        if precision == "fp16":
            kind = "dynamic"  # the FP16 presets' own scaler
        elif settings:
            hint = (
                "FP32 gradients do not underflow, so there is nothing to scale: drop the settings."
                if precision == "fp32"
                else f"Name a scaler type to add one (scaler={{'type': 'dynamic', ...}}; types: "
                f"{', '.join(SCALER_TYPES)}), or drop the settings."
            )
            raise ValueError(
                f"scaler={shown!r} is not allowed with precision={preset!r}: that preset runs no loss scaler, so "
                f"there is nothing for {', '.join(map(str, settings))} to set. {hint}"
            )
        else:
            return no_loss_scaling()
    kind = check_choice("scaler.type", kind, SCALER_TYPES)
    cls = SCALER_TYPES[kind]
    allowed = [] if cls is None else [n for n in inspect.signature(cls).parameters if n != "enabled"]
    unknown = [key for key in settings if key not in allowed]
    if unknown:
        raise ValueError(
            f"scaler.{unknown[0]}={settings[unknown[0]]!r} is not allowed: it is not a setting of a {kind} scaler"
            + (f" ({cls.__name__}); its settings are {', '.join(allowed)}." if cls else ": type 'none' takes none.")
        )
    return no_loss_scaling() if cls is None else cls(**settings)
