"""``Fp8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8 through ``torch._scaled_mm``.

:class:`Fp8Module` holds what every FP8 layer shares (its FP8 state, the casts, the
statistics); :class:`Fp8Linear` and :class:`~amp_plugin.fp8.Fp8Conv1D` are its two layers.

Forward ``y = x W^T``: ``x`` and ``W`` cast to the forward format (E4M3) with their scales,
``torch._scaled_mm`` with the reciprocal scales, the result in ``x``'s dtype. Backward: the
output gradient cast to the gradient format (E5M2 with ``fp8_format="hybrid"``), then
``dx = g W`` and ``dW = g^T x`` in FP8 as well, from the FP8 ``x`` and ``W`` of the forward
(per-tensor scaling) or re-cast along the new contraction dimension (row-wise). The bias is
added outside the GEMM, in the output dtype.

On the CPU, ``torch._scaled_mm`` multiplies the FP8 operands by their scales in FP32 and sums in
FP32: ``y == ((x8.float() * sx_inv) @ (w8.float() * sw_inv).T).to(dtype)`` exactly. On CUDA
(Hopper or newer) the same call runs the FP8 Tensor Core kernel: the second operand is passed
column-major and the contraction dimension of ``dW`` (the tokens) is padded with zeros to a
multiple of 16, as that kernel requires.

Each cast is measured while the layer trains: amax, scale, saturated values (``|x * scale|``
past the format's max plus half an ulp, clamped) and values flushed to zero (non-zero, cast to
0) are added to device tensors (:attr:`Fp8Module.fp8_stats`), read by :class:`~amp_plugin.fp8.Fp8Layers` only when
asked: no host sync in the step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from amp_plugin.checks import check_type
from amp_plugin.fp8.formats import Fp8Format, formats_for, saturating_cast
from amp_plugin.fp8.recipe import Fp8Recipe, compute_scale

__all__ = ["OPERANDS", "Fp8Linear", "Fp8Module"]

OPERANDS = ("input", "weight", "grad_output")
"""The three cast tensors of a layer, in the order of its buffers' rows."""
INPUT, WEIGHT, GRAD = range(3)
# columns of fp8_stats: amax (max over the window), saturated, flushed to zero, numel
AMAX, SATURATED, FLUSHED, NUMEL = range(4)


class Fp8Module(nn.Module):
    """What every FP8 layer shares: the FP8 state, the casts and their statistics.

    A subclass holds ``weight``, ``bias``, ``in_features`` and ``out_features`` and computes
    ``y = x W^T + b`` with :meth:`_fp8_forward`, given ``W`` as ``[out_features, in_features]``
    (:class:`Fp8Linear`'s own weight; :class:`~amp_plugin.fp8.Fp8Conv1D` passes its transposed
    weight, so the two compute the same bits).

    Buffers (FP32 whatever the module's dtype, not in the module's ``state_dict``: the amax
    histories and scales are saved by :meth:`~amp_plugin.fp8.Fp8Layers.state_dict`):

    - ``fp8_amax_history`` ``[amax_history_len, 3]``: row 0 is this step's amax, per operand.
    - ``fp8_scale`` ``[3]``: the scale each operand is cast with (the last one used with
      current/row-wise scaling; for row-wise, that of the largest row).
    - ``fp8_stats`` ``[3, 4]`` (float64): amax, saturated, flushed-to-zero and element counts
      since the last read; ``fp8_step_counts`` ``[3, 3]``: this step's saturated and element
      counts and its casts that flushed every non-zero value to zero (the fallback rule);
      ``fp8_over_steps``: steps in a row that broke it.

    Attributes:
        recipe: the :class:`~amp_plugin.fp8.Fp8Recipe`.
        fp8_active: False once the layer has fallen back to BF16 (then it computes as the
            layer it replaced).
        fp8_fresh: True until the first scale update: with delayed scaling, the steps before it
            cast with the tensor's own amax, as current scaling does (Transformer Engine starts
            from a scale of 1.0, which flushes small gradients to zero on the first step).
    """

    _fp8_buffers = ("fp8_amax_history", "fp8_scale", "fp8_stats", "fp8_step_counts", "fp8_over_steps")
    weight: Tensor
    in_features: int
    out_features: int
    fp8_amax_history: Tensor
    fp8_scale: Tensor
    fp8_max: Tensor
    fp8_stats: Tensor
    fp8_step_counts: Tensor
    fp8_over_steps: Tensor

    def _setup_fp8(self, recipe: Fp8Recipe) -> None:
        self.recipe = check_type("recipe", recipe, Fp8Recipe, "an amp_plugin.fp8.Fp8Recipe")
        fwd, bwd = formats_for(recipe.fp8_format)
        self.formats: tuple[Fp8Format, Fp8Format, Fp8Format] = (fwd, fwd, bwd)  # input, weight, grad_output
        self.fp8_active = True
        self.fp8_fresh = True  # no scale update yet: delayed scaling casts with the tensor's own amax
        dev, f32, f64 = self.weight.device, torch.float32, torch.float64
        length = recipe.amax_history_len if recipe.scaling == "delayed" else 1
        buffers = {
            "fp8_amax_history": torch.zeros(length, 3, device=dev, dtype=f32),
            "fp8_scale": torch.ones(3, device=dev, dtype=f32),
            "fp8_max": torch.tensor([f.max for f in self.formats], device=dev, dtype=f32),
            "fp8_stats": torch.zeros(3, 4, device=dev, dtype=f64),
            "fp8_step_counts": torch.zeros(3, 3, device=dev, dtype=f64),
            "fp8_over_steps": torch.zeros((), device=dev, dtype=f64),
        }
        for name, buf in buffers.items():
            self.register_buffer(name, buf, persistent=False)

    @override
    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # .to(device) moves the FP8 state with the module; .half()/.to(dtype) leave it FP32.
        dtypes = {name: getattr(self, name).dtype for name in (*self._fp8_buffers, "fp8_max")}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            buf = getattr(self, name)
            if buf.dtype != dtype:
                setattr(self, name, buf.to(dtype))
        return self

    def _fp8_forward(self, x: Tensor, weight: Tensor) -> Tensor:
        """``x W^T + b`` with the GEMMs in FP8; ``weight``: ``[out_features, in_features]``."""
        shape = x.shape
        record = self.training and torch.is_grad_enabled()
        y = _Fp8Matmul.apply(x.reshape(-1, shape[-1]), weight, self, record)
        y = y.reshape(*shape[:-1], self.out_features)
        bias: Tensor | None = getattr(self, "bias", None)
        return y if bias is None else y + bias.to(y.dtype)

    def _fp8_repr(self) -> str:
        state = "fp8" if self.fp8_active else "bf16 (fell back)"
        return f"{state}, scaling={self.recipe.scaling}, fp8_format={self.recipe.fp8_format}"

    # ------------------------------------------------------------------ casts
    def cast(self, x: Tensor, operand: int, record: bool, dim: int | None = None) -> tuple[Tensor, Tensor]:
        """``x`` in the operand's FP8 format and the scale it was multiplied by (0-d for
        per-tensor scaling; with ``dim``, one scale per slice along ``dim``, row-wise).

        With ``record``, the cast's statistics are added to the layer's device counters and,
        for delayed scaling, its amax to row 0 of the history."""
        fmt = self.formats[operand]
        recipe = self.recipe
        a = x.detach().abs()
        if dim is not None:
            amax = a.amax(dim=dim, keepdim=True).float()
            scale = compute_scale(amax, torch.ones_like(amax), fmt.max, recipe.margin, recipe.amax_floor)
        elif recipe.scaling == "current" or self.fp8_fresh:
            amax = a.amax().float()
            scale = compute_scale(amax, self.fp8_scale[operand], fmt.max, recipe.margin, recipe.amax_floor)
        else:  # delayed: the scale the history gave
            amax = a.amax().float() if record else a.new_zeros((), dtype=torch.float32)
            scale = self.fp8_scale[operand].clone()
        scaled = x.float() * scale
        x8 = saturating_cast(scaled, fmt)
        if record:
            self._record(operand, x, scaled, x8, amax, scale, fmt)
        return x8, scale

    @torch.no_grad()
    def _record(
        self, operand: int, x: Tensor, scaled: Tensor, x8: Tensor, amax: Tensor, scale: Tensor, fmt: Fp8Format
    ) -> None:
        top = amax.amax()
        saturated = (scaled.abs() > fmt.saturation_threshold).sum().double()
        nonzero = x != 0
        flushed = ((x8.float() == 0) & nonzero).sum().double()
        nonzeros = nonzero.sum().double()
        all_flushed = ((flushed == nonzeros) & (nonzeros > 0)).double()  # nothing of the operand got through
        numel = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
        stats = self.fp8_stats[operand]
        stats[AMAX] = torch.maximum(stats[AMAX], top.double())
        stats[SATURATED:].add_(torch.stack([saturated, flushed, numel]))
        self.fp8_step_counts[operand].add_(torch.stack([saturated, numel, all_flushed]))
        # A NaN or inf stays here until update(), which drops the step (see Fp8Layers.update).
        self.fp8_amax_history[0, operand] = torch.maximum(self.fp8_amax_history[0, operand], top)
        if self.recipe.scaling != "delayed" or self.fp8_fresh:
            self.fp8_scale[operand] = scale.amin()


class Fp8Linear(Fp8Module, nn.Linear):
    """An ``nn.Linear`` computing in FP8; :meth:`from_linear` converts one, sharing its parameters.

    Its FP8 state and casts are :class:`Fp8Module`'s.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, recipe: Fp8Recipe, **kw: Any):
        super().__init__(in_features, out_features, bias, **kw)
        self._setup_fp8(recipe)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe) -> Fp8Linear:
        """An ``Fp8Linear`` holding ``linear``'s own weight and bias ``Parameter`` objects (an
        optimizer built over them, or a tied weight, keeps working)."""
        check_type("linear", linear, nn.Linear, "a torch.nn.Linear")  # the recipe: _setup_fp8 checks it
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._setup_fp8(recipe)
        new.train(linear.training)
        return new

    @override
    def forward(self, x: Tensor) -> Tensor:
        if not self.fp8_active:
            return F.linear(x, self.weight, self.bias)
        return self._fp8_forward(x, self.weight)

    @override
    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._fp8_repr()}"


def scaled_mm(a8: Tensor, b8: Tensor, a_scale: Tensor, b_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(a8 * a_scale) @ (b8 * b_scale)`` by ``torch._scaled_mm`` (``*_scale``: the reciprocal
    cast scales), in the layout its CUDA kernel needs (``a`` row-major, ``b`` column-major)."""
    if a8.device.type == "cuda":
        pad = -a8.shape[1] % 16
        if pad:  # the contraction dimension (tokens, in dW) must be a multiple of 16 there
            a8 = torch.cat([a8, a8.new_zeros(a8.shape[0], pad)], dim=1)
            b8 = torch.cat([b8, b8.new_zeros(pad, b8.shape[1])], dim=0)
        a8 = a8.contiguous()
        b8 = b8.t().contiguous().t()
    return torch._scaled_mm(a8, b8, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ W^T`` with FP8 operands in forward and backward (see the module text)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, layer: Fp8Module, record: bool) -> Tensor:
        weight = weight.contiguous()  # Conv1D's transposed weight: the same layout (and bits) as nn.Linear's
        ctx.layer, ctx.record = layer, record
        ctx.dtypes = (x.dtype, weight.dtype)
        if layer.recipe.scaling == "rowwise":
            x8, sx = layer.cast(x, INPUT, record, dim=1)  # [M, 1]
            w8, sw = layer.cast(weight, WEIGHT, record, dim=1)  # [N, 1]
            ctx.save_for_backward(x, weight)
            return scaled_mm(x8, w8.t(), sx.reciprocal(), sw.reciprocal().t(), x.dtype)
        x8, sx = layer.cast(x, INPUT, record)
        w8, sw = layer.cast(weight, WEIGHT, record)
        ctx.save_for_backward(x8, w8, sx, sw)
        return scaled_mm(x8, w8.t(), sx.reciprocal(), sw.reciprocal(), x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        layer, record = ctx.layer, ctx.record
        x_dtype, w_dtype = ctx.dtypes
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad = grad.contiguous()
        gx = gw = None
        if layer.recipe.scaling == "rowwise":
            x, weight = ctx.saved_tensors
            if need_x:  # dx = g @ W: g per row (over N), W per column (over N)
                g8, sg = layer.cast(grad, GRAD, record, dim=1)
                w8, sw = layer.cast(weight, WEIGHT, False, dim=0)
                gx = scaled_mm(g8, w8, sg.reciprocal(), sw.reciprocal(), x_dtype)
            if need_w:  # dW = g^T @ x: g^T per row and x per column (both over the tokens M)
                g8t, sgt = layer.cast(grad.t(), GRAD, record and not need_x, dim=1)
                x8, sx = layer.cast(x, INPUT, False, dim=0)
                gw = scaled_mm(g8t, x8, sgt.reciprocal(), sx.reciprocal(), w_dtype)
            return gx, gw, None, None
        x8, w8, sx, sw = ctx.saved_tensors
        g8, sg = layer.cast(grad, GRAD, record)
        if need_x:
            gx = scaled_mm(g8, w8, sg.reciprocal(), sw.reciprocal(), x_dtype)
        if need_w:
            gw = scaled_mm(g8.t(), x8, sg.reciprocal(), sx.reciprocal(), w_dtype)
        return gx, gw, None, None
