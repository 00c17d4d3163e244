"""The public context manager and the auto-emulation rule."""

from __future__ import annotations

from typing import Dict, Union

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from amp_plugin.emulation._backends import (
    _KERNEL_BACKEND_AVAILABLE,
    _active_mode,
    _EmulationMode,
    _KeepInstalled,
    _KernelOverrides,
    native_sync,
)
from amp_plugin.emulation._ops import _HALF, _state


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
        if state.kernel_depth:
            native_sync()
        # the first active frame of this instance takes the counts snapshot
        snapshot = None if self.active else dict(state.counts)
        if self.backend == "kernel":
            if state.kernel_depth == 0:
                _KernelOverrides.acquire()
                native_sync(True)
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
        if state.kernel_depth:
            native_sync(False if kind == "kernel" and state.kernel_depth == 1 else None)
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
        While held, covered CPU ops run outside a context go through a short check
        before the original kernel: nothing measurable for ``mm``, ``addmm``, ``bmm``
        and ``baddbmm`` where :mod:`amp_plugin.fused` is built (their kernels are C++),
        a few microseconds of Python per call otherwise. A no-op where the "kernel"
        backend is unavailable.
        """
        return _KeepInstalled()

    @property
    def emulated_calls(self) -> Dict[str, int]:
        """``{"aten.mm.default": n, ...}``: ops this instance emulated so far."""
        if _state.kernel_depth:
            native_sync()
        calls = dict(self._calls)
        for kind, _, snapshot in self._frames:
            if snapshot is not None:
                self._accumulate(_state.counts, snapshot, calls)
        return calls

    def reset_counts(self) -> None:
        """Forget :attr:`emulated_calls` (restarts counting from now)."""
        self._calls.clear()
        if _state.kernel_depth:
            native_sync()
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
