"""The two ways of intercepting the covered ops: a dispatch mode, or CPU kernels registered while in use.

The "kernel" backend registers Python kernels, except for ``mm``, ``addmm``, ``bmm`` and
``baddbmm`` (the ops ``F.linear``, ``torch.matmul`` and their backward reach), which get the
C++ kernels of ``amp_plugin/fused/emulate.cpp`` when :mod:`amp_plugin.fused` is built: the same
computation without entering Python on every call (a 64x64 by 64x128 ``F.linear`` costs about
30 us emulated instead of 95, against 25 in FP32). Each thread's emulated dtypes (a mask) and
call counts then live in C++ too; :func:`native_sync` brings them in line with ``thread_state``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from amp_plugin.emulation._common import PASS, count, thread_state
from amp_plugin.emulation._ops import OPS, Op, transparent

# ----------------------------------------------------------------------------
# backend "mode": a TorchDispatchMode
# ----------------------------------------------------------------------------


class EmulationMode(TorchDispatchMode):
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
        op = OPS.get(func)
        if op is not None:
            if op.handler is transparent:
                res = transparent(func, args, kwargs)  # the matmuls inside count themselves
            else:
                res = op.handler(op.base, args, kwargs)
                if res is not PASS:
                    count(op.name)
            if res is not PASS:
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


_COMPOSITE: dict[Any, bool] = {}


def _is_composite(func) -> bool:
    known = _COMPOSITE.get(func)
    if known is None:
        has = getattr(func, "has_kernel_for_dispatch_key", None)
        known = _COMPOSITE[func] = bool(has is not None and has(torch._C.DispatchKey.CompositeImplicitAutograd))
    return known


def active_mode() -> EmulationMode | None:
    mode = thread_state.mode
    if mode is not None and any(m is mode for m in _get_current_dispatch_mode_stack()):
        return mode
    return None


# ----------------------------------------------------------------------------
# backend "kernel": Python kernels for the CPU dispatch key, while in use
# ----------------------------------------------------------------------------

KERNEL_BACKEND_AVAILABLE = hasattr(torch.library, "get_kernel") and hasattr(
    torch._C, "_dispatch_get_computed_kernel_for_dispatch_key"
)


def _make_kernel(op: Op, original, original_base):
    handler, name = op.handler, op.name
    state = thread_state

    def kernel(keyset, *args, **kwargs):
        if state.kernel_depth:
            res = handler(functools.partial(original_base.call_boxed, keyset), args, kwargs)
            if res is not PASS:
                counts = state.counts
                counts[name] = counts.get(name, 0) + 1
                return res
        return original.call_boxed(keyset, *args, **kwargs)

    return kernel


# ----------------------------------------------------------------------------
# backend "kernel", C++ part
# ----------------------------------------------------------------------------

USE_NATIVE_KERNELS = True
"""Use the C++ kernels for the ops in :data:`NATIVE_OPS` when they are built (read whenever
the kernels are registered; tests turn it off to exercise the Python kernels)."""

_NATIVE_NAMES = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
)  # emulate.cpp's order
NATIVE_OPS = frozenset(op for op in OPS if str(op) in _NATIVE_NAMES)


def _native_ops() -> Any:
    if not USE_NATIVE_KERNELS:
        return None
    from amp_plugin import fused  # builds the kernels on first use

    ops = fused.kernels()
    return ops if ops is not None and hasattr(ops, "emulation_sync") else None


def native_kernels_available() -> bool:
    """Whether the "kernel" backend runs ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` in the C++
    kernels of :mod:`amp_plugin.fused` (they are built, and :func:`python_kernels_only` is not in
    effect). Builds the kernels on first use."""
    return _native_ops() is not None


@contextlib.contextmanager
def python_kernels_only() -> Iterator[None]:
    """Inside: the "kernel" backend registers its Python kernels for every covered op, not the
    C++ ones (what runs where :mod:`amp_plugin.fused` cannot be built), to compare the two. The
    choice is made when the kernels are registered (the outermost context's enter, or
    :meth:`CpuHalfEmulation.keep_installed`), so enter this first. Process-wide, not per thread."""
    global USE_NATIVE_KERNELS
    saved, USE_NATIVE_KERNELS = USE_NATIVE_KERNELS, False
    try:
        yield
    finally:
        USE_NATIVE_KERNELS = saved


def native_sync(mask: int | None = None) -> None:
    """Add the C++ kernels' call counts in this thread to ``thread_state.counts`` (and reset them);
    ``mask`` sets the dtypes they emulate in this thread (``thread_state.native_mask()``: 1 FP16,
    2 BF16, 0 none: off). A no-op without them."""
    ops = KernelOverrides.native
    if ops is None:
        return
    counts = ops.emulation_sync(mask)[: len(_NATIVE_NAMES)]  # then the number of buffers held
    if any(counts):
        into = thread_state.counts
        for name, n in zip(_NATIVE_NAMES, counts):
            if n:
                into[name] = into.get(name, 0) + n


class KernelOverrides:
    """Process-wide registration of the emulating CPU kernels, reference counted
    over the threads that have an active "kernel" context."""

    _lock = threading.Lock()
    _users = 0
    _lib: torch.library.Library | None = None
    # (overload, python kernel) pairs, built once: the original kernels they fall back
    # to are looked up on first use, before any emulating kernel is registered.
    _kernels: list | None = None
    native: Any = None  # torch.ops.amp_plugin while its C++ kernels are registered

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
                if cls.native is not None:
                    native, cls.native = cls.native, None
                    native.emulation_uninstall()

    @classmethod
    def _build_kernels(cls) -> list:
        if cls._kernels is None:
            kernels = []
            for op in OPS.values():
                if not op.kernel:
                    continue
                original = torch.library.get_kernel(op.overload, "CPU")
                original_base = original if op.base is op.overload else torch.library.get_kernel(op.base, "CPU")
                kernels.append((op.overload, _make_kernel(op, original, original_base)))
            cls._kernels = kernels
        return cls._kernels

    @classmethod
    def _install(cls) -> torch.library.Library:
        kernels = cls._build_kernels()  # first: their fallbacks are the kernels registered before ours
        native = _native_ops()
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": that is the point.
                warnings.simplefilter("ignore")
                for overload, kernel in kernels:
                    if native is None or overload not in NATIVE_OPS:
                        lib.impl(overload, kernel, "CPU", with_keyset=True)
                if native is not None:
                    native.emulation_install()
        except BaseException:
            lib._destroy()
            raise
        cls.native = native
        return lib


class KeepInstalled:
    """See :meth:`CpuHalfEmulation.keep_installed`."""

    def __init__(self) -> None:
        self._held = False

    def __enter__(self) -> KeepInstalled:
        if KERNEL_BACKEND_AVAILABLE and not self._held:
            KernelOverrides.acquire()
            self._held = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._held:
            self._held = False
            KernelOverrides.release()
