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
still torch's own fused kernel. The functions themselves are in ``_compiled_bits.py``: on the CPU
the tensors of an even size go through them in pairs of elements (int32 and int64 lanes, which
Inductor vectorizes; int16 it does not), the others one element per lane.

The first call compiles (tens of seconds on a small CPU; Inductor caches the generated code on disk,
so a later process loads it, keyed by the CPU's vector width too: :func:`_isa_options`): said once on
stderr, and the time is counted apart from training's (:func:`amp_plugin.fused.counted_as_build`).
:func:`available` compiles on small tensors before a step changes anything, so a failure to compile
sends the step down the torch-ops path. Each graph's first call is checked against the same function
uncompiled (:func:`_first_call`); a batch that fails to compile later (a length not seen by the probe),
or whose graph gives other bits, runs the same functions uncompiled from then on (the same bits,
slower), with a warning, once.
"""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.fx.experimental._config as fx_config

from amp_plugin.fused import counted_as_build
from amp_plugin.master_weights._compiled_bits import FUNCTIONS, pairable
from amp_plugin.master_weights._compiled_probe import probe as _probe
from amp_plugin.master_weights._passes import half_grads_dtype
from amp_plugin.master_weights._stochastic import as_int32

__all__ = ["available", "join", "keys_tensor", "prepare", "store"]

T = torch.Tensor
L = list[torch.Tensor]
BATCH_SIZES = (16, 4, 1)
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
        _compiled[name] = torch.compile(FUNCTIONS[name], dynamic=True, fullgraph=True, options=_isa_options())
    return _compiled[name]


def _isa_options() -> dict[str, Any]:
    """The vector width Inductor generates C++ for here, named in the compile options, which are part of the key
    of Inductor's on-disk graph cache. In torch 2.13 that key leaves out the vector ISA picked (from the CPU, or
    ``ATEN_CPU_CAPABILITY``), so a cache shared by runs or machines of different ISAs hands code generated for one
    to a compile for another: after an AVX-512 run, an AVX2 run's upcast left 16 FP32 values of every 32 wrong,
    and ``ATEN_CPU_CAPABILITY=default`` failed to compile. The width keys them apart (and picks the same
    ISA: the first this CPU has of that width)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": pick_vec_isa().bit_width()}


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
    """``FUNCTIONS[name]`` over ``lists`` (``None``: absent) batch by batch, compiled; a batch that
    fails to compile runs uncompiled (the same torch ops), said once. ``rest[0]``, if any, is the
    keys tensor, cut with the lists; the results of the batches are concatenated."""
    out: list[Any] = []
    for part in _runs(next(x for x in lists if x is not None)):
        args: list[Any] = [None if x is None else x[part] for x in lists]
        if rest:
            args += [rest[0][part], *rest[1:]]
        out += _call(name, part.stop - part.start, args) or []
    return out


def _run_laid_out(name: str, lists: Sequence[L | None], pair_dtypes: Sequence[Any], *rest: Any) -> list[Any]:
    """:func:`_run` of ``name`` over the tensors one element per lane, and, on the CPU, of ``name + "_pairs"``
    over those whose tensors of the lists with a ``pair_dtypes`` entry are all :func:`~._compiled_bits.pairable`,
    viewed as it says (``None``: as they are); the results in the tensors' order."""
    first = next(x for x in lists if x is not None)
    count = len(first)
    checked = [x for x, d in zip(lists, pair_dtypes) if x is not None and d is not None]
    on_cpu = first[0].device.type == "cpu"  # Inductor's Triton code handles int16 as it is
    in_pairs = [on_cpu and bool(checked) and all(pairable(x[i]) for x in checked) for i in range(count)]
    results: list[Any] = [None] * count
    for paired in (False, True):
        idx = [i for i in range(count) if in_pairs[i] == paired]
        if not idx:
            continue
        if paired:
            sub = [
                None if x is None else [x[i] if d is None else x[i].view(d) for i in idx]
                for x, d in zip(lists, pair_dtypes)
            ]
        else:
            sub = [None if x is None else [x[i] for i in idx] for x in lists]
        keys = () if not rest else (rest[0] if len(idx) == count else rest[0][idx], *rest[1:])
        for i, result in zip(idx, _run(f"{name}_pairs" if paired else name, sub, *keys)):
            results[i] = result
    return results


def _as_float(value: torch.Tensor) -> torch.Tensor:
    """An FP32 result: as it is, or from pairs (int64)."""
    return value.view(torch.float32) if value.dtype is torch.int64 else value


def _call(name: str, length: int, args: list[Any]) -> Any:
    if not _state.get("eager"):
        try:
            first = args[0][0]  # what a graph is compiled for: the batch's length, size class, device, flags
            graph = (name, length, size_class(first), first.device.type, *(a for a in args if isinstance(a, bool)))
            # no_grad always: bit handling has no gradient, and a graph is compiled for one grad mode (a
            # call from where gradients are on, as the probe's from a test, would compile them all again)
            with _no_duck_shapes(), torch.no_grad():
                if graph in _seen:
                    return _fn(name)(*args)
                with counted_as_build():  # the first call of a kind compiles, and is checked
                    result = _first_call(name, args)
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
    with torch.no_grad():
        return FUNCTIONS[name](*args)


CHECK_ELEMENTS = 1 << 16
"""Of each tensor, at most this many elements (plus its size's remainder modulo 64, so the loops' tails run as on
the whole) go through a graph's first-call check (:func:`_first_call`): a few MiB a batch, whatever its size."""


def _first_call(name: str, args: list[Any]) -> Any:
    """A graph's first call, checked: the compiled function and the same function uncompiled each run on copies of
    the first :data:`CHECK_ELEMENTS` elements of the batch's tensors (a store writes into its arguments), and what
    they return and write must have the same bits, or it raises (the caller then runs this batch and the later
    ones uncompiled); then the compiled function runs on the tensors themselves (the same graph: sizes and
    offsets are symbols). Code generated wrong, or loaded from a cache for other hardware, is caught at its first
    use, before the step goes on with it; once per graph, counted as build time."""
    checked, copies = _prefixes(args), _prefixes(args)
    made = _fn(name)(*checked)
    wanted = FUNCTIONS[name](*copies)
    lists = [(a, c) for a, c in zip(checked, copies) if isinstance(a, list)]
    if not (_same_bits(_tensors(made), _tensors(wanted)) and all(_same_bits(a, c) for a, c in lists)):
        raise RuntimeError(f"the compiled {name!r} gives other bits than the same function uncompiled")
    return _fn(name)(*args)


def _prefixes(args: list[Any]) -> list[Any]:
    """``args`` with copies of the first elements of each tensor of a list (all of a tensor of at most
    :data:`CHECK_ELEMENTS`; a larger one keeps its size's remainder modulo 64); other arguments as they are."""

    def head(t: torch.Tensor) -> torch.Tensor:
        n = t.numel()
        return t[: n if n <= CHECK_ELEMENTS else CHECK_ELEMENTS + n % 64].clone()

    return [[head(t) for t in a] if isinstance(a, list) else a for a in args]


def _tensors(result: Any) -> L:
    """The tensors a function returned: a list of tensors or of tuples of them (``None``: none)."""
    return [t for item in result or [] for t in (item if isinstance(item, tuple) else (item,))]


def _same_bits(made: L, wanted: L) -> bool:
    """Whether two lists of flat tensors hold the same bytes (NaN payloads included)."""
    return len(made) == len(wanted) and all(
        a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(made, wanted)
    )


def _flat(tensors: Sequence[torch.Tensor]) -> L:
    return [t.detach().view(-1) for t in tensors]


_I32, _I64 = torch.int32, torch.int64


def join(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 master of a ``bf16_split`` parameter (as ``_split.join``), one fused pass."""
    return _joined(_flat([weight]), _flat([remainder]))[0].view(weight.shape)


def _joined(weights: L, remainders: L) -> L:
    """The FP32 values of flat BF16 ``weights`` and their ``remainders``."""
    return [_as_float(v) for v in _run_laid_out("join", [weights, remainders], [_I32, _I32])]


def prepare(
    weights: L | None,
    remainders: L | None,
    moments: tuple[L, L] | None,
    grads: L | None = None,
    inv: torch.Tensor | None = None,
) -> tuple[L | None, L | None, L | None, L | None]:
    """The FP32 values a step updates, one fused pass per tensor: the weights' (joined with their
    ``remainders``, or upcast; ``None``: the caller has FP32 masters) and the BF16 ``moments``
    ``(m16s, v16s)`` upcast (``None``: FP32 moments, used as they are); and the FP32 copies of the half
    ``grads`` times ``inv`` (``None``: not scaled) in a pass of their own, where
    :func:`~._passes.half_grads_dtype` allows (else the last item is ``None``: the caller makes them).
    Tensors of one device."""
    shapes = [t.shape for t in (weights if weights is not None else cast("tuple", moments)[0])]

    def shaped(flat: list[T]) -> L:
        return [t.view(shape) for t, shape in zip(flat, shapes)]

    if weights is None and moments is None:
        return None, None, None, None
    values, m32s, v32s = _prepare_values(weights, remainders, moments, shaped)
    if half_grads_dtype(grads, inv) is None:
        return values, m32s, v32s, None
    flat = _flat(cast("L", grads))
    if inv is None:
        grads32 = _run("up_grads", [flat])
    else:  # one row per tensor, as the keys: batches cut it with the tensors
        grads32 = _run("up_grads_scaled", [flat], inv.reshape(1).expand(len(flat)))
    return values, m32s, v32s, shaped(grads32)


def _prepare_values(
    weights: L | None, remainders: L | None, moments: tuple[L, L] | None, shaped: Any
) -> tuple[L | None, L | None, L | None]:
    """:func:`prepare`'s FP32 values and moments (``weights`` and ``moments`` not both ``None``)."""
    w = None if weights is None else _flat(weights)
    r = None if remainders is None else _flat(remainders)
    if moments is None:
        w = cast("L", w)  # weights and moments are not both None
        return shaped(_joined(w, r) if r is not None else _run("up_weight", [w])), None, None
    m16, v16 = _flat(moments[0]), _flat(moments[1])
    if w is None:
        m32, v32 = zip(*_run("up_moments", [m16, v16]))
        return None, shaped(list(m32)), shaped(list(v32))
    if r is None:
        triples = _run("up", [w, m16, v16])
    else:
        triples = _run_laid_out("join_up", [w, r, m16, v16], [_I32, _I32, None, None])
    value, m32, v32 = zip(*triples)
    return shaped([_as_float(v) for v in value]), shaped(list(m32)), shaped(list(v32))


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
    dtypes: list[Any] = [None if weights is None else _I64, _I32, _I32]  # the masters of "moments" go unread
    if moments is None:
        if weights is not None:
            _run_laid_out(name, lists, dtypes, keys)
        return
    moment_dtypes = [_I64, _I64, _I32, _I32] if stochastic_moments else [None] * 4  # to nearest: as they are
    _run_laid_out(
        name if weights is None else f"{name}_moments",
        lists + [_flat(t) for t in moments],
        dtypes + moment_dtypes,
        keys,
        stochastic_moments,
    )


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
