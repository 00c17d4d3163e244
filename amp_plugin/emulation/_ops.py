"""What is emulated and how: the per-op handlers and the op table."""

from __future__ import annotations

from typing import Any

import torch

from amp_plugin.emulation._attention import sdpa_backward, sdpa_forward
from amp_plugin.emulation._common import (  # noqa: F401  (re-exported for the backends and tests)
    CPU_KEYSET,
    PASS,
    SCRATCH_MIN_NUMEL,
    Handler,
    count,
    give_scratch,
    take_scratch,
    thread_state,
    upcast,
)

aten = torch.ops.aten


# ----------------------------------------------------------------------------
# handlers
# ----------------------------------------------------------------------------


def _binary(call, args, kwargs):
    """mm, bmm, mv, dot: ``(a, b)``."""
    a, b = args
    dt = a.dtype
    if dt in thread_state.emulated and a.is_cpu and b.dtype is dt and not kwargs:
        scratch = take_scratch()
        try:
            return call(upcast(a, 0, scratch), upcast(b, 1, scratch)).to(dt)
        finally:
            give_scratch(scratch)
    return PASS


def _ternary(call, args, kwargs):
    """addmm, baddbmm, addmv, _addmm_activation: ``(self, m1, m2, *, beta, alpha)``."""
    c, a, b = args
    dt = a.dtype
    if dt in thread_state.emulated and a.is_cpu and b.dtype is dt and c.dtype is dt:
        scratch = take_scratch()
        try:
            return call(upcast(c, 2, scratch), upcast(a, 0, scratch), upcast(b, 1, scratch), **kwargs).to(dt)
        finally:
            give_scratch(scratch)
    return PASS


def _generic(operands: tuple[int, ...], round_outputs: tuple[int, ...]) -> Handler:
    """Handler for ops with more arguments (convolution_backward, the oneDNN RNN layer).

    ``operands``: positional indices that must all have the half dtype (or be None; the
    first must be a tensor). ``round_outputs``: the indices of the result tuple to round
    (other entries are returned as the kernel gave them).
    """
    first = operands[0]

    def handler(call, args, kwargs):
        x = args[first]
        dt = x.dtype
        if dt not in thread_state.emulated or not x.is_cpu:
            return PASS
        for i in operands:
            t = args[i]
            if t is not None and t.dtype is not dt:
                return PASS
        scratch = take_scratch()
        try:
            new_args = list(args)
            for i in operands:
                if args[i] is not None:
                    new_args[i] = upcast(args[i], i, scratch)
            out = list(call(*new_args, **kwargs))
        finally:
            give_scratch(scratch)
        for i in round_outputs:
            if out[i] is not None:
                out[i] = out[i].to(dt)
        return tuple(out)

    return handler


def _convolution(call, args, kwargs):
    """convolution ``(input, weight, bias, stride, padding, dilation, transposed,
    output_padding, groups)``: as cuDNN does it, the convolution is computed in FP32 and
    rounded to the half dtype, then the bias is added in the half dtype (an elementwise
    add of two half tensors, correctly rounded, as the GPU's ``output.add_(bias)``)."""
    x, w, b = args[0], args[1], args[2]
    dt = x.dtype
    if dt not in thread_state.emulated or not x.is_cpu or w.dtype is not dt or (b is not None and b.dtype is not dt):
        return PASS
    scratch = take_scratch()
    try:
        out = call(upcast(x, 0, scratch), upcast(w, 1, scratch), None, *args[3:], **kwargs).to(dt)
    finally:
        give_scratch(scratch)
    if b is not None:
        out.add_(b.reshape((1, -1) + (1,) * (out.dim() - 2)))
    return out


def _out_variant(base_handler: Handler) -> Handler:
    """``op.out(..., out=t)``: emulate the functional op, then copy into ``out``."""

    def handler(call, args, kwargs):
        out = kwargs.get("out")
        if out is None:
            return PASS
        rest = {k: v for k, v in kwargs.items() if k != "out"}
        res = base_handler(call, args, rest)
        if res is PASS or out.dtype is not res.dtype or not out.is_cpu:
            return PASS
        if out.shape != res.shape:
            out.resize_(res.shape)
        out.copy_(res)
        return out

    return handler


def _inplace_variant(base_handler: Handler) -> Handler:
    """``op_(self, ...)``: emulate the functional op, then copy into ``self``."""

    def handler(call, args, kwargs):
        res = base_handler(call, args, kwargs)
        if res is PASS or args[0].dtype is not res.dtype:
            return PASS
        args[0].copy_(res)
        return args[0]

    return handler


def transparent(call, args, kwargs):
    """(mode backend) Fused CPU kernels that call matmuls internally: run the CPU
    kernel with the mode re-entered, so the matmuls inside are emulated and the
    rest runs natively. ``call`` is the op itself here."""
    x = args[0]
    mode = thread_state.mode
    if mode is None or x.dtype not in thread_state.emulated or not x.is_cpu:
        return PASS
    if x.is_nested or x.layout is not torch.strided:
        return PASS
    with mode:
        return call.redispatch(CPU_KEYSET, *args, **kwargs)


class Op:
    """One intercepted aten overload."""

    __slots__ = ("base", "handler", "kernel", "name", "overload")

    def __init__(self, name: str, overload, base, handler: Handler, kernel: bool) -> None:
        self.name = name  # "aten.mm.out"
        self.overload = overload  # the OpOverload intercepted
        self.base = base  # the functional OpOverload the handler's ``call`` runs
        self.handler = handler
        self.kernel = kernel  # registered by the "kernel" backend


def _build_ops() -> dict[Any, Op]:
    ops: dict[Any, Op] = {}

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
            ops[op] = Op(str(op), op, base, h, kernel)

    # out= forms only where PyTorch's own C++ code uses them (bmm.out: fused attention)
    for name in ("mm", "bmm"):
        add(name, _binary)
    for name in ("mv", "dot"):
        add(name, _binary, out=False)
    for name in ("addmm", "baddbmm"):
        add(name, _ternary, inplace=True)
    add("addmv", _ternary, out=False, inplace=True)
    add("_addmm_activation", _ternary, out=False)
    add("convolution", _convolution, out=False)
    add("convolution_backward", _generic((0, 1, 2), (0, 1, 2)), out=False)
    add("_scaled_dot_product_flash_attention_for_cpu", sdpa_forward, out=False)
    add("_scaled_dot_product_flash_attention_for_cpu_backward", sdpa_backward, out=False)
    # nn.LSTM/GRU/RNN where torch hands them to oneDNN (FP32 always; BF16 on CPUs with
    # AVX512-BW/VL/DQ or AVX-NE-CONVERT; FP16 without grad on CPUs with oneDNN FP16): the
    # whole layer runs in FP32 and its outputs (and, in backward, its gradients) are rounded.
    add("mkldnn_rnn_layer", _generic(tuple(range(7)), (0, 1, 2)), out=False)
    add("mkldnn_rnn_layer_backward", _generic(tuple(range(13)), tuple(range(7))), out=False)
    # The kernel backend sees the matmuls inside these directly (they go through the
    # dispatcher to the CPU kernels); the mode backend has to re-dispatch them.
    for name in ("_transformer_encoder_layer_fwd", "_native_multi_head_attention", "_trilinear"):
        add(name, transparent, out=False, kernel=False)
    return ops


OPS: dict[Any, Op] = _build_ops()

EMULATED_OPS: frozenset = frozenset(op.name for op in OPS.values() if op.handler is not transparent)
"""Names (``"aten.mm.default"`` style) of the aten overloads that
:class:`CpuHalfEmulation` computes in FP32 and rounds."""
