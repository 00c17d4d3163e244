"""Shared by the handlers: the half dtypes, per-thread state, upcasting into reused FP32 buffers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from amp_plugin.emulation._backends import EmulationMode

__all__ = ["Handler"]


PASS = object()  # handler result meaning "not emulated, run the native kernel"
CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
# bit of each dtype in the mask the C++ kernels get (emulate.cpp's kHalfBit / kBFloat16Bit)
_DTYPE_BITS = {torch.float16: 1, torch.bfloat16: 2}

# the precision strings accepted wherever a dtype is (should_emulate, CpuHalfEmulation(dtypes=))
DTYPE_ALIASES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
    "16-true": torch.float16,
    "16-mixed": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "bf16-mixed": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "32": torch.float32,
    "32-true": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
    "64": torch.float64,
    "64-true": torch.float64,
}

# A handler gets ``call`` (runs the functional base op natively), the op's args and
# kwargs, and returns the emulated result, or PASS to let the native kernel run.
Handler = Callable[[Callable[..., Any], tuple, dict], Any]


# ----------------------------------------------------------------------------
# per-thread state
# ----------------------------------------------------------------------------


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.kernel_depth = 0  # active "kernel" backend contexts in this thread
        self.mode: EmulationMode | None = None  # mode pushed by the outermost "mode" context
        self.prev_modes: list = []
        self.counts: dict[str, int] = {}  # op name -> emulated calls in this thread
        self.scratch: dict[int, torch.Tensor] = {}  # slot -> FP32 buffer, see upcast
        self.scratch_busy = False
        self.dtype_depth: dict[torch.dtype, int] = {}  # dtype -> active contexts that emulate it
        self.emulated: frozenset = frozenset()  # the dtypes emulated now in this thread (checked by every handler)

    def add_dtypes(self, dtypes: frozenset, step: int) -> None:
        """Count ``dtypes`` in (+1) or out (-1) of the thread's emulated set."""
        depth = self.dtype_depth
        for dt in dtypes:
            depth[dt] = depth.get(dt, 0) + step
        self.emulated = frozenset(dt for dt, n in depth.items() if n > 0)

    def native_mask(self) -> int:
        """The dtypes the C++ kernels emulate in this thread: those of the active contexts
        while a "kernel" context is active, none otherwise."""
        if not self.kernel_depth:
            return 0
        return sum(_DTYPE_BITS[dt] for dt in self.emulated)

    def maybe_release_scratch(self) -> None:
        """Free the FP32 buffers once emulation is off in this thread."""
        if self.kernel_depth == 0 and self.mode is None:
            self.scratch = {}


thread_state = _ThreadState()


def count(name: str) -> None:
    counts = thread_state.counts
    counts[name] = counts.get(name, 0) + 1


# ----------------------------------------------------------------------------
# upcasting into reused FP32 buffers
# ----------------------------------------------------------------------------

# Operands at least this large (elements) are upcast into per-thread FP32 scratch
# buffers that live as long as emulation is on in the thread. A fresh large
# allocation for every upcast costs more than the conversion itself (the memory
# comes back from the OS zeroed page by page); below this size the allocator's
# free lists make a fresh tensor cheap.
SCRATCH_MIN_NUMEL = 32768


def upcast(t: torch.Tensor, slot: int, scratch: dict | None) -> torch.Tensor:
    """``t.float()``, with the same strides, written into ``scratch[slot]`` when
    ``t`` is large and dense (contiguous, or contiguous but for its last two dims
    being swapped); the caller must be done with the result before the next call."""
    n = t.numel()
    if (
        scratch is None
        or n < SCRATCH_MIN_NUMEL
        or not (t.is_contiguous() or (t.dim() >= 2 and t.transpose(-1, -2).is_contiguous()))
    ):
        return t.float()
    buf = scratch.get(slot)
    if buf is None or buf.numel() < n:
        buf = scratch[slot] = torch.empty(n, dtype=torch.float32)
    view = buf.as_strided(t.shape, t.stride())
    view.copy_(t)
    return view


def take_scratch() -> dict | None:
    state = thread_state
    if state.scratch_busy:  # an emulated op inside an emulated op: plain upcasts
        return None
    state.scratch_busy = True
    return state.scratch


def give_scratch(scratch: dict | None) -> None:
    if scratch is not None:
        thread_state.scratch_busy = False
