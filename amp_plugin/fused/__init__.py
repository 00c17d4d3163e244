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
(one to three minutes with two cores, said once on stderr with the time elapsed shown while the
compiler runs, and left out of a run's steps/s; cached under ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``, after that), or ahead of the first run with ``python -m
amp_plugin.fused build`` (:mod:`amp_plugin.fused.__main__`). A build killed half-way never blocks
later runs, and a live one is waited for at most 20 minutes, ``AMP_PLUGIN_FUSED_BUILD_TIMEOUT``
(:func:`build_timeout`; :mod:`amp_plugin.fused._first_build`). One build is compiled per CPU variant:
``avx512`` (AVX-512 F/BW/VL/DQ, 512-bit loops) where ``torch.backends.cpu.get_cpu_capability()``
is ``"AVX512"``, ``avx2`` (AVX2, FMA, F16C) where it is ``"AVX2"``, ``generic`` elsewhere; each
computes the bits of torch's fused Adam as torch builds it for that capability: the same bits for the
two vector variants, and for ``generic`` on x86-64 those of torch's default build, which has no fused
multiply-adds (``tests/fused/test_fused.py`` checks the variant of the CPU it runs on against the stock
ops, and ``tests/fused/test_fused_build.py`` the generic one under ``ATEN_CPU_CAPABILITY=default``).
The cache entry is named by a hash of the sources, the compiler flags, the torch and Python versions and
the variant (:func:`build_name`), so checkouts with different sources, or virtual environments (even
with the same torch), sharing one cache never rebuild each other's entry; the sources are copied into
the entry first, so identical sources from different checkouts share one build. Without a C++ compiler,
or with ``AMP_PLUGIN_FUSED=0`` in the environment, :func:`kernels` returns ``None`` and
``MasterWeightOptimizer`` uses stock torch ops (the same update, about 1.4x slower on CPU)
and ``CpuHalfEmulation`` its Python kernels (the same results, some 50 us more per matmul).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from amp_plugin.fused import _first_build as _build_steps

__all__ = [
    "ENV_SWITCH",
    "build_name",
    "build_seconds",
    "build_timeout",
    "counted_as_build",
    "kernels",
    "unavailable_reason",
    "variant",
]

ENV_SWITCH = "AMP_PLUGIN_FUSED"
_SOURCES = [Path(__file__).with_name(name) for name in ("master_step.cpp", "emulate.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("fused_simd.h", "adam_update.h")]  # master_step.cpp's
# -fopenmp: at::parallel_for is inline, and without it runs on one thread.
_BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_VARIANT_FLAGS = {
    # the AVX2 intrinsics stay in use for what has no 512-bit loop; 512-bit auto-vectorisation
    "avx512": (
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mprefer-vector-width=512",
    ),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),  # torch's "AVX2" capability implies FMA; F16C comes with them
    "generic": (),
}
_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "ops": None, "error": None}


def variant(capability: str | None = None) -> str:
    """The build variant for a torch CPU capability (default: this CPU's,
    ``torch.backends.cpu.get_cpu_capability()``): ``"avx512"``, ``"avx2"`` or ``"generic"``."""
    capability = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "generic")


def build_name(sources: list[bytes], flags: list[str], variant_name: str, ldflags: tuple = _LDFLAGS) -> str:
    """The cache entry's name: the variant and a hash of the source texts, the flags, the torch
    and Python versions, the environment (``sys.prefix`` and torch's location), the machine and
    ``$CXX``. Equal only when all of them are equal."""
    digest = hashlib.sha256()
    for part in (
        *sources,
        "--flags",
        *flags,
        "--ldflags",
        *ldflags,
        "--environment",
        torch.__version__,
        str(torch.version.git_version),
        # The environment: its build file holds this environment's include paths, so two virtual
        # environments sharing one cache would otherwise rebuild each other's entry in turn.
        sys.prefix,
        os.path.dirname(torch.__file__),
        f"{sys.version_info[0]}.{sys.version_info[1]}{getattr(sys, 'abiflags', '')}",
        platform.machine(),
        os.environ.get("CXX", ""),
    ):
        data = part if isinstance(part, bytes) else part.encode()
        digest.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two part lists collide
        digest.update(data)
    return f"amp_plugin_fused_{variant_name}_{digest.hexdigest()[:16]}"


def _flags() -> tuple[str, list[str]]:
    """This CPU's build: its cache entry's name and its compiler flags."""
    name = variant()
    flags = [*_BASE_FLAGS, *_VARIANT_FLAGS[name]]
    return build_name([path.read_bytes() for path in (*_SOURCES, *_HEADERS)], flags, name), flags


def _staged_sources(build_directory: str) -> list[str]:
    """Copy the sources and the headers they include into ``build_directory/src`` (once; the
    directory's name is their hash) and return the sources' copies: the build then never depends on
    where the checkout is."""
    target = Path(build_directory) / "src"
    target.mkdir(parents=True, exist_ok=True)
    staged = []
    for path in (*_SOURCES, *_HEADERS):
        dest = target / path.name
        data = path.read_bytes()
        if not dest.exists() or dest.read_bytes() != data:
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)  # atomic: a concurrent build reads the old or the new copy, whole
        if path in _SOURCES:  # the headers are staged beside them, not compiled on their own
            staged.append(str(dest))
    return staged


def unavailable_reason() -> str | None:
    """Why :func:`kernels` returns ``None`` (after it has been called), or ``None``."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0 is set"
    return _state["error"]


def kernels() -> Any | None:
    """``torch.ops.amp_plugin`` once the kernels are built and loaded, else ``None``.

    The first call compiles (or loads the cached build), showing the time elapsed on stderr while
    the compiler runs; a failed build warns once, naming the reason, and is not retried in this process.

    Raises:
        ValueError: ``AMP_PLUGIN_FUSED_BUILD_TIMEOUT`` is set to something other than a finite
            number of seconds above 0.
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


def build_timeout() -> float:
    """Seconds a build waits for another live process's build of the same entry:
    ``AMP_PLUGIN_FUSED_BUILD_TIMEOUT``, default 1200. A caller that checks its configuration up front
    (the app) calls this to refuse a bad value before anything runs.

    Raises:
        ValueError: the variable is set to something other than a finite number of seconds above 0
            (``nan``, ``inf``, ``0``, ``-5``, ``soon``); the message names the variable, the value and the range.
    """
    return _build_steps.lock_timeout()


def build_seconds() -> float:
    """Seconds this process spent building, loading or waiting for the kernels' build (the app
    leaves them out of a run's wall time and steps/s), and compiling other code the step needs
    (:func:`counted_as_build`)."""
    return _build_steps.seconds_spent()


def counted_as_build() -> contextlib.AbstractContextManager[None]:
    """A ``with`` block whose time counts in :func:`build_seconds` (a first ``torch.compile``)."""
    return _build_steps.timed()


def _compiler() -> str | None:
    """Why there is no C++ compiler to build with (torch uses ``$CXX``, default ``c++``), or None."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang++, or set CXX)"
    return None


def _build() -> Any | None:
    name, flags = _flags()
    # A bad AMP_PLUGIN_FUSED_BUILD_TIMEOUT is the user's to fix, not a reason to run slower: raised, not warned.
    timeout = build_timeout()
    try:
        if not hasattr(torch.ops.amp_plugin, "emulation_sync"):
            missing = _compiler()
            if missing is not None:
                raise RuntimeError(missing)
            from torch.utils.cpp_extension import _get_build_directory, load

            if shutil.which("ninja") is None:  # the ninja wheel's binary, when its bin/ is not on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

            build_directory = _get_build_directory(name, False)
            with (
                _build_steps.timed(),
                _build_steps.build_lock(build_directory, timeout),
                warnings.catch_warnings(),
                contextlib.ExitStack() as shown,
            ):
                warnings.simplefilter("ignore")  # torch's own notes on the compiler: our one warning says it
                if not os.path.exists(os.path.join(build_directory, f"{name}.so")):
                    _build_steps.announce(name, build_directory, variant())
                    shown.enter_context(_build_steps.progress("compiling the fused kernels"))
                # copies of the flag lists: load() appends to the lists it is given
                load(
                    name=name,
                    sources=_staged_sources(build_directory),
                    extra_cflags=list(flags),
                    extra_ldflags=list(_LDFLAGS),
                    build_directory=build_directory,
                    is_python_module=False,
                    verbose=False,
                )
        return torch.ops.amp_plugin
    except Exception as err:  # no compiler, no ninja, a read-only cache, a build lock held too long
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
