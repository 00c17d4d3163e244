"""The public context manager and the auto-emulation rule."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.emulation._backends import (
    KERNEL_BACKEND_AVAILABLE,
    EmulationMode,
    KeepInstalled,
    KernelOverrides,
    active_mode,
    native_sync,
)
from amp_plugin.emulation._common import DTYPE_ALIASES, thread_state
from amp_plugin.emulation._cpu import as_half_dtype, cpu_half_path

__all__ = ["CpuHalfEmulation", "should_emulate"]


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
        dtypes: the half dtypes to emulate: both (the default), one of them
            (``torch.float16``/``"fp16"``, ``torch.bfloat16``/``"bf16"``, or a list), or ``"auto"``:
            those for which :func:`~amp_plugin.emulation.cpu_half_path` does not pick the native
            kernels on this CPU. Ops on the other half dtype run natively inside the context.
        backend: ``"kernel"`` (CPU kernels overridden while in use; no cost for ops
            that are not covered), ``"mode"`` (a ``TorchDispatchMode``; a few
            microseconds on every op), or ``"auto"`` (``"kernel"`` where the
            installed torch supports it, else ``"mode"``). Results are identical.

    * Re-entrant and nestable: nested contexts (the same instance or new ones)
      share the thread's interception, so nesting costs nothing per op; emulation
      stays on until the outermost context exits, exceptions included. A dtype is
      emulated while any active context of the thread emulates it.
    * Harmless where there is nothing to emulate: FP32 and non-CPU tensors pass
      through untouched.
    * :attr:`emulated_calls` counts, per aten overload, the ops this instance
      emulated in its thread while it was active (nested contexts included).
    """

    def __init__(
        self,
        enabled: bool = True,
        backend: str = "auto",
        dtypes: str | torch.dtype | Iterable[str | torch.dtype] | None = None,
    ) -> None:
        if backend not in _BACKENDS:
            raise ValueError(f"backend={backend!r} is not allowed; expected one of {list(_BACKENDS)}")
        if backend == "auto":
            backend = "kernel" if KERNEL_BACKEND_AVAILABLE else "mode"
        elif backend == "kernel" and not KERNEL_BACKEND_AVAILABLE:
            raise RuntimeError(
                f"backend='kernel' needs torch.library.get_kernel (torch {torch.__version__} lacks it); "
                "use backend='mode'"
            )
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled={enabled!r} is not allowed: enabled must be True or False.")
        self.enabled = enabled
        self.backend = backend
        self.dtypes: frozenset = _parse_dtypes(dtypes)
        # one entry per __enter__ still open: (kind, pushed mode or None, counts snapshot or None)
        self._frames: list = []
        self._calls: dict[str, int] = {}

    # -- context manager ------------------------------------------------------
    def __enter__(self) -> CpuHalfEmulation:
        if not self.enabled:
            self._frames.append((None, None, None))
            return self
        state = thread_state
        if state.kernel_depth:
            native_sync()
        # the first active frame of this instance takes the counts snapshot
        snapshot = None if self.active else dict(state.counts)
        state.add_dtypes(self.dtypes, +1)
        if self.backend == "kernel":
            if state.kernel_depth == 0:
                KernelOverrides.acquire()
            state.kernel_depth += 1
            native_sync(state.native_mask())
            self._frames.append(("kernel", None, snapshot))
            return self
        native_sync(state.native_mask())
        pushed = None
        if active_mode() is None:
            pushed = EmulationMode()
            pushed.__enter__()
            state.prev_modes.append(state.mode)
            state.mode = pushed
        self._frames.append(("mode", pushed, snapshot))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        kind, pushed, snapshot = self._frames.pop()
        if kind is None:
            return None
        state = thread_state
        if state.kernel_depth:
            native_sync()
        if snapshot is not None:
            self._accumulate(state.counts, snapshot, self._calls)
        state.add_dtypes(self.dtypes, -1)
        if kind == "kernel":
            state.kernel_depth -= 1
        native_sync(state.native_mask())  # off in this thread once the last kernel context exits
        if kind == "kernel":
            if state.kernel_depth == 0:
                KernelOverrides.release()
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
    def _accumulate(counts: dict[str, int], snapshot: dict[str, int], into: dict[str, int]) -> None:
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
        return thread_state.kernel_depth > 0 or active_mode() is not None

    @staticmethod
    def keep_installed() -> KeepInstalled:
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
        return KeepInstalled()

    @property
    def emulated_calls(self) -> dict[str, int]:
        """``{"aten.mm.default": n, ...}``: ops this instance emulated so far."""
        if thread_state.kernel_depth:
            native_sync()
        calls = dict(self._calls)
        for _kind, _, snapshot in self._frames:
            if snapshot is not None:
                self._accumulate(thread_state.counts, snapshot, calls)
        return calls

    def reset_counts(self) -> None:
        """Forget :attr:`emulated_calls` (restarts counting from now)."""
        self._calls.clear()
        if thread_state.kernel_depth:
            native_sync()
        now = dict(thread_state.counts)
        self._frames = [
            (kind, pushed, now if snapshot is not None else None) for kind, pushed, snapshot in self._frames
        ]

    def __repr__(self) -> str:
        names = sorted(str(dt).removeprefix("torch.") for dt in self.dtypes)
        return (
            f"CpuHalfEmulation(enabled={self.enabled}, backend={self.backend!r}, dtypes={names}, active={self.active})"
        )


# ----------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------


def _parse_dtypes(dtypes) -> frozenset:
    if dtypes is None:
        return HALF_DTYPES
    if isinstance(dtypes, str) and dtypes.strip().lower() == "auto":
        return frozenset(dt for dt in HALF_DTYPES if not cpu_half_path(dt).native)
    if isinstance(dtypes, (str, torch.dtype)):
        dtypes = (dtypes,)
    try:
        items = list(dtypes)
    except TypeError:
        raise TypeError(
            f"dtypes={dtypes!r} is not allowed: expected torch.float16 and/or torch.bfloat16 "
            "(a dtype, a precision string, a list of them) or 'auto'"
        ) from None
    return frozenset(as_half_dtype(d, "dtypes") for d in items)


def _resolve_precision(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key not in DTYPE_ALIASES:
            raise ValueError(f"unknown precision {dtype!r}; expected a torch.dtype or one of {sorted(DTYPE_ALIASES)}")
        return DTYPE_ALIASES[key]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")
    return dtype


def should_emulate(device: torch.device | str | int | None, dtype: torch.dtype | str) -> bool:
    """True when :class:`CpuHalfEmulation` is the faithful and fastest path: a CPU device,
    FP16/BF16, and a CPU whose native kernels for that dtype are not both faithful and fast
    (:func:`~amp_plugin.emulation.cpu_half_path`; e.g. False for BF16 on CPUs with
    ``avx512_bf16`` or AMX-BF16, whose oneDNN BF16 GEMMs accumulate in FP32 at about half the
    FP32 time).

    ``device``: a ``torch.device``, a string (``"cpu"``, ``"cuda:0"``), an int
    (a CUDA ordinal) or None (the current default device). ``dtype``: a
    ``torch.dtype`` or a precision string (``"fp16"``, ``"bf16"``, ``"16-mixed"``,
    ``"bf16-true"``, ``"fp32"``, ...). This is what ``emulate="auto"`` decides on.
    """
    dtype = _resolve_precision(dtype)
    if device is None:
        device = torch.get_default_device()
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    return device.type == "cpu" and dtype in HALF_DTYPES and not cpu_half_path(dtype).native
