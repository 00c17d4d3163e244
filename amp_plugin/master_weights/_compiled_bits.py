"""The functions ``fused="compiled"`` compiles (:mod:`._compiled` runs them): the lean step's bit handling.

Every rule works on the 32 bits of an FP32 value as an int32 tensor and gives the 16-bit result in
the low half of an int32 (the weight split to nearest with its remainder, or rounded stochastically
with 16 random bits; the same rules as the torch ops of ``_split.py`` and ``_stochastic.py``). They
read and write their tensors in one of two layouts:

- *one element per lane*: the FP32 tensor viewed as int32, the 16-bit results narrowed to int16;
- *pairs* (``*_pairs``): the FP32 tensor viewed as int64, each lane two elements (``2k`` in the low
  32 bits, ``2k + 1`` in the high), and the 16-bit tensors viewed as int32, each lane the same two
  elements (``2k`` in the low 16 bits). Inductor's C++ backend does not vectorize int16 (a kernel
  that loads or stores one runs a scalar loop, several times slower); in pairs every load and store is
  of int32 or int64, and every kernel is vectorized. The rules see the same int32 bits, so the
  results are the same bits. On the CPU, tensors of an even number of elements, 32-bit aligned, go
  in pairs (:func:`pairable`), the others one element per lane; off it (Triton handles int16) all
  of them one element per lane.

Each function takes a batch of tensors of one combination (weights split or rounded, BF16 moments
or not) and is a code object of its own: Dynamo keeps each one's graphs and recompile budget apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from amp_plugin.master_weights._stochastic import INDEX_MULTIPLIER, as_int32, element_hash, shr32

__all__ = ["FUNCTIONS", "pairable"]

T = torch.Tensor
L = list[torch.Tensor]
_NEXT = as_int32(INDEX_MULTIPLIER)  # a key plus this: the hash of the next element


def pairable(t: torch.Tensor) -> bool:
    """Whether ``t`` (contiguous) can be read in pairs: an even number of elements, from an even offset."""
    return t.numel() >= 2 and t.numel() % 2 == 0 and t.storage_offset() % 2 == 0


# The rules, on int32 bits; results in the low 16 bits.
def _rounded_stochastically(bits: T, random: T) -> T:
    """The BF16 bits of the FP32 value ``bits`` rounded with the 16 ``random`` bits of each element."""
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, 0x7FC0, (bits + random) >> 16)


def _split(bits: T) -> tuple[T, T]:
    """bf16_split: the weight rounded to nearest (ties away from zero), and the exact remainder."""
    low = bits & 0xFFFF
    return shr32(bits, 16) + shr32(low, 15), low


def _high(h: T) -> T:
    return shr32(h, 16)


# One element per lane.
def _put(out16: T, result: T) -> None:
    out16.view(torch.int16).copy_(result.to(torch.int16))


def _join(weight: T, remainder: T) -> T:
    high = (weight.view(torch.int16).to(torch.int32) & 0xFFFF) << 16
    return (high + remainder.to(torch.int32)).view(torch.float32)


def _round_weight(value: T, weight: T, key: T) -> None:
    """``master="stochastic"``: the weight rounded with the high 16 bits of each element's hash."""
    random = _high(element_hash(value.numel(), key, value.device))
    _put(weight, _rounded_stochastically(value.view(torch.int32), random))


def _split_weight(value: T, weight: T, remainder: T) -> None:
    rounded, low = _split(value.view(torch.int32))
    _put(weight, rounded)
    _put(remainder, low)


def _round_moments(m32: T, v32: T, m16: T, v16: T, key: T, sr: bool) -> None:
    if sr:  # one hash for both: exp_avg takes its high 16 bits, exp_avg_sq its low 16
        h = element_hash(m32.numel(), key, m32.device)
        _put(m16, _rounded_stochastically(m32.view(torch.int32), _high(h)))
        _put(v16, _rounded_stochastically(v32.view(torch.int32), h & 0xFFFF))
    else:
        m16.copy_(m32)
        v16.copy_(v32)


# Pairs: FP32 tensors as int64 (two values a lane), 16-bit tensors as int32 (two a lane).
def _halves(pairs: T) -> tuple[T, T]:
    """The int32 bits of elements ``2k`` and ``2k + 1`` of an FP32 tensor viewed as int64."""
    return pairs.to(torch.int32), (pairs >> 32).to(torch.int32)  # int64 -> int32 keeps the low 32 bits


def _put_pair(out: T, low: T, high: T) -> None:
    """Two 16-bit results (low halves of ``low``, ``high``) into the int32 lanes of ``out``."""
    out.copy_((high << 16) | (low & 0xFFFF))


def _pair_hashes(words: int, key: T, device: torch.device) -> tuple[T, T]:
    """The element hashes of elements ``2k`` and ``2k + 1``, for ``k < words``."""
    return element_hash(words, key, device, 2), element_hash(words, key + _NEXT, device, 2)


def _join_pair(weight: T, remainder: T) -> T:
    """The FP32 values (as int64 pairs) of a BF16 weight and its int16 remainder (both as int32 pairs):
    high 16 bits the weight's, plus the remainder sign-extended."""
    low = (weight << 16) + ((remainder << 16) >> 16)
    high = (weight & -65536) + (remainder >> 16)
    return (high.to(torch.int64) << 32) | (low.to(torch.int64) & 0xFFFFFFFF)


def _round_weight_pair(value: T, weight: T, key: T) -> None:
    low, high = _halves(value)
    h_low, h_high = _pair_hashes(value.numel(), key, value.device)
    _put_pair(weight, _rounded_stochastically(low, _high(h_low)), _rounded_stochastically(high, _high(h_high)))


def _split_weight_pair(value: T, weight: T, remainder: T) -> None:
    (w_low, r_low), (w_high, r_high) = (_split(b) for b in _halves(value))
    _put_pair(weight, w_low, w_high)
    _put_pair(remainder, r_low, r_high)


def _round_moments_pair(m32: T, v32: T, m16: T, v16: T, key: T, sr: bool) -> None:
    """Stochastically: all four as pairs; to nearest (``sr`` false): the tensors one element per lane
    (torch's conversion, as the torch ops round them), vectorized as they are."""
    if not sr:
        m16.copy_(m32)
        v16.copy_(v32)
        return
    (m_low, m_high), (v_low, v_high) = _halves(m32), _halves(v32)
    h_low, h_high = _pair_hashes(m32.numel(), key, m32.device)
    _put_pair(m16, _rounded_stochastically(m_low, _high(h_low)), _rounded_stochastically(m_high, _high(h_high)))
    _put_pair(v16, _rounded_stochastically(v_low, h_low & 0xFFFF), _rounded_stochastically(v_high, h_high & 0xFFFF))


# The values a step computes on: the FP32 weight (joined with its remainder, or upcast) and the
# BF16 moments upcast.
def _join_all(weights: L, remainders: L) -> L:
    return [_join(w, r) for w, r in zip(weights, remainders)]


def _join_pairs(weights: L, remainders: L) -> L:
    return [_join_pair(w, r) for w, r in zip(weights, remainders)]


def _join_up_all(weights: L, remainders: L, m16s: L, v16s: L) -> list[tuple[T, T, T]]:
    return [(_join(w, r), m.float(), v.float()) for w, r, m, v in zip(weights, remainders, m16s, v16s)]


def _join_up_pairs(weights: L, remainders: L, m16s: L, v16s: L) -> list[tuple[T, T, T]]:
    return [(_join_pair(w, r), m.float(), v.float()) for w, r, m, v in zip(weights, remainders, m16s, v16s)]


def _up_weight_all(weights: L) -> L:
    return [w.float() for w in weights]


def _up_all(weights: L, m16s: L, v16s: L) -> list[tuple[T, T, T]]:
    return [(w.float(), m.float(), v.float()) for w, m, v in zip(weights, m16s, v16s)]


def _up_moments_all(m16s: L, v16s: L) -> list[tuple[T, T]]:
    return [(m.float(), v.float()) for m, v in zip(m16s, v16s)]


# The FP32 gradients of half ones: upcast (exact), and times the unscale factor (``invs[i]``: tensor i's, a
# view of one value) as torch's unscale multiplies, a factor of one leaving a value as it is. Two functions,
# so that each has its own graphs and recompile budget.
def _up_grads_all(grads: L) -> L:
    return [g.float() for g in grads]


def _up_grads_scaled_all(grads: L, invs: T) -> L:
    out = []
    for i, g in enumerate(grads):
        value = g.float()
        out.append(torch.where(invs[i] == 1, value, value * invs[i]))
    return out


# Stores: the weight split or rounded stochastically, with or without the BF16 moments, in one
# kernel per tensor; ``keys`` row i holds tensor i's (weight, moments) rounding keys.
def _split_all(values: L, weights: L, remainders: L, keys: T) -> None:
    for value, weight, remainder in zip(values, weights, remainders):
        _split_weight(value, weight, remainder)


def _split_pairs(values: L, weights: L, remainders: L, keys: T) -> None:
    for value, weight, remainder in zip(values, weights, remainders):
        _split_weight_pair(value, weight, remainder)


def _split_moments_all(
    values: L, weights: L, remainders: L, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i, (value, weight, remainder) in enumerate(zip(values, weights, remainders)):
        _split_weight(value, weight, remainder)
        _round_moments(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


def _split_moments_pairs(
    values: L, weights: L, remainders: L, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i, (value, weight, remainder) in enumerate(zip(values, weights, remainders)):
        _split_weight_pair(value, weight, remainder)
        _round_moments_pair(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


def _rounded_all(values: L, weights: L, remainders: None, keys: T) -> None:
    for i, (value, weight) in enumerate(zip(values, weights)):
        _round_weight(value, weight, keys[i, 0])


def _rounded_pairs(values: L, weights: L, remainders: None, keys: T) -> None:
    for i, (value, weight) in enumerate(zip(values, weights)):
        _round_weight_pair(value, weight, keys[i, 0])


def _rounded_moments_all(
    values: L, weights: L, remainders: None, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i, (value, weight) in enumerate(zip(values, weights)):
        _round_weight(value, weight, keys[i, 0])
        _round_moments(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


def _rounded_moments_pairs(
    values: L, weights: L, remainders: None, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i, (value, weight) in enumerate(zip(values, weights)):
        _round_weight_pair(value, weight, keys[i, 0])
        _round_moments_pair(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


def _moments_all(
    values: L, weights: None, remainders: None, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i in range(len(m32s)):
        _round_moments(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


def _moments_pairs(
    values: L, weights: None, remainders: None, m32s: L, v32s: L, m16s: L, v16s: L, keys: T, sr: bool
) -> None:
    for i in range(len(m32s)):
        _round_moments_pair(m32s[i], v32s[i], m16s[i], v16s[i], keys[i, 1], sr)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "join": _join_all,
    "join_pairs": _join_pairs,
    "join_up": _join_up_all,
    "join_up_pairs": _join_up_pairs,
    "up_weight": _up_weight_all,
    "up": _up_all,
    "up_moments": _up_moments_all,
    "up_grads": _up_grads_all,
    "up_grads_scaled": _up_grads_scaled_all,
    "split": _split_all,
    "split_pairs": _split_pairs,
    "split_moments": _split_moments_all,
    "split_moments_pairs": _split_moments_pairs,
    "rounded": _rounded_all,
    "rounded_pairs": _rounded_pairs,
    "rounded_moments": _rounded_moments_all,
    "rounded_moments_pairs": _rounded_moments_pairs,
    "moments": _moments_all,
    "moments_pairs": _moments_pairs,
}
"""Each function by name; ``*_pairs``: the same over tensors in pairs (the caller views them so)."""
