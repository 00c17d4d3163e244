"""Tensor-Core-style FP16/BF16 matmul numerics on CPU, at FP32 speed.

Why this exists
---------------
On a GPU, half-precision training is fast because Tensor Cores take FP16/BF16
inputs, multiply them exactly, accumulate the products in FP32 and round the
result to the output dtype once. A CPU without native half-precision units runs
PyTorch's FP16/BF16 GEMMs and convolutions one to two orders of magnitude slower
than FP32 (a 512x512 FP16 ``mm`` takes some 35-80x the FP32 time on x86 cores),
which makes CPU experiments with "real" half precision painfully slow.

:class:`CpuHalfEmulation` is a context manager that, for CPU tensors in FP16 or
BF16, runs the matmul family of aten ops as::

    out = op(*[t.float() for t in half_operands]).to(half_dtype)

i.e. the operands are upcast to FP32, the ordinary FP32 kernel does the work, and
the result is rounded to the input dtype exactly once. For ``mm`` this is
bit-for-bit ``(a.float() @ b.float()).to(a.dtype)``; for ``addmm`` it is
``torch.addmm(bias.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(dtype)``.

The numerics
------------
* **Half inputs are exact in FP32.** Every FP16 value (11-bit significand,
  exponents down to the subnormal 2**-24) and every BF16 value (8-bit significand,
  FP32's exponent range) is exactly representable in FP32, so the upcast loses
  nothing.
* **Products are exact.** An FP16 x FP16 product has at most 22 significant bits
  and a BF16 x BF16 product at most 16, both within FP32's 24, so the FP32 GEMM
  forms every product exactly (for BF16: unless the product leaves FP32's
  exponent range, as it would on the GPU too).
* **Accumulation is FP32.** The products are summed in FP32, as in a Tensor
  Core's FP32 accumulator. Partial sums may exceed 65504 without harm.
* **One rounding.** Only the final result is rounded (round-to-nearest-even) to
  FP16/BF16, which is what the GPU's output conversion does. A result outside
  FP16's range becomes ``inf`` (a product above 65504 gives ``inf`` in FP16),
  exactly where a GPU run would overflow.

What is reproduced is the error model (exact products, FP32 sums, one output
rounding), not the bits of one particular GPU: the order in which an FP32 GEMM
sums its products differs between any two GEMM implementations, Tensor Cores
included.

What is covered
---------------
Inside the context, when the operands are CPU tensors of one half dtype:

* ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``addmv``, ``dot``,
  ``_addmm_activation``; the ``out=`` forms of ``mm``, ``bmm``, ``addmm``,
  ``baddbmm`` and the in-place ``addmm_``, ``baddbmm_``, ``addmv_``.
  ``torch.matmul``, ``F.linear``, ``einsum``, ``tensordot``, ``nn.MultiheadAttention``
  (``need_weights=True`` path) and the RNN cells reach the dispatcher as these ops,
  so they are covered too.
* ``convolution`` and ``convolution_backward`` (all of ``F.conv1d/2d/3d`` and
  ``conv_transpose*``, any stride, padding, dilation, groups; bias gradients are
  computed inside ``convolution_backward`` in FP32 and rounded once).
* Scaled-dot-product attention: on CPU, ``F.scaled_dot_product_attention`` without
  dropout runs ``_scaled_dot_product_flash_attention_for_cpu`` and, in backward,
  ``..._backward``. Both are emulated: query/key/value (and a floating
  ``attn_mask``) are upcast, the FP32 flash kernel runs, and ``output`` (and the
  three input gradients) are rounded once; ``logsumexp`` stays FP32, as the native
  kernel returns it. The backward kernel receives the stored half ``output``
  upcast, as a GPU flash-attention backward reads the stored half output. With
  ``dropout_p > 0`` PyTorch uses the math path, which on CPU already upcasts half
  inputs to FP32 itself, so nothing is intercepted there.
* Autograd: the backward of every covered op is built from covered ops (the
  backward of ``mm`` is two ``mm`` calls on half tensors, that of ``convolution``
  is ``convolution_backward``), so gradients get the same treatment. The backward
  must run inside the context too (ops are intercepted when they execute).
  The bias gradient of ``F.linear``/``addmm`` is a plain ``sum`` and runs natively.
* ``torch.autocast("cpu", dtype=torch.float16 / torch.bfloat16)``: autocast casts
  sit above the interception point, so the ops arrive here in half and are
  emulated.
* Fused CPU fast paths (``_transformer_encoder_layer_fwd``, used by
  ``nn.TransformerEncoderLayer`` in eval mode without grad,
  ``_native_multi_head_attention``, ``_trilinear``): the ``addmm``/``bmm`` calls
  inside them are emulated, everything else in them runs natively.

What is not covered
-------------------
* Everything else runs untouched in its native half kernel: elementwise ops,
  reductions (``sum``, ``mean``), ``softmax``, ``layer_norm``, losses, optimizer
  updates. (Many of these already accumulate in FP32 internally on CPU.)
* FP32/FP64/integer tensors and non-CPU tensors are never touched; neither are
  ops with mixed operand dtypes (the native kernel raises as usual).
* ``mm.dtype``/``bmm.dtype``/``addmm.dtype``/``baddbmm.dtype`` (explicit output
  dtype), ``addbmm``, ``vdot``, ``addr`` (an outer product has nothing to
  accumulate), the ``out=`` forms not listed above, sparse, quantized and nested
  tensors.
* Emulation is per thread: ops run by other Python threads keep their native
  numerics.
* The FP32 kernels are used as configured: under
  ``torch.set_float32_matmul_precision("high"/"medium")`` oneDNN may compute FP32
  matmuls with reduced-precision internals on CPUs that support it, and the
  emulation inherits that. Keep the default ``"highest"`` for Tensor-Core numerics.

How it is intercepted (``backend=``)
------------------------------------
``"kernel"`` (the default where the installed torch offers
``torch.library.get_kernel``): while at least one thread is inside the context
(or :meth:`CpuHalfEmulation.keep_installed` is held), a small Python kernel is
registered for the CPU dispatch key of each covered op (and removed again when
the last context exits). It sits below autograd, autocast and any Python dispatch
mode, so it sees exactly the ops that reach the CPU kernels, including those
issued from inside fused C++ kernels. Ops that are
not covered never touch Python, so their cost is unchanged. A covered op checks a
thread-local flag: reached from a thread without an active context, it calls the
original kernel (a few microseconds of Python and a brief hold of the GIL while
the kernels are registered). Registering and removing the kernels costs a
fraction of a millisecond per outermost enter/exit: keep one context around a
whole step rather than around single ops, or hold
:meth:`CpuHalfEmulation.keep_installed` around code that enters many short
contexts. (Un)registering while other threads are running ops is best avoided;
hold ``keep_installed()`` in multi-threaded programs, or use the "mode" backend.

``"mode"``: a :class:`torch.utils._python_dispatch.TorchDispatchMode`, strictly
thread-local and cheap to enter. Every aten op executed in the context makes one
call into Python (a dict lookup for ops that are not covered), about ten
microseconds per op on a slow core; the fused fast-path kernels above are
re-dispatched to their CPU kernel with the mode visible so the matmuls inside
them are seen, and, under ``torch.inference_mode()`` (where composite ops such as
``matmul`` and ``conv2d`` reach the mode undecomposed), composite ops are
decomposed with the mode visible.

Both backends give bit-identical results.

Memory: large operands (32768 elements and up) are upcast into
FP32 buffers that each thread reuses while its emulation is on and frees when the
outermost context exits; a fresh multi-megabyte allocation per upcast would cost
more than the conversion. So, inside a context, the FP32 size of the largest
operands stays allocated (one buffer per operand position).
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

__all__ = ["CpuHalfEmulation", "should_emulate", "EMULATED_OPS", "HALF_DTYPES"]

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


# ----------------------------------------------------------------------------
# backend "mode": a TorchDispatchMode
# ----------------------------------------------------------------------------


class _EmulationMode(TorchDispatchMode):
    """The per-thread dispatch mode behind ``CpuHalfEmulation(backend="mode")``."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Keep ``__torch_dispatch__`` a plain method. The default wraps it in
        # ``torch._disable_dynamo``, which imports ``torch._dynamo`` (seconds) on the
        # first op and adds a frame to every op; the handlers are plain eager code
        # (dtype checks, casts, the aten call), so the wrapper buys nothing here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        op = _OPS.get(func)
        if op is not None:
            if op.handler is _transparent:
                res = _transparent(func, args, kwargs)  # the matmuls inside count themselves
            else:
                res = op.handler(op.base, args, kwargs)
                if res is not _PASS:
                    _count(op.name)
            if res is not _PASS:
                return res
        elif _is_composite(func):
            # Without autograd (inference_mode) composite ops such as matmul, linear and
            # conv2d reach the mode before they are decomposed: decompose them here, with
            # the mode visible, as the CPU backend would.
            with self:
                res = func.decompose(*args, **kwargs)
            if res is not NotImplemented:
                return res
        return func(*args, **kwargs)


_COMPOSITE: Dict[Any, bool] = {}


def _is_composite(func) -> bool:
    known = _COMPOSITE.get(func)
    if known is None:
        has = getattr(func, "has_kernel_for_dispatch_key", None)
        known = _COMPOSITE[func] = bool(
            has is not None and has(torch._C.DispatchKey.CompositeImplicitAutograd)
        )
    return known


def _active_mode() -> Optional[_EmulationMode]:
    mode = _state.mode
    if mode is not None and any(m is mode for m in _get_current_dispatch_mode_stack()):
        return mode
    return None


# ----------------------------------------------------------------------------
# backend "kernel": Python kernels for the CPU dispatch key, while in use
# ----------------------------------------------------------------------------

_KERNEL_BACKEND_AVAILABLE = hasattr(torch.library, "get_kernel") and hasattr(
    torch._C, "_dispatch_get_computed_kernel_for_dispatch_key"
)


def _make_kernel(op: _Op, original, original_base):
    handler, name = op.handler, op.name
    state = _state

    def kernel(keyset, *args, **kwargs):
        if state.kernel_depth:
            res = handler(functools.partial(original_base.call_boxed, keyset), args, kwargs)
            if res is not _PASS:
                counts = state.counts
                counts[name] = counts.get(name, 0) + 1
                return res
        return original.call_boxed(keyset, *args, **kwargs)

    return kernel


class _KernelOverrides:
    """Process-wide registration of the emulating CPU kernels, reference counted
    over the threads that have an active "kernel" context."""

    _lock = threading.Lock()
    _users = 0
    _lib: Optional[torch.library.Library] = None
    # (overload, python kernel) pairs, built once: the original kernels they fall back
    # to are looked up on first use, before any emulating kernel is registered.
    _kernels: Optional[list] = None

    @classmethod
    def acquire(cls) -> None:
        with cls._lock:
            if cls._users == 0:
                cls._lib = cls._install()
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            cls._users -= 1
            if cls._users == 0 and cls._lib is not None:
                lib, cls._lib = cls._lib, None
                lib._destroy()  # the previously registered kernels take over again

    @classmethod
    def _build_kernels(cls) -> list:
        if cls._kernels is None:
            kernels = []
            for op in _OPS.values():
                if not op.kernel:
                    continue
                original = torch.library.get_kernel(op.overload, "CPU")
                original_base = (
                    original if op.base is op.overload else torch.library.get_kernel(op.base, "CPU")
                )
                kernels.append((op.overload, _make_kernel(op, original, original_base)))
            cls._kernels = kernels
        return cls._kernels

    @classmethod
    def _install(cls) -> torch.library.Library:
        kernels = cls._build_kernels()
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": that is the point.
                warnings.simplefilter("ignore")
                for overload, kernel in kernels:
                    lib.impl(overload, kernel, "CPU", with_keyset=True)
        except BaseException:
            lib._destroy()
            raise
        return lib


class _KeepInstalled:
    """See :meth:`CpuHalfEmulation.keep_installed`."""

    def __init__(self) -> None:
        self._held = False

    def __enter__(self) -> "_KeepInstalled":
        if _KERNEL_BACKEND_AVAILABLE and not self._held:
            _KernelOverrides.acquire()
            self._held = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._held:
            self._held = False
            _KernelOverrides.release()


# ----------------------------------------------------------------------------
# the public context manager
# ----------------------------------------------------------------------------

_BACKENDS = ("auto", "kernel", "mode")


class CpuHalfEmulation:
    """Context manager: FP16/BF16 matmul-family ops on CPU compute in FP32 and
    round the result to the input dtype once (see the module docstring).

    Usage::

        with CpuHalfEmulation():
            loss = model_in_fp16(x).float().mean()
            loss.backward()          # backward inside the context, too

    Args:
        enabled: ``False`` makes the context a no-op, convenient as
            ``CpuHalfEmulation(enabled=should_emulate(device, dtype))``.
        backend: ``"kernel"`` (CPU kernels overridden while in use; no cost for ops
            that are not covered), ``"mode"`` (a ``TorchDispatchMode``; a few
            microseconds on every op), or ``"auto"`` (``"kernel"`` where the
            installed torch supports it, else ``"mode"``). Results are identical.

    * Re-entrant and nestable: nested contexts (the same instance or new ones)
      share the thread's interception, so nesting costs nothing per op; emulation
      stays on until the outermost context exits, exceptions included.
    * Harmless where there is nothing to emulate: FP32 and non-CPU tensors pass
      through untouched.
    * :attr:`emulated_calls` counts, per aten overload, the ops this instance
      emulated in its thread while it was active (nested contexts included).
    """

    def __init__(self, enabled: bool = True, backend: str = "auto") -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend={backend!r} is not allowed; expected one of {list(_BACKENDS)}")
        if backend == "auto":
            backend = "kernel" if _KERNEL_BACKEND_AVAILABLE else "mode"
        elif backend == "kernel" and not _KERNEL_BACKEND_AVAILABLE:
            raise RuntimeError(
                f"backend='kernel' needs torch.library.get_kernel (torch {torch.__version__} lacks it); "
                "use backend='mode'"
            )
        self.enabled = bool(enabled)
        self.backend = backend
        # one entry per __enter__ still open: (kind, pushed mode or None, counts snapshot or None)
        self._frames: list = []
        self._calls: Dict[str, int] = {}

    # -- context manager ------------------------------------------------------
    def __enter__(self) -> "CpuHalfEmulation":
        if not self.enabled:
            self._frames.append((None, None, None))
            return self
        state = _state
        # the first active frame of this instance takes the counts snapshot
        snapshot = None if self.active else dict(state.counts)
        if self.backend == "kernel":
            if state.kernel_depth == 0:
                _KernelOverrides.acquire()
            state.kernel_depth += 1
            self._frames.append(("kernel", None, snapshot))
            return self
        pushed = None
        if _active_mode() is None:
            pushed = _EmulationMode()
            pushed.__enter__()
            state.prev_modes.append(state.mode)
            state.mode = pushed
        self._frames.append(("mode", pushed, snapshot))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        kind, pushed, snapshot = self._frames.pop()
        if kind is None:
            return None
        state = _state
        if snapshot is not None:
            self._accumulate(state.counts, snapshot, self._calls)
        if kind == "kernel":
            state.kernel_depth -= 1
            if state.kernel_depth == 0:
                _KernelOverrides.release()
        elif pushed is not None:
            stack = _get_current_dispatch_mode_stack()
            if not stack or stack[-1] is not pushed:
                raise RuntimeError(
                    "CpuHalfEmulation exited while a torch dispatch mode entered inside it "
                    "is still active; exit contexts in reverse order"
                )
            pushed.__exit__(exc_type, exc, tb)
            state.mode = state.prev_modes.pop()
        state.maybe_release_scratch()
        return None

    @staticmethod
    def _accumulate(counts: Dict[str, int], snapshot: Dict[str, int], into: Dict[str, int]) -> None:
        for name, n in counts.items():
            d = n - snapshot.get(name, 0)
            if d:
                into[name] = into.get(name, 0) + d

    # -- introspection --------------------------------------------------------
    @property
    def active(self) -> bool:
        """True while this instance is entered (and enabled)."""
        return any(frame[0] is not None for frame in self._frames)

    @staticmethod
    def is_active() -> bool:
        """True when emulation is on in the current thread (any instance, any backend)."""
        return _state.kernel_depth > 0 or _active_mode() is not None

    @staticmethod
    def keep_installed() -> "_KeepInstalled":
        """Keep the "kernel" backend's CPU kernels registered while this is held.

        Emulation itself stays off outside a ``CpuHalfEmulation`` context; what
        changes is that entering and leaving contexts inside the hold costs a
        counter update instead of registering and removing the kernels (a fraction
        of a millisecond each time). For code that enters short contexts many times,
        e.g. one for every forward and every backward of a training run::

            with CpuHalfEmulation.keep_installed():
                for batch in loader:
                    with CpuHalfEmulation():
                        loss = step(batch)
                    with CpuHalfEmulation():
                        loss.backward()

        Also usable without ``with``: ``hold = CpuHalfEmulation.keep_installed();
        hold.__enter__()`` at setup, ``hold.__exit__(None, None, None)`` at teardown.
        While held, covered CPU ops run outside a context go through a short Python
        check before the original kernel (a few microseconds per matmul call). A no-op
        where the "kernel" backend is unavailable.
        """
        return _KeepInstalled()

    @property
    def emulated_calls(self) -> Dict[str, int]:
        """``{"aten.mm.default": n, ...}``: ops this instance emulated so far."""
        calls = dict(self._calls)
        for kind, _, snapshot in self._frames:
            if snapshot is not None:
                self._accumulate(_state.counts, snapshot, calls)
        return calls

    def reset_counts(self) -> None:
        """Forget :attr:`emulated_calls` (restarts counting from now)."""
        self._calls.clear()
        now = dict(_state.counts)
        self._frames = [
            (kind, pushed, now if snapshot is not None else None)
            for kind, pushed, snapshot in self._frames
        ]

    def __repr__(self) -> str:
        return f"CpuHalfEmulation(enabled={self.enabled}, backend={self.backend!r}, active={self.active})"


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------

_DTYPE_ALIASES = {
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


def should_emulate(
    device: Union[torch.device, str, int, None], dtype: Union[torch.dtype, str]
) -> bool:
    """True when :class:`CpuHalfEmulation` applies: a CPU device and FP16/BF16.

    ``device``: a ``torch.device``, a string (``"cpu"``, ``"cuda:0"``), an int
    (a CUDA ordinal) or None (the current default device). ``dtype``: a
    ``torch.dtype`` or a precision string (``"fp16"``, ``"bf16"``, ``"16-mixed"``,
    ``"bf16-true"``, ``"fp32"``, ...). This is what ``emulate="auto"`` decides on.
    """
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key not in _DTYPE_ALIASES:
            raise ValueError(
                f"unknown precision {dtype!r}; expected a torch.dtype or one of "
                f"{sorted(_DTYPE_ALIASES)}"
            )
        dtype = _DTYPE_ALIASES[key]
    elif not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")
    if device is None:
        device = torch.get_default_device()
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    return device.type == "cpu" and dtype in _HALF
