"""The two FP8 formats, and the saturating cast into them.

============ ===================== ========= ============== ================ =====================
format       torch dtype           max       smallest normal smallest subnormal beyond max
============ ===================== ========= ============== ================ =====================
E4M3 (FN)    ``float8_e4m3fn``     448       2**-6          2**-9            no inf: saturates here
E5M2         ``float8_e5m2``       57344     2**-14         2**-16           IEEE: rounds to inf
============ ===================== ========= ============== ================ =====================

E4M3 has 3 mantissa bits and no infinities ("FN": finite, one NaN pattern); E5M2 has 2 mantissa
bits and follows IEEE 754 (a value past 57344 + half an ulp is inf). :func:`saturating_cast`
clamps to ``[-max, max]`` first, so both formats saturate the same way and only a NaN stays a
NaN (it must reach the loss-scaler and NaN checks). Rounding is to nearest, ties to even; a value
below half the smallest subnormal flushes to zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["E4M3", "E5M2", "FORMATS", "Fp8Format", "formats_for", "saturating_cast"]


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format.

    Attributes:
        name: ``"e4m3"`` or ``"e5m2"``.
        dtype: the torch dtype.
        exponent_bits, mantissa_bits, bias: the encoding.
        max: the largest finite value.
        min_normal: the smallest normal value.
        min_subnormal: the smallest positive value.
    """

    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def saturation_threshold(self) -> float:
        """``max`` plus half its ulp: a scaled value of larger magnitude is saturated (clamped);
        one at or below it rounds to ``max`` or less on its own (E4M3: 464, E5M2: 61440)."""
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits - 1)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 4, 3, 7, 448.0)
"""E4M3FN: the forward format (activations and weights)."""
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 5, 2, 15, 57344.0)
"""E5M2: the gradient format of the ``"hybrid"`` recipe (wider range, one mantissa bit less)."""

FORMATS = {"hybrid": (E4M3, E5M2), "e4m3": (E4M3, E4M3)}
"""``fp8_format`` -> (forward format, gradient format), Transformer Engine's ``Format`` names."""


def formats_for(fp8_format: str) -> tuple[Fp8Format, Fp8Format]:
    """(forward, gradient) formats of ``fp8_format`` (``"hybrid"`` or ``"e4m3"``)."""
    if fp8_format not in FORMATS:
        raise ValueError(f"fp8_format={fp8_format!r} is not allowed: use one of {sorted(FORMATS)}.")
    return FORMATS[fp8_format]


def saturating_cast(x: Tensor, fmt: Fp8Format) -> Tensor:
    """``x`` (already multiplied by its scale) in ``fmt``: clamped to ``[-max, max]``, then
    rounded to nearest even. NaN stays NaN; ``inf`` becomes ``max``."""
    return x.clamp(-fmt.max, fmt.max).to(fmt.dtype)
