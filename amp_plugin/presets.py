"""The named presets of a mixed-precision run (:data:`PRESETS`) and what each one is; what a run
does with them (the scaler default, the checks of a combination) is :class:`amp_plugin.settings.PrecisionSettings`'s.

============== ======== ============== ======== ============== ==========================
preset         dtype    master weights autocast default scaler like Lightning's
============== ======== ============== ======== ============== ==========================
``fp32``       FP32     -              -        none           ``32-true``
``fp16``       FP16     yes            no       dynamic        (no equivalent)
``bf16``       BF16     yes            no       none           (no equivalent)
``fp16_autocast`` FP16  no             yes      dynamic        ``16-mixed``
``bf16_autocast`` BF16  no             yes      none           ``bf16-mixed``
``fp16_pure``  FP16     no             no       dynamic        ``16-true``
``bf16_pure``  BF16     no             no       none           ``bf16-true``
``bf16_split`` BF16     yes, split     no       none           (no equivalent)
``bf16_lean``  BF16     yes, split     no       none           (no equivalent)
``bf16_sr``    BF16     no (stoch.)    no       none           (no equivalent)
``fp8``        FP8+BF16 yes            no       none           (Transformer Engine)
============== ======== ============== ======== ============== ==========================

Training state per parameter with AdamW: 16 bytes for ``fp16``/``bf16`` (weight 2, gradient 2,
FP32 master 4, FP32 moments 8, as Lightning's ``bf16-mixed``), 14 for ``bf16_split``, 10 for
``bf16_lean``, 8 for ``bf16_sr`` (as ``bf16_pure``/``bf16-true``, but with updates that land).

``bf16_split`` keeps each FP32 master as the BF16 weight (the master rounded to nearest) plus a
signed 16-bit remainder (``MasterWeightOptimizer(..., master="bf16_split")``): the FP32 master's
update bit for bit. ``bf16_lean`` adds BF16 moments (``moments_dtype=torch.bfloat16``: computed
in FP32, rounded stochastically once when stored, so they decay as FP32 moments do at any beta).
``bf16_sr`` keeps no master: the BF16 weight is updated in
FP32 and written back with stochastic rounding (``master="stochastic"``), plus BF16 moments.
The three take any optimizer: Adam/AdamW the fused step, the others their own step over the
FP32 values (see ``docs/master_weights.md``).

``fp8`` is ``bf16`` with the GEMMs of ``nn.Linear`` layers in FP8 (E4M3 forward, E5M2 gradients by
default), with per-tensor or row-wise scaling; its settings are an :class:`~amp_plugin.fp8.Fp8Recipe`
(``fp8=``; see :mod:`amp_plugin.fp8`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

import torch

__all__ = ["DTYPES", "PRESETS", "Emulate", "MomentsRounding", "Preset", "preset_name"]

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Emulate(str, Enum):
    """``emulate=``: CPU half-precision matmuls computed in FP32 and rounded once."""

    auto = "auto"  # where the CPU has no faithful native kernel that is faster
    on = "on"
    off = "off"


class MomentsRounding(str, Enum):
    """``moments_rounding=``: how BF16 Adam moments are stored."""

    stochastic = "stochastic"  # follows FP32 moments on average, for any beta
    nearest = "nearest"  # cannot shrink a moment at a beta above 1 - 2**-9 (for comparison)


@dataclass(frozen=True)
class Preset:
    """One named setup: the dtype, whether the optimizer keeps FP32 masters, whether the
    forward runs under ``torch.autocast``."""

    precision: Literal["fp16", "bf16", "fp32"]
    master_weights: bool
    autocast: bool
    master: Literal["fp32", "bf16_split", "stochastic"] = "fp32"  # how the masters are stored
    moments: Literal["fp32", "bf16"] = "fp32"  # the dtype of Adam's moments (MasterWeightOptimizer's moments_dtype)
    fp8: bool = False  # nn.Linear GEMMs in FP8 (amp_plugin.fp8)

    def describe(self, short: bool = False) -> str:
        """The preset in words; ``short`` for a summary line."""
        dtype = self.precision.upper()
        if self.precision == "fp32":
            text, detail = "FP32 weights and compute", "plain FP32 training"
        elif self.master_weights:
            text = f"{dtype} weights and compute, FP32 master weights"
            if self.master == "bf16_split":
                text += " kept as the BF16 weight and a 16-bit remainder"
            if self.master == "stochastic":
                text = f"{dtype} weights and compute, no master weights: stochastically rounded updates"
            if self.moments == "bf16":
                text += ", BF16 Adam moments"
            detail = text + (" in the optimizer" if self.master != "stochastic" else "")
            if self.fp8:
                text = "FP8 linear GEMMs, " + text
                detail = "FP8 nn.Linear GEMMs (E4M3/E5M2 with per-tensor scales), " + detail
        elif self.autocast:
            text = detail = f"FP32 weights, {dtype} compute under autocast"
        else:
            text = f"pure {dtype}, no FP32 master weights"
            detail = f"pure {dtype}: weights, gradients and updates all in {dtype}, no FP32 copy"
        return text if short else detail


PRESETS: dict[str, Preset] = {
    "fp32": Preset("fp32", False, False),
    "fp16": Preset("fp16", True, False),
    "bf16": Preset("bf16", True, False),
    "fp16_autocast": Preset("fp16", False, True),
    "bf16_autocast": Preset("bf16", False, True),
    "fp16_pure": Preset("fp16", False, False),
    "bf16_pure": Preset("bf16", False, False),
    "bf16_split": Preset("bf16", True, False, master="bf16_split"),
    "bf16_lean": Preset("bf16", True, False, master="bf16_split", moments="bf16"),
    "bf16_sr": Preset("bf16", True, False, master="stochastic", moments="bf16"),
    "fp8": Preset("bf16", True, False, fp8=True),
}
"""Every preset by name (the ``precision=`` values of the app and of the plugin)."""


def preset_name(preset: Preset) -> str:
    """The name of the preset equal to ``preset``."""
    return next(name for name, value in PRESETS.items() if value == preset)
