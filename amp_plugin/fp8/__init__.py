"""FP8 training for ``nn.Linear`` layers, with per-tensor or row-wise scaling (no Lightning import).

- :mod:`~amp_plugin.fp8.formats`: E4M3 and E5M2, and the saturating cast.
- :mod:`~amp_plugin.fp8.recipe`: :class:`Fp8Recipe` (Transformer Engine's scaling names) and the scale rule.
- :mod:`~amp_plugin.fp8.linear`: :class:`Fp8Linear`, its GEMMs through ``torch._scaled_mm``.
- :mod:`~amp_plugin.fp8.layers`: :func:`convert_to_fp8` and :class:`Fp8Layers` (step update,
  statistics, fallback, state dict).
"""

from amp_plugin.fp8.formats import E4M3, E5M2, FORMATS, Fp8Format, formats_for, saturating_cast
from amp_plugin.fp8.layers import Fallback, Fp8Layers, Fp8Stat, convert_to_fp8, distributed_max, eligible
from amp_plugin.fp8.linear import OPERANDS, Fp8Linear
from amp_plugin.fp8.recipe import Fp8Recipe, compute_scale, reference_scale

__all__ = [
    "E4M3",
    "E5M2",
    "FORMATS",
    "OPERANDS",
    "Fallback",
    "Fp8Format",
    "Fp8Layers",
    "Fp8Linear",
    "Fp8Recipe",
    "Fp8Stat",
    "compute_scale",
    "convert_to_fp8",
    "distributed_max",
    "eligible",
    "formats_for",
    "reference_scale",
    "saturating_cast",
]
