"""Stochastic rounding to BF16 from a seeded, counter-based generator (``master="stochastic"``).

Without a master, an update smaller than half a BF16 ulp would always be rounded away. Rounded
stochastically (up, in magnitude, with probability equal to the fraction of an ulp the FP32
value lies above the lower BF16 number) it lands on average: ``E[round(x)] == x``.

The random bits are a hash (MurmurHash3's 32-bit finaliser) of the element's index and a key per
tensor and step, derived from the generator's seed, its step counter and the tensor's position.
So the bits depend on nothing else (threads, vector width, device), a resumed run draws what the
uninterrupted one would have (the state dict holds the seed and the counter), and the CPU kernel
(``adam_step_bf16_``) and these torch ops give the same weights.

BF16 Adam moments are stored the same way (``moments_rounding="stochastic"``, the default): a
moment rounded to nearest cannot move by less than half its ulp, so ``beta * v`` rounds back to
``v`` for every beta above ``1 - 2**-9`` (torch's default beta2 0.999 included) and
``exp_avg_sq`` could only grow. Rounded stochastically it decays as the FP32 moment does, on
average. The moments of a tensor have a key of their own (:func:`moments_key`), derived from the
tensor's key, so their bits are independent of the weight's; they share one hash per element:
``exp_avg`` takes its high 16 bits (as every rounding does), ``exp_avg_sq`` its low 16 bits
(``low=True``), so the fused step hashes each element once for both. Other per-element state
(``momentum_buffer``, ``square_avg``, ...) has a key per name (:func:`state_key`).

Every rank of a process group must draw the same bits (the same rounding of the same all-reduced
values keeps replicas equal): :func:`shared_seed` takes rank 0's seed. A shard of a larger tensor
rounds its elements with the bits of their index in the whole tensor (:func:`offset_key`).
"""

from __future__ import annotations

import operator
import zlib
from typing import Any

import torch

__all__ = [
    "FREEZE_THRESHOLD",
    "SRGenerator",
    "moments_key",
    "offset_key",
    "round_stochastic",
    "shared_seed",
    "state_key",
    "state_low_bits",
]
# element_hash, shr32 and as_int32 are the compiled step's (_compiled.py, _compiled_bits.py), not the package's API

_MASK32 = 0xFFFFFFFF
INDEX_MULTIPLIER = 0x9E3779B1
MIX1 = 0x85EBCA6B
MIX2 = 0xC2B2AE35
_MOMENTS_SALT = 0x6A09E667  # the kernel's kMomentsSalt

FREEZE_THRESHOLD = 1 - 2.0**-9
"""A BF16 moment rounded to nearest cannot shrink when its beta is above this (0.998046875)."""


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * MIX1) & _MASK32
    h ^= h >> 13
    h = (h * MIX2) & _MASK32
    return h ^ (h >> 16)


def moments_key(key: int) -> int:
    """The key of the stochastic roundings of Adam's ``exp_avg`` (high 16 bits of the hash) and
    ``exp_avg_sq`` (low 16 bits) of the tensor with ``key``."""
    return _fmix32(key ^ _MOMENTS_SALT)


def state_key(key: int, name: str) -> int:
    """The rounding key of the per-element state ``name`` of the tensor with ``key``: Adam's
    moments get :func:`moments_key` (``exp_avg_sq`` with :func:`state_low_bits`), any other state
    (``momentum_buffer``, ``square_avg``, ...) a key salted with the CRC-32 of its name."""
    if name in ("exp_avg", "exp_avg_sq"):
        return moments_key(key)
    return _fmix32(key ^ zlib.crc32(name.encode()))


def state_low_bits(name: str) -> bool:
    """Whether the state ``name`` is rounded with the low 16 bits of its hash (``exp_avg_sq``,
    which shares ``exp_avg``'s key and hash)."""
    return name == "exp_avg_sq"


def offset_key(key: int, offset: int) -> int:
    """The key that gives element ``i`` the bits of element ``offset + i`` under ``key`` (a shard
    that starts at flat index ``offset`` of its whole tensor): the hash reads ``i * M + key``."""
    return (key + offset * INDEX_MULTIPLIER) & _MASK32


def shared_seed(seed: int | None) -> int:
    """``seed`` (default: drawn from torch's generator, so ``torch.manual_seed`` fixes it), or, with
    a ``torch.distributed`` process group initialized, rank 0's: every rank rounds alike, even when
    the ranks were seeded differently (``seed + rank``, as many scripts do). A collective: every rank
    of the default group must build its optimizer (as DDP, FSDP and Lightning do)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"sr_seed={seed!r} is not allowed: sr_seed must be an int or None.")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box: list[Any] = [seed]
        dist.broadcast_object_list(box, src=0)
        seed = int(box[0])
    return seed


class SRGenerator:
    """The seed and step counter of stochastic rounding.

    Args:
        seed: any int (its low 64 bits are used).
    """

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"sr_seed={seed!r} is not allowed: sr_seed must be an int or None.")
        self.seed = seed & 0xFFFFFFFFFFFFFFFF
        self.counter = 0

    def keys(self, positions: list[int]) -> list[int]:
        """Advance the counter (one step) and return the 32-bit key of each tensor position."""
        self.counter += 1
        base = _fmix32(_fmix32((self.seed & _MASK32) ^ _fmix32(self.counter & _MASK32)) ^ (self.seed >> 32))
        return [_fmix32((base + (pos * INDEX_MULTIPLIER)) & _MASK32) for pos in positions]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "counter": self.counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.counter = SRGenerator.values_of(state)

    @staticmethod
    def values_of(state: Any) -> tuple[int, int]:
        """The seed (its low 64 bits) and counter of a :meth:`state_dict`, checked (``ValueError``
        naming ``sr_generator`` and what it must hold)."""
        allowed = "a dict with the integers 'seed' and 'counter' >= 0, as SRGenerator.state_dict() makes it"
        if not isinstance(state, dict) or not {"seed", "counter"} <= state.keys():
            raise ValueError(f"sr_generator={state!r} is not allowed: it must be {allowed}.")
        try:
            seed, counter = (operator.index(state[key]) for key in ("seed", "counter"))
        except TypeError:
            raise ValueError(f"sr_generator={state!r} is not allowed: it must be {allowed}.") from None
        if counter < 0:
            raise ValueError(f"sr_generator={state!r} is not allowed: it must be {allowed}.")
        return seed & 0xFFFFFFFFFFFFFFFF, counter


def as_int32(c: int) -> int:
    """A 32-bit constant as the int32 with its bits."""
    return c - (1 << 32) if c >= (1 << 31) else c


def shr32(h: torch.Tensor, n: int) -> torch.Tensor:
    """A logical right shift of int32 ``h`` (torch's ``>>`` on int32 is arithmetic)."""
    return (h >> n) & ((1 << (32 - n)) - 1)


def element_hash(numel: int, key: int | torch.Tensor, device: torch.device, stride: int = 1) -> torch.Tensor:
    """The 32-bit hash of each element (int32 bits), as the kernel's ``sr_hash``; ``key`` an int, or
    an int32 tensor (the compiled step passes it so, to compile once for every key). With ``stride``:
    of the elements ``0, stride, 2 * stride, ...`` (``numel`` of them; :func:`offset_key` shifts them).

    In int32 arithmetic, whose products and sums wrap modulo 2**32 on every torch backend, as the
    kernel's uint32 ones do: the same bits, in a fraction of the time int64 arithmetic takes."""
    k = as_int32(key & _MASK32) if isinstance(key, int) else key
    step = as_int32((stride * INDEX_MULTIPLIER) & _MASK32)
    h = torch.arange(numel, dtype=torch.int32, device=device) * step + k
    h = h ^ shr32(h, 16)
    h = h * as_int32(MIX1)
    h = h ^ shr32(h, 13)
    h = h * as_int32(MIX2)
    return h ^ shr32(h, 16)


@torch.no_grad()
def round_stochastic(value: torch.Tensor, out: torch.Tensor, key: int, low: bool = False) -> None:
    """Write FP32 ``value`` into BF16 ``out`` with stochastic rounding keyed by ``key`` (NaN -> NaN):
    the random bits are the high 16 bits of each element's hash, or the low 16 with ``low``."""
    bits = value.detach().contiguous().view(torch.int32).reshape(-1)
    h = element_hash(bits.numel(), key, bits.device)
    random = h & 0xFFFF if low else shr32(h, 16)
    # bits + r < 2**32 as unsigned for every non-NaN float (r < 2**16): no wrap; the high half is the result
    rounded = (bits + random) >> 16
    nan = torch.isnan(value.reshape(-1))
    rounded = torch.where(nan, torch.full_like(rounded, 0x7FC0), rounded)
    out.view(torch.int16).copy_(rounded.to(torch.int16).view(out.shape))  # int32 -> int16 keeps the low 16 bits
