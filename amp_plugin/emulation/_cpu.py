"""Which CPU half-precision path is faithful and fastest here: native oneDNN kernels or emulation.

A path is *faithful* when a half-precision GEMM forms its products exactly, sums them in FP32
and rounds the result once, as a GPU Tensor Core does. Both candidates are:

* emulation (:class:`~amp_plugin.emulation.CpuHalfEmulation`): upcast, FP32 kernel, one
  rounding, on every CPU;
* the native kernels, where PyTorch hands FP16/BF16 GEMMs and convolutions to oneDNN and the
  CPU has units for them: oneDNN's BF16 kernels on ``avx512_bf16``/AMX-BF16 and its FP16 kernels
  on ``avx512_fp16``/AMX-FP16 accumulate in FP32 and round once. On such CPUs the native BF16
  GEMM takes a quarter to a half of the FP32 time, faster than the emulation, which runs at
  FP32 speed.

FP16 is native only with AMX-FP16. With ``avx512_fp16`` alone the native FP16 GEMM runs at
about FP32 speed, no faster than the emulation, and a training step is no faster natively:
measured on an Intel Xeon with ``avx512_fp16`` and AMX-BF16, a transformer step
(``benchmarks/bench_emulation.py``) took 1.14x and 1.05x the FP32 time natively against 1.06x and
1.09x emulated in two runs, and ``char_gpt`` end to end (``benchmarks/bench_end_to_end.py``) 1.68x
natively against 1.43x emulated (PyTorch's native FP16 flash-attention backward is slow on CPU).

Elsewhere PyTorch's native half kernels are either oneDNN's conversion-based fallbacks or its
own reference loops, 6-80x slower than FP32, so the emulation is the fast faithful path.

The hardware is probed once per process (:func:`cpu_features`); the decision
(:func:`cpu_half_path`) is cached per dtype and per state of ``torch.backends.mkldnn.enabled``.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

from amp_plugin.emulation._common import DTYPE_ALIASES

__all__ = ["CpuFeatures", "CpuPath", "cpu_features", "cpu_half_path"]


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU, and this torch build, offer for half-precision GEMMs."""

    model: str  #: the CPU model name
    capability: str  #: ``torch.backends.cpu.get_cpu_capability()``: "DEFAULT", "AVX2", "AVX512", ...
    avx512_bf16: bool
    amx_bf16: bool
    avx512_fp16: bool
    amx_fp16: bool
    #: torch sends BF16 / FP16 GEMMs and convolutions to oneDNN on this CPU
    #: (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` / ``_fp16_``)
    onednn_bf16: bool
    onednn_fp16: bool

    def flags(self) -> str:
        """The half-precision units present, e.g. ``"avx512_bf16 amx_bf16"`` (``"none"`` if none)."""
        names = [n for n in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if getattr(self, n)]
        return " ".join(names) or "none"


@dataclass(frozen=True)
class CpuPath:
    """How FP16 or BF16 matmuls run on this CPU when emulation is left to ``"auto"``.

    ``native``: True when the native kernels are faithful and faster (oneDNN on a CPU with
    half-precision units); False when :class:`~amp_plugin.emulation.CpuHalfEmulation` is the path.
    ``reason``: e.g. ``"native (avx512_bf16)"`` or ``"emulated (no native FP16 GEMM: ...)"``.
    """

    dtype: torch.dtype
    native: bool
    reason: str


def _proc_cpuinfo() -> tuple[str, frozenset]:
    """(model name, flags) from /proc/cpuinfo; empty where there is none."""
    model = ""
    flags: frozenset[str] = frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    return model, flags


def _probe(fn_name: str, *owners) -> bool:
    for owner in owners:
        fn = getattr(owner, fn_name, None)
        if fn is not None:
            try:
                return bool(fn())
            except Exception:  # a probe that cannot run (unsupported build): treat as absent
                return False
    return False


def _detect() -> CpuFeatures:
    model, flags = _proc_cpuinfo()
    caps: dict = {}
    get_caps = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.11
    if get_caps is not None:
        try:
            caps = dict(get_caps())
        except Exception:
            caps = {}
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")

    def has(name: str, torch_probe: str = "") -> bool:
        """torch's cpuinfo capabilities first, then its older probes, then /proc/cpuinfo."""
        if not x86:  # ARM's BF16 dot products do not round like IEEE FP32 sums; no native path there
            return False
        if name in caps:
            return bool(caps[name])
        if torch_probe and _probe(torch_probe, torch.cpu):
            return True
        return name in flags

    mkldnn = torch.ops.mkldnn
    return CpuFeatures(
        model=model or str(caps.get("cpu_name", "")) or platform.processor() or "unknown CPU",
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=has("avx512_bf16", "_is_avx512_bf16_supported"),
        amx_bf16=has("amx_bf16", "_is_amx_tile_supported"),  # every CPU with AMX tiles has AMX-BF16
        avx512_fp16=has("avx512_fp16"),
        amx_fp16=has("amx_fp16", "_is_amx_fp16_supported"),
        onednn_bf16=torch.backends.mkldnn.is_available() and _probe("_is_mkldnn_bf16_supported", mkldnn),
        onednn_fp16=torch.backends.mkldnn.is_available() and _probe("_is_mkldnn_fp16_supported", mkldnn),
    )


@functools.cache
def cpu_features() -> CpuFeatures:
    """The probed CPU features (once per process)."""
    return _detect()


_NAMES = {torch.float16: "FP16", torch.bfloat16: "BF16"}
_UNITS = {
    torch.bfloat16: (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "avx512_bf16")),
    torch.float16: (("amx_fp16", "AMX-FP16"),),  # avx512_fp16 alone: no faster than emulation (docstring)
}


@functools.cache
def _decide(dtype: torch.dtype, mkldnn_enabled: bool) -> CpuPath:
    features = cpu_features()
    name = _NAMES[dtype]
    units = [label for attr, label in _UNITS[dtype] if getattr(features, attr)]
    if not units:
        wanted = " or ".join(label for _, label in _UNITS[dtype])
        if dtype is torch.float16 and features.avx512_fp16:
            return CpuPath(
                dtype, False, "emulated (avx512_fp16 without AMX-FP16: native FP16 is no faster than the emulation)"
            )
        return CpuPath(dtype, False, f"emulated (no native {name} GEMM: the CPU has no {wanted})")
    onednn = features.onednn_bf16 if dtype is torch.bfloat16 else features.onednn_fp16
    if not onednn:
        return CpuPath(
            dtype, False, f"emulated ({units[0]} present, but this torch build does not send {name} GEMMs to oneDNN)"
        )
    if not mkldnn_enabled:
        return CpuPath(dtype, False, f"emulated ({units[0]} present, but torch.backends.mkldnn is disabled)")
    return CpuPath(dtype, True, f"native ({units[0]})")


def as_half_dtype(dtype: torch.dtype | str, argument: str = "dtype") -> torch.dtype:
    resolved = DTYPE_ALIASES.get(dtype.strip().lower()) if isinstance(dtype, str) else dtype
    if resolved not in _NAMES:
        raise ValueError(
            f"{argument}={dtype!r} is not allowed: expected torch.float16 or torch.bfloat16 "
            "(or a precision string such as 'fp16', 'bf16', '16-mixed', 'bf16-true')"
        )
    return resolved


def cpu_half_path(dtype: torch.dtype | str) -> CpuPath:
    """The faithful and fastest way to run ``dtype`` (FP16 or BF16) matmuls on this CPU.

    Native where torch sends the dtype's GEMMs to oneDNN and the CPU has units for it
    (BF16: ``avx512_bf16`` or AMX-BF16; FP16: AMX-FP16) and
    ``torch.backends.mkldnn`` is enabled; emulated otherwise. Decided once per process (and
    per state of ``torch.backends.mkldnn.enabled``).
    """
    return _decide(as_half_dtype(dtype), bool(torch.backends.mkldnn.enabled))


def _clear_cache() -> None:
    """Forget the probe and the decisions (tests that simulate other CPUs)."""
    cpu_features.cache_clear()
    _decide.cache_clear()
