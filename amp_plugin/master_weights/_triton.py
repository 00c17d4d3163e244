"""The bit handling of the lean step as two Triton kernels per group (``fused="triton"``; automatic on CUDA).

The same two passes as :mod:`amp_plugin.master_weights._compiled` around torch's fused Adam,
:func:`prepare` (weight + remainder -> FP32, BF16 moments -> FP32, and the half gradients upcast and
unscaled into FP32, which the compiled passes leave to torch's multi-tensor ops: one launch per tensor
for the upcast, one more pass for the unscale) and :func:`store` (the stepped
FP32 value into the weight and its remainder or stochastically rounded, the FP32 moments into
their BF16 tensors), but each is one launch for every tensor of a group and device, where
Inductor's code launches one kernel per tensor (about 40 us of host time apiece on an H200's
host: 78 tensors, two passes, some 6 ms a step). A program handles :data:`BLOCK` elements of one
tensor: which tensor, and where, it reads from a table of blocks (kept per pattern of sizes),
and the tensors' addresses and rounding keys from a table of ``int64`` built per call, as
torch's ``multi_tensor_apply`` does with its kernel arguments.

Everything is integer arithmetic on the bit patterns (the split, the hash of
:mod:`~amp_plugin.master_weights._stochastic` in wrapping int32, the upcasts as shifts), so the
kernels give the torch ops' bits on every backend; the one float conversion, the round to
nearest of ``moments_rounding="nearest"``, is the device's own on a GPU (``cvt.rn.bf16.f32`` on
CUDA, as torch's ``copy_``). On the CPU the kernels run in Triton's interpreter (numpy: slow, for
tests of the numerics; ``fused="triton"`` picks it there only when named), which rounds to nearest
in integers (its own conversion truncates): torch's bits for every number, NaN as c10's scalar
rule writes it (0x7FC0; torch's vectorized CPU conversion writes 0xFFFF).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import OrderedDict
from typing import Any

import torch

from amp_plugin.fused import counted_as_build
from amp_plugin.master_weights._passes import half_grads_dtype
from amp_plugin.master_weights._stochastic import INDEX_MULTIPLIER, MIX1, MIX2, as_int32

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as err:  # no Triton: the compiled or the torch-ops path runs the step
    triton = None
    _IMPORT_ERROR: Exception | None = err
else:
    _IMPORT_ERROR = None

__all__ = ["BLOCK", "available", "keys_tensor", "prepare", "store"]

L = list[torch.Tensor]
BLOCK = 1024
"""Elements per program."""
if triton is not None:  # the hash's constants as int32 (a kernel reads only constexpr globals)
    _M = tl.constexpr(as_int32(INDEX_MULTIPLIER))
    _MIX1 = tl.constexpr(as_int32(MIX1))
    _MIX2 = tl.constexpr(as_int32(MIX2))
# The rows of a table, one column per tensor: 0 numel; the addresses of 1 the FP32 value, 2 exp_avg and
# 3 exp_avg_sq in FP32, 4 the BF16 weight, 5 its remainder, 6 exp_avg and 7 exp_avg_sq in BF16; then a
# store's 8 the weight's and 9 the moments' rounding keys, or a prepare's 8 the half gradient and 9 its
# FP32 copy. A prepare writes rows 1-3 from 4-7 (and 9 from 8), a store the reverse.
GRAD_KINDS = {torch.bfloat16: 1, torch.float16: 2}
"""A prepare's ``GRADS``: the half gradients' dtype (0, absent: none; the caller makes them)."""


def _prepare_kernel(
    table,
    blocks,
    n,
    inv,
    WEIGHTS: tl.constexpr,
    REMAINDERS: tl.constexpr,
    MOMENTS: tl.constexpr,
    GRADS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``p``: the block ``blocks[2p + 1]`` elements into tensor ``blocks[2p]``; ``table[r * n + t]``:
    row ``r`` of tensor ``t``. ``GRADS`` (:data:`GRAD_KINDS`): the half gradients upcast (exact), times
    ``inv[0]`` if ``SCALED``, as torch's unscale multiplies (a factor of one leaves a value as it is)."""
    pid = tl.program_id(0)
    t = tl.load(blocks + 2 * pid)
    offs = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK)
    mask = offs < tl.load(table + t)
    if GRADS:
        if GRADS == 1:  # BF16: its bits are the FP32 value's high half
            half = tl.load(table + 8 * n + t).to(tl.pointer_type(tl.int16))
            grad_bits = (tl.load(half + offs, mask=mask).to(tl.int32) & 0xFFFF) << 16
            grad = grad_bits.to(tl.float32, bitcast=True)
        else:
            half16 = tl.load(table + 8 * n + t).to(tl.pointer_type(tl.float16))
            grad = tl.load(half16 + offs, mask=mask).to(tl.float32)
        if SCALED:
            factor = tl.load(inv)
            grad = tl.where(factor == 1.0, grad, grad * factor)
        grad32 = tl.load(table + 9 * n + t).to(tl.pointer_type(tl.float32))
        tl.store(grad32 + offs, grad, mask=mask)
    if WEIGHTS:
        weight = tl.load(table + 4 * n + t).to(tl.pointer_type(tl.int16))
        bits = (tl.load(weight + offs, mask=mask).to(tl.int32) & 0xFFFF) << 16
        if REMAINDERS:
            remainder = tl.load(table + 5 * n + t).to(tl.pointer_type(tl.int16))
            bits += tl.load(remainder + offs, mask=mask).to(tl.int32)
        value = tl.load(table + 1 * n + t).to(tl.pointer_type(tl.int32))
        tl.store(value + offs, bits, mask=mask)
    if MOMENTS:
        m16 = tl.load(table + 6 * n + t).to(tl.pointer_type(tl.int16))
        v16 = tl.load(table + 7 * n + t).to(tl.pointer_type(tl.int16))
        m32 = tl.load(table + 2 * n + t).to(tl.pointer_type(tl.int32))
        v32 = tl.load(table + 3 * n + t).to(tl.pointer_type(tl.int32))
        tl.store(m32 + offs, (tl.load(m16 + offs, mask=mask).to(tl.int32) & 0xFFFF) << 16, mask=mask)
        tl.store(v32 + offs, (tl.load(v16 + offs, mask=mask).to(tl.int32) & 0xFFFF) << 16, mask=mask)


def _store_kernel(
    table,
    blocks,
    n,
    WEIGHTS: tl.constexpr,
    REMAINDERS: tl.constexpr,
    MOMENTS: tl.constexpr,
    SR_MOMENTS: tl.constexpr,
    DEVICE_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``p`` as in :func:`_prepare_kernel`. (The hash and the rounding are written out where
    each is used: Triton's interpreter, which runs this on the CPU, cannot call ``@triton.jit`` helpers
    from a kernel it interprets.) The hash is
    :func:`~amp_plugin.master_weights._stochastic.element_hash` in int32 (products wrap), the
    logical shifts arithmetic ones masked; a stochastic rounding is ``(bits + random) >> 16``,
    NaN -> 0x7FC0 (:func:`~amp_plugin.master_weights._stochastic.round_stochastic`)."""
    pid = tl.program_id(0)
    t = tl.load(blocks + 2 * pid)
    offs = tl.load(blocks + 2 * pid + 1) + tl.arange(0, BLOCK)
    mask = offs < tl.load(table + t)
    index = offs.to(tl.int32)
    if WEIGHTS:
        value = tl.load(table + 1 * n + t).to(tl.pointer_type(tl.int32))
        bits = tl.load(value + offs, mask=mask)
        weight = tl.load(table + 4 * n + t).to(tl.pointer_type(tl.int16))
        if REMAINDERS:  # bf16_split: to nearest, ties away from zero, and the remainder
            low = bits & 0xFFFF
            tl.store(weight + offs, (((bits >> 16) & 0xFFFF) + ((low >> 15) & 1)).to(tl.int16), mask=mask)
            remainder = tl.load(table + 5 * n + t).to(tl.pointer_type(tl.int16))
            tl.store(remainder + offs, low.to(tl.int16), mask=mask)
        else:  # stochastic: the high 16 bits of the weight key's hash
            h = index * _M + tl.load(table + 8 * n + t).to(tl.int32)
            h = h ^ ((h >> 16) & 0xFFFF)
            h = h * _MIX1
            h = h ^ ((h >> 13) & 0x7FFFF)
            h = h * _MIX2
            h = h ^ ((h >> 16) & 0xFFFF)
            rounded = (bits + ((h >> 16) & 0xFFFF)) >> 16
            rounded = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)
            tl.store(weight + offs, rounded.to(tl.int16), mask=mask)
    if MOMENTS:
        m32 = tl.load(table + 2 * n + t).to(tl.pointer_type(tl.int32))
        v32 = tl.load(table + 3 * n + t).to(tl.pointer_type(tl.int32))
        m_bits = tl.load(m32 + offs, mask=mask)
        v_bits = tl.load(v32 + offs, mask=mask)
        if SR_MOMENTS:  # one hash for both: exp_avg takes its high 16 bits, exp_avg_sq its low 16
            m16 = tl.load(table + 6 * n + t).to(tl.pointer_type(tl.int16))
            v16 = tl.load(table + 7 * n + t).to(tl.pointer_type(tl.int16))
            h = index * _M + tl.load(table + 9 * n + t).to(tl.int32)
            h = h ^ ((h >> 16) & 0xFFFF)
            h = h * _MIX1
            h = h ^ ((h >> 13) & 0x7FFFF)
            h = h * _MIX2
            h = h ^ ((h >> 16) & 0xFFFF)
            m_rounded = (m_bits + ((h >> 16) & 0xFFFF)) >> 16
            m_rounded = tl.where((m_bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, m_rounded)
            v_rounded = (v_bits + (h & 0xFFFF)) >> 16
            v_rounded = tl.where((v_bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, v_rounded)
            tl.store(m16 + offs, m_rounded.to(tl.int16), mask=mask)
            tl.store(v16 + offs, v_rounded.to(tl.int16), mask=mask)
        elif DEVICE_ROUNDING:  # to nearest, the device's conversion (cvt.rn.bf16.f32 on CUDA, as torch's copy_)
            m16 = tl.load(table + 6 * n + t).to(tl.pointer_type(tl.bfloat16))
            v16 = tl.load(table + 7 * n + t).to(tl.pointer_type(tl.bfloat16))
            tl.store(m16 + offs, m_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
            tl.store(v16 + offs, v_bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
        else:  # to nearest, ties to even, NaN -> 0x7FC0 (c10's rule; the interpreter's conversion truncates)
            m16 = tl.load(table + 6 * n + t).to(tl.pointer_type(tl.int16))
            v16 = tl.load(table + 7 * n + t).to(tl.pointer_type(tl.int16))
            m_rounded = (m_bits + 0x7FFF + ((m_bits >> 16) & 1)) >> 16
            m_rounded = tl.where((m_bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, m_rounded)
            v_rounded = (v_bits + 0x7FFF + ((v_bits >> 16) & 1)) >> 16
            v_rounded = tl.where((v_bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, v_rounded)
            tl.store(m16 + offs, m_rounded.to(tl.int16), mask=mask)
            tl.store(v16 + offs, v_rounded.to(tl.int16), mask=mask)


_kernels: dict[tuple[str, bool], Any] = {}
_blocks: OrderedDict[tuple[Any, ...], torch.Tensor] = OrderedDict()
_state: dict[str, Any] = {"ok": {}, "error": {}}


def _kernel(name: str, device: torch.device) -> Any:
    """The kernel ``name`` for ``device``: Triton's JIT on a GPU, its interpreter on the CPU."""
    interpret = device.type == "cpu"
    if (name, interpret) not in _kernels:
        fn = {"prepare": _prepare_kernel, "store": _store_kernel}[name]
        _kernels[name, interpret] = InterpretedFunction(fn) if interpret else triton.jit(fn)
    return _kernels[name, interpret]


def _block_table(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[tensor, start]`` of every :data:`BLOCK` of ``numels``, int64 on ``device``, kept for the
    last 128 patterns of sizes (a model has one per slab of its groups' steps; the slabs that hold one
    whole piece of ``SLAB_ELEMENTS`` share one; a table is at most 256 KiB)."""
    key = (device, numels)
    table = _blocks.get(key)
    if table is None:
        counts = torch.tensor([-(-n // BLOCK) for n in numels], dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
        first = torch.cumsum(counts, 0) - counts
        start = (torch.arange(int(counts.sum())) - torch.repeat_interleave(first, counts)) * BLOCK
        table = torch.stack([tensor, start], 1).reshape(-1).to(device)
        _blocks[key] = table
        if len(_blocks) > 128:
            _blocks.popitem(last=False)
    _blocks.move_to_end(key)
    return table


def _to_device(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """``rows`` as one int64 tensor on ``device``: from pinned memory without a host wait on CUDA."""
    host = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def _addresses(tensors: L | None, n: int) -> list[int]:
    return [0] * n if tensors is None else [t.data_ptr() for t in tensors]


def _launch(
    name: str, rows: list[list[int]], numels: tuple[int, ...], device: torch.device, *args: Any, **flags: Any
) -> None:
    if not any(numels):
        return
    blocks = _block_table(numels, device)
    table = _to_device(rows, device)
    grid = (blocks.numel() // 2,)
    if device.type == "cuda":  # Triton launches on the current device: the tensors' one
        with torch.cuda.device(device):
            _kernel(name, device)[grid](table, blocks, len(numels), *args, BLOCK=BLOCK, **flags)
    else:
        _kernel(name, device)[grid](table, blocks, len(numels), *args, BLOCK=BLOCK, **flags)


def prepare(
    weights: L | None,
    remainders: L | None,
    moments: tuple[L, L] | None,
    grads: L | None = None,
    inv: torch.Tensor | None = None,
) -> tuple[L | None, L | None, L | None, L | None]:
    """:func:`amp_plugin.master_weights._compiled.prepare` in one launch, the FP32 gradients with them
    (``grads`` upcast and times ``inv``, ``None``: not scaled, where :func:`~._passes.half_grads_dtype`
    allows; the bits of ``_grads.eager_unscale``). The FP32 tensors are views of one new buffer.
    Tensors contiguous, of one device."""
    if weights is None and moments is None:
        return None, None, None, None
    like = weights if weights is not None else moments[0]  # type: ignore[index]
    numels = tuple(t.numel() for t in like)
    shapes = [t.shape for t in like]
    grads_dtype = half_grads_dtype(grads, inv)
    kind = 0 if grads_dtype is None else GRAD_KINDS[grads_dtype]
    parts = (weights is not None) + 2 * (moments is not None) + (kind != 0)
    flat = torch.empty(parts, sum(numels), dtype=torch.float32, device=like[0].device)
    views = [[t.view(shape) for t, shape in zip(part.split(numels), shapes)] for part in flat.unbind(0)]
    n = len(numels)
    values = views.pop(0) if weights is not None else None
    g32s = views.pop() if kind else None
    m32s, v32s = views if moments is not None else (None, None)
    rows = [
        list(numels),
        _addresses(values, n),
        _addresses(m32s, n),
        _addresses(v32s, n),
        _addresses(weights, n),
        _addresses(remainders, n),
        _addresses(moments[0] if moments is not None else None, n),
        _addresses(moments[1] if moments is not None else None, n),
        _addresses(grads if kind else None, n),
        _addresses(g32s, n),
    ]
    flags = dict(
        WEIGHTS=weights is not None,
        REMAINDERS=remainders is not None,
        MOMENTS=moments is not None,
        GRADS=kind,
        SCALED=kind != 0 and inv is not None,
    )
    factor = inv if kind and inv is not None else flat  # a pointer the kernel leaves unread without SCALED
    _launch("prepare", rows, numels, like[0].device, factor, **flags)
    return values, m32s, v32s, g32s


def keys_tensor(keys: list[tuple[int, int]], device: torch.device) -> list[tuple[int, int]]:
    """The (weight, moments) rounding keys of each tensor, as int32 values: they travel in :func:`store`'s
    table (one copy to the device per launch)."""
    return [(as_int32(w & 0xFFFFFFFF), as_int32(m & 0xFFFFFFFF)) for w, m in keys]


def store(
    values: L,
    weights: L | None,
    remainders: L | None,
    moments: tuple[L, L, L, L] | None,
    keys: list[tuple[int, int]],
    stochastic_moments: bool,
) -> None:
    """:func:`amp_plugin.master_weights._compiled.store` in one launch (``keys``: :func:`keys_tensor`)."""
    n = len(values)
    numels = tuple(t.numel() for t in values)
    m32s, v32s, m16s, v16s = moments if moments is not None else (None,) * 4
    rows = [
        list(numels),
        _addresses(values, n),
        _addresses(m32s, n),
        _addresses(v32s, n),
        _addresses(weights, n),
        _addresses(remainders, n),
        _addresses(m16s, n),
        _addresses(v16s, n),
        [k[0] for k in keys],
        [k[1] for k in keys],
    ]
    flags = dict(
        WEIGHTS=weights is not None,
        REMAINDERS=remainders is not None,
        MOMENTS=moments is not None,
        SR_MOMENTS=bool(stochastic_moments),
        DEVICE_ROUNDING=values[0].device.type != "cpu",
    )
    _launch("store", rows, numels, values[0].device, **flags)


def available(device: torch.device, strict: bool) -> bool:
    """Whether the kernels run on ``device``: Triton importable, and on a GPU compiled (and checked
    against the torch ops) the first time, said once on stderr. A failure warns once and returns
    ``False`` (``strict``: raises)."""
    key = device.type
    if key not in _state["ok"]:
        try:
            if triton is None:
                raise RuntimeError(f"Triton is not importable ({_IMPORT_ERROR})")
            if device.type != "cpu":
                print(
                    "amp_plugin: compiling the lean step's Triton kernels, once per process (Triton caches them "
                    "on disk); the time is not counted in the run's steps/s.",
                    file=sys.stderr,
                    flush=True,
                )
            begin = time.perf_counter()
            with counted_as_build():
                _probe(device)
            if device.type != "cpu":
                print(f"amp_plugin: compiled in {time.perf_counter() - begin:.0f} s.", file=sys.stderr, flush=True)
            _state["ok"][key] = True
        except Exception as err:  # any failure: the next kernel (compiled, or torch's ops) runs the step
            _state["ok"][key] = False
            _state["error"][key] = err
            if device.type != "cpu" or strict:
                warnings.warn(
                    f"the lean step's Triton kernels are unavailable on {device.type} ({type(err).__name__}: {err}); "
                    "the step runs without them (same bits, slower).",
                    RuntimeWarning,
                    stacklevel=3,
                )
    if not _state["ok"][key] and strict:
        error = _state["error"][key]
        raise RuntimeError(f"fused='triton': {error}") from error
    return bool(_state["ok"][key])


def _probe(device: torch.device) -> None:
    """Every variant of both kernels on three tensors (one element, a few, past a block), each checked
    bit for bit against the torch ops on ``device`` (the gradients' copies against ``eager_unscale``'s):
    kernels that compute otherwise are not used."""
    from amp_plugin.master_weights import _split
    from amp_plugin.master_weights._grads import eager_unscale
    from amp_plugin.master_weights._stochastic import round_stochastic

    gen = torch.Generator().manual_seed(0)
    sizes = (1, 40, BLOCK + 3)
    values = [torch.randn(n, generator=gen).to(device) for n in sizes]
    squares = [v * v for v in values]
    rows = [(1 + i, 7 + i) for i in range(len(sizes))]  # (weight, moments) keys
    keys = keys_tensor(rows, device)

    def new(dtype: torch.dtype) -> L:
        return [torch.zeros(n, dtype=dtype, device=device) for n in sizes]

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)

    def same(got: L, expected: L, what: str) -> None:
        if not all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expected, strict=True)):
            raise RuntimeError(f"the Triton kernels compute {what} otherwise than the torch ops")

    for weights_kind in ("split", "stochastic", None):
        for moments_kind in ("stochastic", "nearest", None):
            if weights_kind is None and moments_kind is None:
                continue
            weights = new(torch.bfloat16) if weights_kind else None
            remainders = new(torch.int16) if weights_kind == "split" else None
            m16s, v16s = new(torch.bfloat16), new(torch.bfloat16)
            moments = (values, squares, m16s, v16s) if moments_kind else None
            store(values, weights, remainders, moments, keys, moments_kind == "stochastic")
            if weights is not None:
                w, r = new(torch.bfloat16), new(torch.int16)
                for i, v in enumerate(values):
                    if remainders is not None:
                        _split.split_into(v, w[i], r[i])
                    else:
                        round_stochastic(v, w[i], rows[i][0])
                same(weights, w, f"the {weights_kind} weights")
                if remainders is not None:
                    same(remainders, r, "the remainders")
            if moments_kind is not None:
                m, v2 = new(torch.bfloat16), new(torch.bfloat16)
                for i, v in enumerate(values):
                    if moments_kind == "stochastic":
                        round_stochastic(v, m[i], rows[i][1])
                        round_stochastic(squares[i], v2[i], rows[i][1], low=True)
                    else:
                        m[i].copy_(v)
                        v2[i].copy_(squares[i])
                same(m16s, m, f"the {moments_kind} exp_avg")
                same(v16s, v2, f"the {moments_kind} exp_avg_sq")
            joined, m32s, v32s, _ = prepare(weights, remainders, (m16s, v16s) if moments_kind else None)
            if joined is not None and weights is not None:
                rems: list[Any] = remainders if remainders is not None else [None] * len(sizes)
                up = [w.float() if r is None else _split.join(w, r) for w, r in zip(weights, rems)]
                same(joined, up, "the FP32 weights")
            if m32s is not None and v32s is not None:
                same(m32s, [m.float() for m in m16s], "the FP32 exp_avg")
                same(v32s, [v.float() for v in v16s], "the FP32 exp_avg_sq")
    moments16 = (new(torch.bfloat16), new(torch.bfloat16))
    for dtype in GRAD_KINDS:
        grads = [v.to(dtype) for v in values]
        for inv in (None, torch.full((1,), 2.0**-7 * 3, device=device), torch.ones((), device=device)):
            *_, grads32 = prepare(None, None, moments16, grads, inv)
            if grads32 is None:
                raise RuntimeError(f"the Triton prepare left the {dtype} gradients to the caller")
            same(grads32, eager_unscale(grads, inv, None), f"the {dtype} gradients' FP32 copies")
