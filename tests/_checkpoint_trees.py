"""Comparing two checkpoints bit for bit: the reliability harness's ``differences`` (tensors by dtype,
shape and every bit), shared by the resume, signal and DDP tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "reliability"))

from reliability_harness import differences

__all__ = ["differences"]
