"""What an FP8 run does: the scaling recipe, the formats, the guard rails, which layers convert.

The scaling recipes keep Transformer Engine's names and meaning
(``transformer_engine.common.recipe.DelayedScaling`` and ``Float8CurrentScaling``):

- ``"delayed"``: each tensor (a layer's input, weight, output gradient) is cast with a scale
  computed from the amaxes (max ``|x|``) of its last ``amax_history_len`` steps, the current
  one included: ``amax = max(history)`` (``amax_compute_algo="max"``) or the latest amax
  (``"most_recent"``), then ``scale = (FP8_MAX / amax) / 2**margin``. The history is rolled
  once per optimizer step (:meth:`~amp_plugin.fp8.Fp8Layers.update`), TE's layout: the newest
  amax at row 0, rolled by -1, row 0 zeroed. The scale of step ``t`` comes from steps ``< t``,
  so a value larger than the window has seen saturates (clamped to ``FP8_MAX``).
- ``"current"``: the scale of this tensor's own amax (one more pass over it), nothing saturates.
- ``"rowwise"``: as ``"current"`` with one scale per row of each GEMM operand (per output row
  and per output column), along the contraction dimension.

Guard rails (on by default): an amax below ``amax_floor`` (torchao's 1e-12) counts as the
floor; an amax that is zero or not finite keeps the previous scale (TE's rule, so an all-zero or
NaN batch never makes an infinite scale), and a step with a non-finite amax never enters the
history (:meth:`~amp_plugin.fp8.Fp8Layers.update`); ``margin`` is bounded by :func:`max_margin`;
every scale is clamped to ``[2**-126, 2**126]``, where it and its reciprocal are normal FP32
numbers; a layer in which the fraction of saturated values of an operand exceeds
``fallback_saturation``, or a cast flushes all of an operand's non-zero values to zero, for
``fallback_steps`` steps in a row computes in BF16 from then on (logged once; ``fallback_steps=0``
turns this off). No Lightning import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from amp_plugin.checks import check_choice, check_int, check_number
from amp_plugin.fp8.formats import FORMATS, formats_for

__all__ = [
    "AMAX_ALGOS",
    "SCALE_MAX",
    "SCALE_MIN",
    "SCALINGS",
    "AmaxComputeAlgo",
    "Fp8FormatName",
    "Fp8Recipe",
    "Scaling",
    "compute_scale",
    "max_margin",
    "reference_scale",
]


class Scaling(str, Enum):
    """``scaling=``: how each tensor's scale is chosen."""

    delayed = "delayed"
    current = "current"
    rowwise = "rowwise"


class AmaxComputeAlgo(str, Enum):
    """``amax_compute_algo=``: which amax of the delayed history sets the scale."""

    max = "max"
    most_recent = "most_recent"


class Fp8FormatName(str, Enum):
    """``fp8_format=``: the formats of the forward and the gradients (:data:`~amp_plugin.fp8.FORMATS`)."""

    hybrid = "hybrid"
    e4m3 = "e4m3"


SCALINGS = tuple(m.value for m in Scaling)
AMAX_ALGOS = tuple(m.value for m in AmaxComputeAlgo)
SCALE_MIN = 2.0**-126
"""The smallest scale: FP32's smallest normal number (its reciprocal, 2**126, is normal too)."""
SCALE_MAX = 2.0**126
"""The largest scale (its reciprocal is FP32's smallest normal number)."""


def max_margin(fp8_format: str) -> int:
    """The largest ``margin`` for ``fp8_format``: with it a tensor's amax, cast to
    ``FP8_MAX / 2**margin``, is still a normal number of every format the recipe casts to
    (E4M3: ``448 / 2**14 >= 2**-6``, so 14 for both ``"hybrid"`` and ``"e4m3"``)."""
    return min(math.floor(math.log2(f.max / f.min_normal)) for f in formats_for(fp8_format))


def _check_margin(margin: object, fp8_format: str) -> None:
    if isinstance(margin, bool) or not isinstance(margin, int):
        raise TypeError(f"margin={margin!r} is not allowed: margin must be an integer (TE's meaning).")
    top = max_margin(fp8_format)
    if not 0 <= margin <= top:
        fwd = formats_for(fp8_format)[0]
        raise ValueError(
            f"margin={margin} is not allowed: margin must be an integer in [0, {top}] with "
            f"fp8_format={fp8_format!r}. Scales are divided by 2**margin, which puts a tensor's amax at "
            f"FP8_MAX / 2**margin: past {top} that is below {fwd.name.upper()}'s smallest normal number "
            f"(2**{int(math.log2(fwd.min_normal))}), so the values lose their precision and then flush to zero "
            "(the GEMMs multiply zeros); a negative margin saturates the largest values."
        )


@dataclass(frozen=True)
class Fp8Recipe:
    """The FP8 settings of a run, checked when built.

    Args:
        scaling: ``"delayed"`` (default), ``"current"`` or ``"rowwise"`` (see the module text).
        fp8_format: ``"hybrid"`` (E4M3 forward, E5M2 gradients; default) or ``"e4m3"`` (both E4M3).
        margin: an integer in ``[0, max_margin(fp8_format)]`` (14); scales are divided by
            ``2**margin`` (headroom against growth). A larger one puts a tensor's amax below the
            format's smallest normal number and flushes the values to zero: refused.
        amax_history_len: steps in the delayed amax window (TE's default, 1024).
        amax_compute_algo: ``"max"`` (default) or ``"most_recent"``.
        amax_floor: amaxes below it count as it (> 0).
        fallback_saturation: the fraction of saturated values (in [0, 1)) above which a step
            counts against a layer (as does a step with a cast that flushed all of an operand's
            non-zero values to zero).
        fallback_steps: that many such steps in a row and the layer computes in BF16 (0: never).
            The device-side counters are read every ``fallback_steps`` steps (one host sync for
            all layers), so a layer falls back at most that many steps late.
        keep_bf16: a list of ``fnmatch`` patterns of qualified module names kept in BF16 (e.g.
            ``["model.lm_head"]``, ``["*.attn.*"]``; a string is refused, not split into letters).
            :func:`~amp_plugin.fp8.convert_to_fp8` refuses a pattern that matches no linear layer.
        keep_first_last: keep the first and the last linear layer (in module order) in BF16.
        min_features: a layer whose ``in_features`` or ``out_features`` is below this stays BF16.
        multiple_of: a layer whose ``in_features`` or ``out_features`` is not a multiple of this
            stays BF16 (16: what ``torch._scaled_mm`` needs on CUDA; the CPU kernel has no such
            rule, but the same layers convert on both).
        reduce_amax: under ``torch.distributed``, all-reduce (max) the amaxes across ranks before
            each delayed scale update, as TE's ``reduce_amax``.
    """

    scaling: str = "delayed"
    fp8_format: str = "hybrid"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    amax_floor: float = 1e-12
    fallback_saturation: float = 0.01
    fallback_steps: int = 16
    keep_bf16: tuple[str, ...] = field(default_factory=tuple)
    keep_first_last: bool = True
    min_features: int = 16
    multiple_of: int = 16
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        check_choice("scaling", self.scaling, SCALINGS)
        check_choice("fp8_format", self.fp8_format, FORMATS)
        check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)
        _check_margin(self.margin, check_choice("fp8_format", self.fp8_format, FORMATS))
        check_int("amax_history_len", self.amax_history_len, ge=1)
        check_number("amax_floor", self.amax_floor, gt=0, le=1.0)
        check_number("fallback_saturation", self.fallback_saturation, ge=0, lt=1)
        check_int("fallback_steps", self.fallback_steps, ge=0)
        check_int("min_features", self.min_features, ge=1)
        check_int("multiple_of", self.multiple_of, ge=1)
        for key in ("keep_first_last", "reduce_amax"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"{key}={getattr(self, key)!r} is not allowed: {key} must be True or False.")
        keep = self.keep_bf16
        if isinstance(keep, str):
            raise TypeError(
                f"keep_bf16={keep!r} is not allowed: keep_bf16 must be a list of name patterns, not a string "
                f"(one pattern: keep_bf16=[{keep!r}])."
            )
        if isinstance(keep, Mapping) or not isinstance(keep, Iterable):
            raise TypeError(f"keep_bf16={keep!r} is not allowed: keep_bf16 must be a list of name patterns.")
        keep = tuple(keep)
        if not all(isinstance(p, str) for p in keep):
            raise TypeError(f"keep_bf16={list(keep)!r} is not allowed: keep_bf16 must be a list of name patterns.")
        object.__setattr__(self, "keep_bf16", keep)
        object.__setattr__(self, "scaling", check_choice("scaling", self.scaling, SCALINGS))
        object.__setattr__(self, "fp8_format", check_choice("fp8_format", self.fp8_format, FORMATS))
        object.__setattr__(
            self, "amax_compute_algo", check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_ALGOS)
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> Fp8Recipe:
        """A recipe from a plain mapping (a config node, ``MixedPrecisionPlugin(fp8={...})``); unknown
        keys are an error naming them. A string for ``keep_bf16`` is refused as by the constructor."""
        values = dict(values or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown FP8 setting(s) {unknown}: allowed are {sorted(known)}.")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def describe(self) -> str:
        what = f"{self.scaling} scaling"
        if self.scaling == "delayed":
            what += f" (history {self.amax_history_len}, {self.amax_compute_algo}, margin {self.margin})"
        fwd, bwd = FORMATS[self.fp8_format]
        return f"FP8 linear GEMMs ({fwd.name.upper()} forward, {bwd.name.upper()} gradients, {what})"


def compute_scale(amax: Tensor, previous: Tensor, fp8_max: float | Tensor, margin: int, amax_floor: float) -> Tensor:
    """``(fp8_max / max(amax, amax_floor)) / 2**margin`` clamped to ``[SCALE_MIN, SCALE_MAX]``,
    elementwise; where ``amax`` is zero or not finite, ``previous``. On the device, no sync."""
    amax = amax.float()
    # tensor / tensor: one correctly rounded division (``float / tensor`` is reciprocal, then multiply)
    numerator = torch.as_tensor(fp8_max, dtype=torch.float32, device=amax.device)
    scale = (numerator / amax.clamp(min=amax_floor)) / (2.0**margin)
    scale = scale.clamp(SCALE_MIN, SCALE_MAX)
    keep = ~(torch.isfinite(amax) & (amax > 0))
    return torch.where(keep, previous.float(), scale)


def reference_scale(amax: float, previous: float, fp8_max: float, margin: int, amax_floor: float) -> float:
    """:func:`compute_scale` in plain Python floats (the tests' oracle; rounded to FP32 at the end)."""
    if not (math.isfinite(amax) and amax > 0):
        return previous
    scale = (fp8_max / max(amax, amax_floor)) / 2.0**margin
    return min(max(scale, SCALE_MIN), SCALE_MAX)
