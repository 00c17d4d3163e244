"""The two ways of intercepting the covered ops: a dispatch mode, or CPU kernels registered while in use."""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from amp_plugin.emulation._ops import _OPS, _PASS, _Op, _count, _state, _transparent


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
