"""What is emulated and how: the upcast, the per-op handlers, the op table, per-thread state."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch

if TYPE_CHECKING:
    from amp_plugin.emulation._backends import _EmulationMode


HALF_DTYPES: frozenset = frozenset({torch.float16, torch.bfloat16})
"""The dtypes :class:`CpuHalfEmulation` emulates."""

_HALF = HALF_DTYPES
_PASS = object()  # handler result meaning "not emulated, run the native kernel"
_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

aten = torch.ops.aten

# A handler gets ``call`` (runs the functional base op natively), the op's args and
# kwargs, and returns the emulated result, or _PASS to let the native kernel run.
Handler = Callable[[Callable[..., Any], tuple, dict], Any]


# ----------------------------------------------------------------------------
# upcasting into reused FP32 buffers
# ----------------------------------------------------------------------------

# Operands at least this large (elements) are upcast into per-thread FP32 scratch
# buffers that live as long as emulation is on in the thread. A fresh large
# allocation for every upcast costs more than the conversion itself (the memory
# comes back from the OS zeroed page by page); below this size the allocator's
# free lists make a fresh tensor cheap.
_SCRATCH_MIN_NUMEL = 32768


def _upcast(t: torch.Tensor, slot: int, scratch: Optional[dict]) -> torch.Tensor:
    """``t.float()``, with the same strides, written into ``scratch[slot]`` when
    ``t`` is large and dense (contiguous, or contiguous but for its last two dims
    being swapped); the caller must be done with the result before the next call."""
    n = t.numel()
    if (
        scratch is None
        or n < _SCRATCH_MIN_NUMEL
        or not (t.is_contiguous() or (t.dim() >= 2 and t.transpose(-1, -2).is_contiguous()))
    ):
        return t.float()
    buf = scratch.get(slot)
    if buf is None or buf.numel() < n:
        buf = scratch[slot] = torch.empty(n, dtype=torch.float32)
    view = buf.as_strided(t.shape, t.stride())
    view.copy_(t)
    return view


def _take_scratch() -> Optional[dict]:
    state = _state
    if state.scratch_busy:  # an emulated op inside an emulated op: plain upcasts
        return None
    state.scratch_busy = True
    return state.scratch


def _give_scratch(scratch: Optional[dict]) -> None:
    if scratch is not None:
        _state.scratch_busy = False


# ----------------------------------------------------------------------------
# handlers
# ----------------------------------------------------------------------------


def _binary(call, args, kwargs):
    """mm, bmm, mv, dot: ``(a, b)``."""
    a, b = args
    dt = a.dtype
    if dt in _HALF and a.is_cpu and b.dtype is dt and not kwargs:
        scratch = _take_scratch()
        try:
            return call(_upcast(a, 0, scratch), _upcast(b, 1, scratch)).to(dt)
        finally:
            _give_scratch(scratch)
    return _PASS


def _ternary(call, args, kwargs):
    """addmm, baddbmm, addmv, _addmm_activation: ``(self, m1, m2, *, beta, alpha)``."""
    c, a, b = args
    dt = a.dtype
    if dt in _HALF and a.is_cpu and b.dtype is dt and c.dtype is dt:
        scratch = _take_scratch()
        try:
            return call(_upcast(c, 2, scratch), _upcast(a, 0, scratch), _upcast(b, 1, scratch), **kwargs).to(dt)
        finally:
            _give_scratch(scratch)
    return _PASS


def _generic(operands: Tuple[int, ...], optional_kw: Tuple[str, ...], round_outputs) -> Handler:
    """Handler for ops with more arguments (convolution, SDPA).

    ``operands``: positional indices that must all have the half dtype (or be None).
    ``optional_kw``: keyword tensors upcast when they have the half dtype.
    ``round_outputs``: None for a single tensor result, else the indices of the
    result tuple to round (other entries are returned as the kernel gave them).
    """
    first = operands[0]

    def handler(call, args, kwargs):
        x = args[first]
        dt = x.dtype
        if dt not in _HALF or not x.is_cpu:
            return _PASS
        for i in operands:
            t = args[i]
            if t is not None and t.dtype is not dt:
                return _PASS
        scratch = _take_scratch()
        try:
            new_args = list(args)
            for i in operands:
                if args[i] is not None:
                    new_args[i] = _upcast(args[i], i, scratch)
            if optional_kw and kwargs:
                kwargs = dict(kwargs)
                for j, k in enumerate(optional_kw):
                    t = kwargs.get(k)
                    if t is not None and t.dtype is dt:
                        kwargs[k] = _upcast(t, 100 + j, scratch)
            out = call(*new_args, **kwargs)
        finally:
            _give_scratch(scratch)
        if round_outputs is None:
            return out.to(dt)
        out = list(out)
        for i in round_outputs:
            if out[i] is not None:
                out[i] = out[i].to(dt)
        return tuple(out)

    return handler


def _out_variant(base_handler: Handler) -> Handler:
    """``op.out(..., out=t)``: emulate the functional op, then copy into ``out``."""

    def handler(call, args, kwargs):
        out = kwargs.get("out")
        if out is None:
            return _PASS
        rest = {k: v for k, v in kwargs.items() if k != "out"}
        res = base_handler(call, args, rest)
        if res is _PASS or out.dtype is not res.dtype or not out.is_cpu:
            return _PASS
        if out.shape != res.shape:
            out.resize_(res.shape)
        out.copy_(res)
        return out

    return handler


def _inplace_variant(base_handler: Handler) -> Handler:
    """``op_(self, ...)``: emulate the functional op, then copy into ``self``."""

    def handler(call, args, kwargs):
        res = base_handler(call, args, kwargs)
        if res is _PASS or args[0].dtype is not res.dtype:
            return _PASS
        args[0].copy_(res)
        return args[0]

    return handler


def _transparent(call, args, kwargs):
    """(mode backend) Fused CPU kernels that call matmuls internally: run the CPU
    kernel with the mode re-entered, so the matmuls inside are emulated and the
    rest runs natively. ``call`` is the op itself here."""
    x = args[0]
    mode = _state.mode
    if (
        mode is None
        or x.dtype not in _HALF
        or not x.is_cpu
        or x.is_nested
        or x.layout is not torch.strided
    ):
        return _PASS
    with mode:
        return call.redispatch(_CPU_KEYSET, *args, **kwargs)


class _Op:
    """One intercepted aten overload."""

    __slots__ = ("name", "overload", "base", "handler", "kernel")

    def __init__(self, name: str, overload, base, handler: Handler, kernel: bool) -> None:
        self.name = name  # "aten.mm.out"
        self.overload = overload  # the OpOverload intercepted
        self.base = base  # the functional OpOverload the handler's ``call`` runs
        self.handler = handler
        self.kernel = kernel  # registered by the "kernel" backend


def _build_ops() -> Dict[Any, _Op]:
    ops: Dict[Any, _Op] = {}

    def overload(packet: str, name: str):
        pk = getattr(aten, packet, None)
        return getattr(pk, name, None) if pk is not None else None

    def add(packet: str, handler: Handler, out: bool = True, inplace: bool = False, kernel: bool = True):
        base = overload(packet, "default")
        if base is None:  # op missing in this torch build
            return
        variants = [(base, handler)]
        if out and (op := overload(packet, "out")) is not None:
            variants.append((op, _out_variant(handler)))
        if inplace and (op := overload(packet + "_", "default")) is not None:
            variants.append((op, _inplace_variant(handler)))
        for op, h in variants:
            ops[op] = _Op(str(op), op, base, h, kernel)

    # out= forms only where PyTorch's own C++ code uses them (bmm.out: fused attention)
    for name in ("mm", "bmm"):
        add(name, _binary)
    for name in ("mv", "dot"):
        add(name, _binary, out=False)
    for name in ("addmm", "baddbmm"):
        add(name, _ternary, inplace=True)
    add("addmv", _ternary, out=False, inplace=True)
    add("_addmm_activation", _ternary, out=False)
    add("convolution", _generic((0, 1, 2), (), None), out=False)
    add("convolution_backward", _generic((0, 1, 2), (), (0, 1, 2)), out=False)
    add(
        "_scaled_dot_product_flash_attention_for_cpu",
        _generic((0, 1, 2), ("attn_mask",), (0,)),
        out=False,
    )
    add(
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        _generic((0, 1, 2, 3, 4), ("attn_mask",), (0, 1, 2)),
        out=False,
    )
    # The kernel backend sees the matmuls inside these directly (they go through the
    # dispatcher to the CPU kernels); the mode backend has to re-dispatch them.
    for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention", "_trilinear"):
        add(name, _transparent, out=False, kernel=False)
    return ops


_OPS: Dict[Any, _Op] = _build_ops()

EMULATED_OPS: frozenset = frozenset(op.name for op in _OPS.values() if op.handler is not _transparent)
"""Names (``"aten.mm.default"`` style) of the aten overloads that
:class:`CpuHalfEmulation` computes in FP32 and rounds."""


# ----------------------------------------------------------------------------
# per-thread state
# ----------------------------------------------------------------------------


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.kernel_depth = 0  # active "kernel" backend contexts in this thread
        self.mode: Optional[_EmulationMode] = None  # mode pushed by the outermost "mode" context
        self.prev_modes: list = []
        self.counts: Dict[str, int] = {}  # op name -> emulated calls in this thread
        self.scratch: Dict[int, torch.Tensor] = {}  # slot -> FP32 buffer, see _upcast
        self.scratch_busy = False

    def maybe_release_scratch(self) -> None:
        """Free the FP32 buffers once emulation is off in this thread."""
        if self.kernel_depth == 0 and self.mode is None:
            self.scratch = {}


_state = _ThreadState()


def _count(name: str) -> None:
    counts = _state.counts
    counts[name] = counts.get(name, 0) + 1
