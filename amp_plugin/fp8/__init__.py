"""FP8 training for linear layers (``nn.Linear`` and ``transformers``-style ``Conv1D``), with
per-tensor or row-wise scaling (no Lightning import).

- :mod:`~amp_plugin.fp8.formats`: E4M3 and E5M2, and the saturating cast.
- :mod:`~amp_plugin.fp8.recipe`: :class:`Fp8Recipe` (Transformer Engine's scaling names) and the scale rule.
- :mod:`~amp_plugin.fp8.linear`: :class:`Fp8Module` (the FP8 state and casts) and :class:`Fp8Linear`,
  its GEMMs through ``torch._scaled_mm``.
- :mod:`~amp_plugin.fp8.conv1d`: :class:`Fp8Conv1D` (GPT-2's transposed-weight linear layer).
- :mod:`~amp_plugin.fp8.select`: which layers convert (:func:`eligible`), the BF16 reasons,
  :class:`Fp8NothingConvertedWarning`.
- :mod:`~amp_plugin.fp8.layers`: :func:`convert_to_fp8` and :class:`Fp8Layers` (step update,
  statistics, fallback, what runs in FP8, state dict).
"""

from amp_plugin.fp8.conv1d import Fp8Conv1D, is_conv1d
from amp_plugin.fp8.formats import E4M3, E5M2, FORMATS, Fp8Format, formats_for, saturating_cast
from amp_plugin.fp8.layers import Fallback, Fp8Layers, Fp8Stat, convert_to_fp8, distributed_max
from amp_plugin.fp8.linear import OPERANDS, Fp8Linear, Fp8Module
from amp_plugin.fp8.recipe import Fp8Recipe, compute_scale, max_margin, reference_scale
from amp_plugin.fp8.select import BF16_REASONS, Fp8NothingConvertedWarning, Verdict, classify, eligible

__all__ = [
    "BF16_REASONS",
    "E4M3",
    "E5M2",
    "FORMATS",
    "OPERANDS",
    "Fallback",
    "Fp8Conv1D",
    "Fp8Format",
    "Fp8Layers",
    "Fp8Linear",
    "Fp8Module",
    "Fp8NothingConvertedWarning",
    "Fp8Recipe",
    "Fp8Stat",
    "Verdict",
    "classify",
    "compute_scale",
    "convert_to_fp8",
    "distributed_max",
    "eligible",
    "formats_for",
    "is_conv1d",
    "max_margin",
    "reference_scale",
    "saturating_cast",
]
