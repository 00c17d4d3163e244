"""Fused CPU kernels for the FP32-master-weight step and for CPU half emulation, compiled on first use.

Stock torch needs four passes over the parameters for one mixed-precision Adam step on the
CPU: copy the half gradients to FP32, unscale them with the inf check, the fused Adam update,
and copy the masters back into the half model. ``master_step.cpp`` (next to this file) does
it in two: ``unscale_into_`` (read the half gradient, write the unscaled FP32 master gradient,
flag inf/NaN) and ``adam_step_`` (update the master and its moments and write the rounded
weight into the model in the same pass). ``emulate.cpp`` holds the C++ kernels of
:class:`~amp_plugin.CpuHalfEmulation`'s "kernel" backend for ``mm``, ``addmm``, ``bmm`` and
``baddbmm``: the same upcast, FP32 kernel and one rounding as its Python handlers, without
the trip into Python on every call.

The kernels are built with ``torch.utils.cpp_extension.load`` the first time they are needed
(about 25 s with two cores; cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, after that). Without a C++ compiler, or with
``AMP_PLUGIN_FUSED=0`` in the environment, :func:`kernels` returns ``None`` and
``MasterWeightOptimizer`` uses stock torch ops (the same update, about 1.4x slower on CPU)
and ``CpuHalfEmulation`` its Python kernels (the same results, some 50 us more per matmul).
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["kernels", "unavailable_reason", "ENV_SWITCH"]

ENV_SWITCH = "AMP_PLUGIN_FUSED"
_SOURCES = [str(Path(__file__).with_name(name)) for name in ("master_step.cpp", "emulate.cpp")]
_VERSION = 12  # bump when a source changes: the build cache is keyed by name
_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "ops": None, "error": None}


def _flags() -> tuple[str, list[str]]:
    """Compiler flags for this CPU, and a name that keeps each variant's build apart."""
    # -fopenmp: at::parallel_for is inline, and without it runs on one thread.
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2" needs AVX2 and FMA; F16C comes with them
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
        variant = "avx2"
    else:
        variant = "generic"
    return f"amp_plugin_fused_v{_VERSION}_{variant}", flags


def unavailable_reason() -> str | None:
    """Why :func:`kernels` returns ``None`` (after it has been called), or ``None``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0 is set"
    return _state["error"]


def kernels() -> Any | None:
    """``torch.ops.amp_plugin`` once the kernels are built and loaded, else ``None``.

    The first call compiles (or loads the cached build); a failed build warns once, naming
    the reason, and is not retried in this process.
    """
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if _state["tried"]:
        return _state["ops"]
    with _lock:
        if not _state["tried"]:
            _state["ops"] = _build()
            _state["tried"] = True
    return _state["ops"]


def _build() -> Any | None:
    name, flags = _flags()
    try:
        if not hasattr(torch.ops.amp_plugin, "emulation_sync"):
            from torch.utils.cpp_extension import load

            if shutil.which("ninja") is None:  # the ninja wheel's binary, when its bin/ is not on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

            load(name=name, sources=_SOURCES, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                 is_python_module=False, verbose=False)
        return torch.ops.amp_plugin
    except Exception as err:  # no compiler, no ninja, a read-only cache: stock ops still work
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        _state["error"] = f"{type(err).__name__}: {first_line[:300]}"
        warnings.warn(
            "amp_plugin could not build its fused CPU kernels for the master-weight step and half "
            f"emulation ({_state['error']}); using stock torch ops and Python emulation kernels instead "
            f"(same results, slower steps). Set {ENV_SWITCH}=0 to skip the build.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
