"""The bit handling of the lean step, fused by ``torch.compile`` (``fused="compiled"``; off the CPU without Triton).

Torch's multi-tensor path (``_multi_tensor.py``) runs the Adam update of a whole group in one
fused kernel, but the lean kinds wrap it in bit manipulations: ``master="bf16_split"`` joins the
BF16 weight and its int16 remainder into the FP32 value before the step and splits it after it,
``master="stochastic"`` writes the weight back with stochastic rounding, and BF16 moments are
rounded (stochastically: a hash per element) into their tensors. With torch ops that is some
forty elementwise passes per parameter tensor; a GPU pays as many launches.

Here they are two passes, compiled once with dynamic shapes (on the CPU Inductor fuses a batch's
tensors into one C++ loop nest; on CUDA it emits one Triton kernel per tensor and pass, each
launched from Python, about 40 us of host time apiece on an H200's host, which bounds the step
there): :func:`prepare` (weight + remainder -> FP32, BF16
moments -> FP32) and :func:`store` (the stepped FP32 value into the weight, its remainder, and
the BF16 moments). Each call of a compiled function takes a batch of tensors (16, 4 or 1 of
them: a group of 78 tensors is 9 calls, and each function compiles for at most 3 lengths), so
the host pays one Dynamo guard check and one generated wrapper per batch, not per tensor
(measured on a 2-core CPU: 16 tensors of 1,000 elements, 2.9 ms one call per tensor, 0.42 ms
in one call). Sizes are symbols, one per tensor, whatever sizes happen to be equal ("duck
shapes" off), so the batches of a model compile once per length, not once per pattern of
equal sizes. All of it is integer arithmetic on bit patterns and exact conversions, so the
compiled code gives the bits of the torch ops in ``_split.py`` and ``_stochastic.py`` on every
backend (int32 products wrap modulo 2**32 there too); the Adam update between the two passes is
still torch's own fused kernel.

The first call compiles (tens of seconds on a small CPU; Inductor caches the generated code on disk,
so a later process loads it): said once on stderr, and the time is counted apart from training's
(:func:`amp_plugin.fused.counted_as_build`). :func:`available` compiles on small tensors before
a step changes anything, so a failure to compile sends the step down the torch-ops path; a batch
that fails to compile later (a length not seen by the probe) runs the same functions uncompiled
(the same bits, slower), with a warning, once.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx.experimental._config as fx_config

from amp_plugin.fused import counted_as_build
from amp_plugin.master_weights._stochastic import as_int32, element_hash, shr32

__all__ = ["available", "join", "keys_tensor", "prepare", "store"]

T = torch.Tensor
L = list[torch.Tensor]
BATCH_SIZES = (16, 4, 1)


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


def _split_weight(value: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor) -> None:
    """bf16_split: the weight rounded to nearest (ties away from zero), and the exact remainder."""
    bits = value.view(torch.int32)
    low = bits & 0xFFFF
    weight.view(torch.int16).copy_((shr32(bits, 16) + shr32(low, 15)).to(torch.int16))
    remainder.copy_(low.to(torch.int16))


def _round_moments(m32: T, v32: T, m16: T, v16: T, key: T, sr: bool) -> None:
    if sr:  # one hash for both: exp_avg takes its high 16 bits, exp_avg_sq its low 16
        h = element_hash(m32.numel(), key, m32.device)
        m16.view(torch.int16).copy_(_rounded_stochastically(m32, _high(h)))
        v16.view(torch.int16).copy_(_rounded_stochastically(v32, h & 0xFFFF))
    else:
        m16.copy_(m32)
        v16.copy_(v32)


# One function per combination, each compiled on its own (a code object holds its own graphs and
# recompile budget), each over a batch of tensors of one combination.
# The values a step computes on: the FP32 weight (joined with its remainder, or upcast) and the
# BF16 moments upcast.
def _join_all(weights: L, remainders: L) -> L:
    return [_join(w, r) for w, r in zip(weights, remainders)]


def _join_up_all(weights: L, remainders: L, m16s: L, v16s: L) -> list[tuple[T, T, T]]:
    return [(_join(w, r), m.float(), v.float()) for w, r, m, v in zip(weights, remainders, m16s, v16s)]


def _up_weight_all(weights: L) -> L:
    return [w.float() for w in weights]


def _up_all(weights: L, m16s: L, v16s: L) -> list[tuple[T, T, T]]:
    return [(w.float(), m.float(), v.float()) for w, m, v in zip(weights, m16s, v16s)]


def _up_moments_all(m16s: L, v16s: L) -> list[tuple[T, T]]:
    return [(m.float(), v.float()) for m, v in zip(m16s, v16s)]


# Stores: the weight split or rounded stochastically, with or without the BF16 moments, in one
# kernel per tensor; ``keys`` row i holds tensor i's (weight, moments) rounding keys.
def _split_all(values: L, weights: L, remainders: L, keys: T) -> None:
    for value, weight, remainder in zip(values, weights, remainders):
        _split_weight(value, weight, remainder)


def _split_moments_all(
    values: L, weights: L, remainders: L, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i, (value, weight, remainder) in enumerate(zip(values, weights, remainders)):
        _split_weight(value, weight, remainder)
        _round_moments(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


def _rounded_all(values: L, weights: L, remainders: None, keys: T) -> None:
    for i, (value, weight) in enumerate(zip(values, weights)):
        _round_weight(value, weight, keys[i, 0])


def _rounded_moments_all(
    values: L, weights: L, remainders: None, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i, (value, weight) in enumerate(zip(values, weights)):
        _round_weight(value, weight, keys[i, 0])
        _round_moments(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


def _moments_all(
    values: L, weights: None, remainders: None, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i in range(len(values)):
        _round_moments(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "join": _join_all,
    "join_up": _join_up_all,
    "up_weight": _up_weight_all,
    "up": _up_all,
    "up_moments": _up_moments_all,
    "split": _split_all,
    "split_moments": _split_moments_all,
    "rounded": _rounded_all,
    "rounded_moments": _rounded_moments_all,
    "moments": _moments_all,
}
_compiled: dict[str, Any] = {}
_state: dict[str, Any] = {"ok": None, "error": None, "eager": False}
_seen: set[tuple[Any, ...]] = set()


@contextlib.contextmanager
def _no_duck_shapes() -> Iterator[None]:
    """Dynamo gives each dynamic size its own symbol (equal sizes otherwise share one, guarded equal).
    Set and restored by hand: ``fx_config.patch`` costs more than the rest of a call."""
    old = fx_config.use_duck_shape
    fx_config.use_duck_shape = False
    try:
        yield
    finally:
        fx_config.use_duck_shape = old


def _fn(name: str) -> Any:
    if name not in _compiled:
        _compiled[name] = torch.compile(_FUNCTIONS[name], dynamic=True, fullgraph=True)
    return _compiled[name]


def batches(n: int, start: int = 0) -> Iterator[slice]:
    """``range(start, n)`` cut into batches of :data:`BATCH_SIZES` elements, largest first."""
    for size in BATCH_SIZES:
        while n - start >= size:
            yield slice(start, start + size)
            start += size


def size_class(t: torch.Tensor) -> int:
    """0, 1, or 2 for two elements or more: Dynamo compiles a size of 0 or 1 as a constant, so a
    batch holds tensors of one class (callers order their tensors by it: one batch pattern each)."""
    return min(t.numel(), 2)


def _runs(tensors: Sequence[torch.Tensor]) -> Iterator[slice]:
    """Batches over ``tensors``, never mixing size classes (:func:`size_class`)."""
    start = 0
    while start < len(tensors):
        cls = size_class(tensors[start])
        end = start + 1
        while end < len(tensors) and size_class(tensors[end]) == cls:
            end += 1
        yield from batches(end, start)
        start = end


def _run(name: str, lists: Sequence[L | None], *rest: Any) -> list[Any]:
    """``_FUNCTIONS[name]`` over ``lists`` (``None``: absent) batch by batch, compiled; a batch that
    fails to compile runs uncompiled (the same torch ops), said once. ``rest[0]``, if any, is the
    keys tensor, cut with the lists; the results of the batches are concatenated."""
    out: list[Any] = []
    for part in _runs(next(x for x in lists if x is not None)):
        args: list[Any] = [None if x is None else x[part] for x in lists]
        if rest:
            args += [rest[0][part], *rest[1:]]
        out += _call(name, part.stop - part.start, args) or []
    return out


def _call(name: str, length: int, args: list[Any]) -> Any:
    if not _state.get("eager"):
        try:
            first = args[0][0]  # what a graph is compiled for: the batch's length, size class, device, flags
            graph = (name, length, size_class(first), first.device.type, *(a for a in args if isinstance(a, bool)))
            with _no_duck_shapes():
                if graph in _seen:
                    return _fn(name)(*args)
                with counted_as_build():  # the first call of a kind compiles
                    result = _fn(name)(*args)
            _seen.add(graph)
            return result
        except Exception as err:  # the same functions run uncompiled: the same bits
            if not _state["ok"]:  # the probe: the step takes the torch-ops path
                raise
            _state["eager"] = True
            warnings.warn(
                f"torch.compile failed on a batch of the lean step ({type(err).__name__}: {err}); the step runs "
                "the same functions uncompiled from now on (same bits, slower).",
                RuntimeWarning,
                stacklevel=4,
            )
    return _FUNCTIONS[name](*args)


def _flat(tensors: Sequence[torch.Tensor]) -> L:
    return [t.detach().view(-1) for t in tensors]


def join(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master of a ``bf16_split`` parameter (as ``_split.join``), one fused pass."""
    return _run("join", [_flat([weight]), _flat([remainder])])[0].view(weight.shape)


def prepare(
    weights: L | None, remainders: L | None, moments: tuple[L, L] | None
) -> tuple[L | None, L | None, L | None]:
    """The FP32 values a step updates, one fused pass per tensor: the weights' (joined with their
    ``remainders``, or upcast; ``None``: the caller has FP32 masters) and the BF16 ``moments``
    ``(m16s, v16s)`` upcast (``None``: FP32 moments, used as they are). Tensors of one device."""
    shapes = [t.shape for t in (weights if weights is not None else cast("tuple", moments)[0])]

    def shaped(flat: list[T]) -> L:
        return [t.view(shape) for t, shape in zip(flat, shapes)]

    if weights is None and moments is None:
        return None, None, None
    w = None if weights is None else _flat(weights)
    r = None if remainders is None else _flat(remainders)
    if moments is None:
        return shaped(_run("join", [w, r]) if r is not None else _run("up_weight", [w])), None, None
    m16, v16 = _flat(moments[0]), _flat(moments[1])
    if w is None:
        m32, v32 = zip(*_run("up_moments", [m16, v16]))
        return None, shaped(list(m32)), shaped(list(v32))
    triples = _run("join_up", [w, r, m16, v16]) if r is not None else _run("up", [w, m16, v16])
    value, m32, v32 = zip(*triples)
    return shaped(list(value)), shaped(list(m32)), shaped(list(v32))


def store(
    values: L,
    weights: L | None,
    remainders: L | None,
    moments: tuple[L, L, L, L] | None,
    keys: torch.Tensor,
    stochastic_moments: bool,
) -> None:
    """Write stepped FP32 ``values`` into ``weights`` (BF16: split with ``remainders``, or rounded
    stochastically with ``keys[i, 0]``; ``None``: FP32 masters the caller copies) and the FP32
    ``moments`` ``(m32s, v32s, m16s, v16s)`` into their BF16 tensors (stochastically with
    ``keys[i, 1]``, one hash for both, else to nearest), one fused pass per tensor. All tensors
    contiguous, of one device, tensor ``i`` of each list of one shape; ``keys``: :func:`keys_tensor`."""
    name = "moments" if weights is None else "split" if remainders is not None else "rounded"
    lists = [_flat(values), *(None if x is None else _flat(x) for x in (weights, remainders))]
    if moments is None:
        if weights is not None:
            _run(name, lists, keys)
        return
    _run(name if weights is None else f"{name}_moments", lists + [_flat(t) for t in moments], keys, stochastic_moments)


def keys_tensor(keys: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The (weight, moments) rounding keys of each tensor, as one int32 tensor on ``device`` (one
    copy to the device per step): row ``i`` holds tensor ``i``'s, for :func:`store`. To a CUDA
    device from pinned memory, asynchronously: a copy from pageable memory would wait for the
    work queued before it (the Adam step) and hold the host back."""
    rows = torch.tensor([[as_int32(k & 0xFFFFFFFF) for k in row] for row in keys], dtype=torch.int32)
    if device.type == "cuda":
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)


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
    """Compile the stores and the join on two 16-element tensors and check them against the torch ops."""
    from amp_plugin.master_weights import _split
    from amp_plugin.master_weights._stochastic import round_stochastic

    gen = torch.Generator().manual_seed(0)
    value = list(torch.randn(2, 16, generator=gen).to(device).unbind(0))
    weight = list(torch.empty(2, 16, dtype=torch.bfloat16, device=device).unbind(0))
    remainder = list(torch.empty(2, 16, dtype=torch.int16, device=device).unbind(0))
    m16, v16 = (list(torch.empty(2, 16, dtype=torch.bfloat16, device=device).unbind(0)) for _ in range(2))
    abs_value = [v.abs() for v in value]
    keys = keys_tensor([(1, 2), (3, 4)], device)
    for rem in (remainder, None):
        store(value, weight, rem, (value, abs_value, m16, v16), keys, True)
    expected = torch.empty_like(weight[1])
    round_stochastic(abs_value[1], expected, 4, low=True)
    if not torch.equal(v16[1].view(torch.int16), expected.view(torch.int16)):
        raise RuntimeError("the compiled store rounds otherwise than the torch ops")
    _split.split_into(value[1], weight[1], remainder[1])
    if not torch.equal(join(weight[1], remainder[1]), value[1]):
        raise RuntimeError("the compiled join does not give the master back")
