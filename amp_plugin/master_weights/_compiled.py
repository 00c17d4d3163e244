"""The bit handling of the lean step, fused by ``torch.compile`` (``fused="compiled"``; automatic off the CPU).

Torch's multi-tensor path (``_multi_tensor.py``) runs the Adam update of a whole group in one
fused kernel, but the lean kinds wrap it in bit manipulations: ``master="bf16_split"`` joins the
BF16 weight and its int16 remainder into the FP32 value before the step and splits it after it,
``master="stochastic"`` writes the weight back with stochastic rounding, and BF16 moments are
rounded (stochastically: a hash per element) into their tensors. With torch ops that is some
forty elementwise passes per parameter tensor; a GPU pays as many launches.

Here they are two passes of one tensor each, compiled once with dynamic shapes (Inductor emits
one Triton kernel per pass on CUDA, C++ on the CPU): :func:`prepare` (weight + remainder -> FP32,
BF16 moments -> FP32) and :func:`store` (the stepped FP32 value into the weight, its remainder,
and the BF16 moments). All
of it is integer arithmetic on bit patterns and exact conversions, so the compiled code gives the
bits of the torch ops in ``_split.py`` and ``_stochastic.py`` on every backend (int32 products wrap
modulo 2**32 there too); the Adam update between them is still torch's own fused kernel.

The first call compiles (tens of seconds on a small CPU; Inductor caches the generated code on disk,
so a later process loads it): said once on stderr, and the time is counted apart from training's
(:func:`amp_plugin.fused.counted_as_build`). :func:`available` compiles on a small tensor before
a step changes anything, so a failure to compile sends the step down the torch-ops path.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, cast

import torch

from amp_plugin.fused import counted_as_build
from amp_plugin.master_weights._stochastic import as_int32, element_hash, shr32

__all__ = ["available", "join", "keys_tensor", "prepare", "store"]

T = torch.Tensor


def _rounded_stochastically(value: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """The BF16 bits (int16) of ``value`` rounded with the 16 ``random`` bits of each element."""
    rounded = (value.view(torch.int32) + random) >> 16
    return torch.where(torch.isnan(value), 0x7FC0, rounded).to(torch.int16)


def _high(h: torch.Tensor) -> torch.Tensor:
    return shr32(h, 16)


def _round_weight(value: T, weight: T, key: T) -> None:
    """``master="stochastic"``: the weight rounded with the high 16 bits of each element's hash."""
    random = _high(element_hash(value.numel(), key, value.device))
    weight.view(torch.int16).copy_(_rounded_stochastically(value, random))


def _join(weight: T, remainder: T) -> T:
    high = (weight.view(torch.int16).to(torch.int32) & 0xFFFF) << 16
    return (high + remainder.to(torch.int32)).view(torch.float32)


# The values a step computes on, one kernel per tensor: the FP32 weight (joined with its remainder,
# or upcast) and the BF16 moments upcast.
def _join_up(weight: T, remainder: T, m16: T, v16: T) -> tuple[T, T, T]:
    return _join(weight, remainder), m16.float(), v16.float()


def _up_weight(weight: T, m16: T, v16: T) -> tuple[T, T, T]:
    return weight.float(), m16.float(), v16.float()


def _up(m16: T, v16: T) -> tuple[T, T]:
    return m16.float(), v16.float()


def _split_weight(value: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """bf16_split: the weight rounded to nearest (ties away from zero), and the exact remainder."""
    bits = value.view(torch.int32)
    low = bits & 0xFFFF
    weight.view(torch.int16).copy_((shr32(bits, 16) + shr32(low, 15)).to(torch.int16))
    remainder.copy_(low.to(torch.int16))


def _round_moments(
    m32: torch.Tensor, v32: torch.Tensor, m16: torch.Tensor, v16: torch.Tensor, keys: torch.Tensor, sr: bool
) -> None:
    if sr:  # one hash for both: exp_avg takes its high 16 bits, exp_avg_sq its low 16
        h = element_hash(m32.numel(), keys[1], m32.device)
        m16.view(torch.int16).copy_(_rounded_stochastically(m32, _high(h)))
        v16.view(torch.int16).copy_(_rounded_stochastically(v32, h & 0xFFFF))
    else:
        m16.copy_(m32)
        v16.copy_(v32)


# One function per combination, each compiled on its own (its own graphs and recompile budget):
# the weight split or rounded stochastically, with or without the BF16 moments, in one kernel.
def _split(value: T, weight: T, remainder: T, keys: T) -> None:
    _split_weight(value, weight, remainder)


def _split_moments(value: T, weight: T, remainder: T, keys: T, m32: T, v32: T, m16: T, v16: T, sr: bool) -> None:
    _split_weight(value, weight, remainder)
    _round_moments(m32, v32, m16, v16, keys, sr)


def _rounded(value: T, weight: T, remainder: None, keys: T) -> None:
    _round_weight(value, weight, keys[0])


def _rounded_moments(value: T, weight: T, remainder: None, keys: T, m32: T, v32: T, m16: T, v16: T, sr: bool) -> None:
    _round_weight(value, weight, keys[0])
    _round_moments(m32, v32, m16, v16, keys, sr)


def _moments(value: T, weight: None, remainder: None, keys: T, m32: T, v32: T, m16: T, v16: T, sr: bool) -> None:
    _round_moments(m32, v32, m16, v16, keys, sr)


_FUNCTIONS: dict[str, Any] = {
    "join": _join,
    "join_up": _join_up,
    "up_weight": _up_weight,
    "up": _up,
    "split": _split,
    "split_moments": _split_moments,
    "rounded": _rounded,
    "rounded_moments": _rounded_moments,
    "moments": _moments,
}
_compiled: dict[str, Any] = {}
_state: dict[str, Any] = {"ok": None, "error": None}


def _fn(name: str) -> Any:
    if name not in _compiled:
        _compiled[name] = torch.compile(_FUNCTIONS[name], dynamic=True, fullgraph=True)
    return _compiled[name]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1)


def join(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master of a ``bf16_split`` parameter (as ``_split.join``), one fused pass."""
    return _fn("join")(_flat(weight), _flat(remainder)).view(weight.shape)


def prepare(
    weight: torch.Tensor | None, remainder: torch.Tensor | None, moments: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The FP32 values a step updates, in one fused pass: the weight's (joined with its
    ``remainder``, or upcast; ``None``: the caller has an FP32 master) and the BF16 ``moments``
    ``(m16, v16)`` upcast (``None``: FP32 moments, used as they are)."""
    shape = (weight if weight is not None else cast("tuple", moments)[0]).shape
    if moments is None:
        if weight is None:
            return None, None, None
        value = join(weight, remainder) if remainder is not None else weight.detach().float()
        return value, None, None
    m16, v16 = (_flat(t) for t in moments)
    if weight is None:
        m32, v32 = _fn("up")(m16, v16)
        return None, m32.view(shape), v32.view(shape)
    if remainder is not None:
        value, m32, v32 = _fn("join_up")(_flat(weight), _flat(remainder), m16, v16)
    else:
        value, m32, v32 = _fn("up_weight")(_flat(weight), m16, v16)
    return value.view(shape), m32.view(shape), v32.view(shape)


def store(
    value: torch.Tensor,
    weight: torch.Tensor | None,
    remainder: torch.Tensor | None,
    moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    keys: torch.Tensor,
    stochastic_moments: bool,
) -> None:
    """Write a stepped FP32 ``value`` into ``weight`` (BF16: split with ``remainder``, or rounded
    stochastically with ``keys[0]``; ``None``: an FP32 master the caller copies) and the FP32
    ``moments`` ``(m32, v32, m16, v16)`` into their BF16 tensors (stochastically with ``keys[1]``,
    one hash for both, else to nearest), in one fused pass. All tensors contiguous, of one shape."""
    name = "moments" if weight is None else "split" if remainder is not None else "rounded"
    args = [
        _flat(value),
        None if weight is None else _flat(weight),
        None if remainder is None else _flat(remainder),
        keys,
    ]
    if moments is None:
        if weight is not None:
            _fn(name)(*args)
        return
    _fn(name if weight is None else f"{name}_moments")(*args, *(_flat(t) for t in moments), stochastic_moments)


def keys_tensor(keys: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The (weight, moments) rounding keys of each tensor, as one int32 tensor on ``device`` (one
    copy to the device per step): row ``i`` is what :func:`store` takes."""
    return torch.tensor([[as_int32(k & 0xFFFFFFFF) for k in row] for row in keys], dtype=torch.int32, device=device)


def available(device: torch.device, strict: bool) -> bool:
    """Whether the compiled functions run on ``device``: compiled (and checked) on small tensors the
    first time, said once on stderr. A failure warns once and returns ``False`` (``strict``: raises)."""
    if _state["ok"] is None:
        print(
            "amp_plugin: compiling the lean step's join and store with torch.compile, once per process "
            "(Inductor caches the generated code on disk; a later run loads it); the time is not counted in "
            "the run's steps/s.",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        try:
            with counted_as_build():
                _probe(device)
            _state["ok"] = True
            print(f"amp_plugin: compiled in {time.perf_counter() - start:.0f} s.", file=sys.stderr, flush=True)
        except Exception as err:  # any failure to compile means: the torch-ops path
            _state.update(ok=False, error=err)
            warnings.warn(
                f"torch.compile could not compile the lean step ({type(err).__name__}: {err}); the step runs "
                "torch's multi-tensor ops instead (same bits, slower).",
                RuntimeWarning,
                stacklevel=3,
            )
    if not _state["ok"] and strict:
        raise RuntimeError(f"fused='compiled': torch.compile failed: {_state['error']}") from _state["error"]
    return bool(_state["ok"])


def _probe(device: torch.device) -> None:
    """Compile both functions on 16-element tensors and check them against the torch ops."""
    from amp_plugin.master_weights import _split
    from amp_plugin.master_weights._stochastic import round_stochastic

    gen = torch.Generator().manual_seed(0)
    value = torch.randn(16, generator=gen).to(device)
    weight = torch.empty(16, dtype=torch.bfloat16, device=device)
    remainder = torch.empty(16, dtype=torch.int16, device=device)
    m16, v16 = torch.empty_like(weight), torch.empty_like(weight)
    keys = keys_tensor([(1, 2)], device)[0]
    for rem in (remainder, None):
        store(value, weight, rem, (value, value.abs(), m16, v16), keys, True)
    expected = torch.empty_like(weight)
    round_stochastic(value.abs(), expected, 2, low=True)
    if not torch.equal(v16.view(torch.int16), expected.view(torch.int16)):
        raise RuntimeError("the compiled store rounds otherwise than the torch ops")
    _split.split_into(value, weight, remainder)
    if not torch.equal(join(weight, remainder), value):
        raise RuntimeError("the compiled join does not give the master back")
