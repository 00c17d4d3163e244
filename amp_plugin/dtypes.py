"""The half-precision dtypes and FP16's limits, named once for the whole package."""

from __future__ import annotations

import torch

__all__ = ["FP16_MAX", "FP16_MIN_NORMAL", "HALF_DTYPES"]

HALF_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
"""The half-precision floating-point dtypes: FP16 and BF16."""

FP16_MAX = float(torch.finfo(torch.float16).max)
"""The largest finite FP16 value: 65504."""

FP16_MIN_NORMAL = float(torch.finfo(torch.float16).tiny)
"""The smallest normal FP16 value, 2**-14 (about 6.1e-5); below it FP16 is subnormal, then zero."""
