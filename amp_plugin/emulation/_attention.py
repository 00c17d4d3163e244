"""Emulated CPU flash attention, with a GPU flash-attention kernel's roundings.

A GPU flash/memory-efficient attention kernel (FlashAttention-2, xformers/cutlass) with
FP16/BF16 inputs computes ``S = Q K^T`` on Tensor Cores (FP32 accumulators), the softmax
statistics in FP32, and then rounds the *unnormalised* probabilities ``P = exp(S - max)``
to the half dtype, because the second GEMM, ``P V``, takes half operands. The FP32 result
``P V`` is divided by the FP32 row sum of ``exp(S - max)`` and rounded once. The backward
pass rounds the recomputed probabilities ``P = exp(S - lse)`` to half for ``dV = P^T dO``
and the score gradients ``dS = P * (dP - D)``, ``D = rowsum(dO * O)``, to half for
``dQ = scale * dS K`` and ``dK = scale * dS^T Q``; dQ, dK and dV are accumulated in FP32
and rounded once. PyTorch's own CPU flash kernel does the same roundings in BF16/FP16.

The emulation below computes exactly that, in FP32, with one ``max`` per query row over
all keys. A GPU kernel takes the row maximum over the key blocks seen so far (64-128 keys
per block), so for rows longer than one block its probabilities are rounded relative to a
running maximum: the same error per element (one rounding of each probability), not the
same bits. Everything else follows the native CPU kernel: scale ``1/sqrt(E)`` unless
given, ``S * scale + attn_mask``, ``is_causal``
masks keys after the query position (top-left aligned), fully masked rows give a zero
output and ``logsumexp`` 0, ``logsumexp`` is FP32 and laid out as the native kernel's
(the output and gradients are contiguous; the native kernel's are laid out (B, L, H, E)).
"""

from __future__ import annotations

import math
from typing import cast

import torch

from amp_plugin.emulation._common import PASS, give_scratch, take_scratch, thread_state, upcast

__all__ = ["sdpa_backward", "sdpa_forward"]

# Queries are processed in blocks of rows so that one block's FP32 score matrix
# (batch x heads x rows x keys) stays below this many elements.
_BLOCK_ELEMENTS = 1 << 22

_NEG_INF = float("-inf")


def _rows_per_block(batch_heads: int, keys: int, rows: int) -> int:
    return max(1, min(rows, _BLOCK_ELEMENTS // max(1, batch_heads * keys)))


def _float_mask(mask, dt):
    """The additive FP32 mask, or None; PASS for a mask the native kernel rejects (it takes
    masks of the query's dtype or FP32; ``F.scaled_dot_product_attention`` turns boolean
    masks into additive ones before calling it)."""
    if mask is None:
        return None
    if mask.dtype is dt or mask.dtype is torch.float32:
        return mask.float()
    return PASS


def _scores(q_rows, k_t, scale, mask, row0, is_causal):
    """``q_rows @ k_t * scale + mask`` (FP32), causal positions set to -inf."""
    s = torch.matmul(q_rows, k_t)
    s.mul_(scale)
    rows, keys = s.shape[-2], s.shape[-1]
    if mask is not None:
        s.add_(mask[..., row0 : row0 + rows, :] if mask.dim() >= 2 and mask.shape[-2] != 1 else mask)
    if is_causal:
        s.masked_fill_(torch.ones(rows, keys, dtype=torch.bool).triu_(row0 + 1), _NEG_INF)
    return s


def _check(tensors, dt):
    """True when every tensor is a 4-d CPU tensor of the emulated dtype ``dt``."""
    if dt not in thread_state.emulated:
        return False
    return all(t.dtype is dt and t.is_cpu and t.dim() == 4 and t.layout is torch.strided for t in tensors)


def sdpa_forward(call, args, kwargs):
    """``_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask, scale)``
    -> ``(output, logsumexp)``."""
    q, k, v = args[0], args[1], args[2]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    dt = q.dtype
    if dropout_p or not _check((q, k, v), dt):
        return PASS
    (bq, hq, n_q, e), (bk, hk, n_k, ek), (bv, hv, nv, ev) = q.shape, k.shape, v.shape
    if (bk, hk, ek) != (bq, hq, e) or (bv, hv, nv) != (bq, hq, n_k) or ev != e:
        return PASS  # the native kernel raises its own error
    mask = _float_mask(kwargs.get("attn_mask"), dt)
    if mask is PASS:
        return PASS
    scale = kwargs.get("scale")
    scale = 1.0 / math.sqrt(e) if scale is None else scale

    outs, lses = [], []
    scratch = take_scratch()
    try:
        q32, k32, v32 = upcast(q, 0, scratch), upcast(k, 1, scratch), upcast(v, 2, scratch)
        k32_t = k32.transpose(-2, -1)
        step = _rows_per_block(bq * hq, n_k, n_q)
        for r0 in range(0, n_q, step):
            s = _scores(q32[:, :, r0 : r0 + step], k32_t, scale, mask, r0, is_causal)
            row_max = s.amax(-1, keepdim=True)
            row_max.masked_fill_(row_max == _NEG_INF, 0.0)  # fully masked rows: exp(-inf) = 0
            p = s.sub_(row_max).exp_()  # unnormalised probabilities, FP32
            row_sum = p.sum(-1, keepdim=True)
            row_sum.masked_fill_(row_sum == 0, 1.0)  # fully masked rows: output 0, logsumexp 0
            # the one rounding of the probabilities, as for the GPU's P V GEMM
            o = torch.matmul(p.to(dt).float(), v32).div_(row_sum)
            outs.append(o.to(dt))
            lses.append(row_max.add_(row_sum.log_()).squeeze(-1))
    finally:
        give_scratch(scratch)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 2)
    lse = torch.empty((bq, n_q, hq), dtype=torch.float32).transpose(1, 2)  # the native kernel's layout
    lse.copy_(lses[0] if len(lses) == 1 else torch.cat(lses, 2))
    return out, lse


def sdpa_backward(call, args, kwargs):
    """``_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, logsumexp,
    dropout_p, is_causal, *, attn_mask, scale)`` -> ``(grad_q, grad_k, grad_v)``."""
    grad_out, q, k, v, out, lse = args[:6]
    dropout_p = args[6] if len(args) > 6 else kwargs.get("dropout_p", 0.0)
    is_causal = args[7] if len(args) > 7 else kwargs.get("is_causal", False)
    dt = q.dtype
    if grad_out is None or dropout_p or not _check((grad_out, q, k, v, out), dt):
        return PASS
    if lse.dtype is not torch.float32 or q.shape[-1] != k.shape[-1] or k.shape != v.shape:
        return PASS
    mask = _float_mask(kwargs.get("attn_mask"), dt)
    if mask is PASS:
        return PASS
    b, h, n_q, e = q.shape
    n_k = k.shape[2]
    scale = kwargs.get("scale")
    scale = 1.0 / math.sqrt(e) if scale is None else scale

    grad_q, grad_k, grad_v = [], None, None
    scratch = take_scratch()
    try:
        q32, k32, v32 = upcast(q, 0, scratch), upcast(k, 1, scratch), upcast(v, 2, scratch)
        g32 = upcast(grad_out, 3, scratch)
        k32_t, v32_t = k32.transpose(-2, -1), v32.transpose(-2, -1)
        # D = rowsum(dO * O), from the stored half output
        d = (g32 * upcast(out, 4, scratch)).sum(-1, keepdim=True)
        step = _rows_per_block(b * h, n_k, n_q)
        for r0 in range(0, n_q, step):
            r1 = min(n_q, r0 + step)
            q_rows, g_rows = q32[:, :, r0:r1], g32[:, :, r0:r1]
            s = _scores(q_rows, k32_t, scale, mask, r0, is_causal)
            p = s.sub_(lse[:, :, r0:r1].unsqueeze(-1)).exp_()  # normalised probabilities, FP32
            dv = torch.matmul(p.to(dt).float().transpose(-2, -1), g_rows)
            dp = torch.matmul(g_rows, v32_t)
            ds_half = p.mul_(dp.sub_(d[:, :, r0:r1])).to(dt).float()  # dS = P * (dP - D), rounded for dQ and dK
            grad_q.append(torch.matmul(ds_half, k32).mul_(scale).to(dt))
            dk = torch.matmul(ds_half.transpose(-2, -1), q_rows)
            grad_k = dk if grad_k is None else grad_k.add_(dk)
            grad_v = dv if grad_v is None else grad_v.add_(dv)
    finally:
        give_scratch(scratch)
    dq = grad_q[0] if len(grad_q) == 1 else torch.cat(grad_q, 2)
    # grad_k and grad_v are set: the loop ran (n_q > 0, or torch.cat above raised)
    return dq, cast(torch.Tensor, grad_k).mul_(scale).to(dt), cast(torch.Tensor, grad_v).to(dt)
