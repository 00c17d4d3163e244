"""``Fp8Conv1D``: the FP8 form of ``transformers``' ``Conv1D`` (GPT-2's projections).

``transformers.pytorch_utils.Conv1D`` is a linear layer whose weight is stored transposed:
``weight`` is ``[in_features, out_features]`` (``[nx, nf]``), ``bias`` ``[nf]``, and
``forward(x) = torch.addmm(bias, x.view(-1, nx), weight)``. It is recognised by its shape
(:func:`is_conv1d`), never by importing ``transformers``, so this package does not need it.

:class:`Fp8Conv1D` keeps the layer's own ``weight`` and ``bias`` Parameters (same shapes, same
``state_dict``) and runs the GEMMs of :class:`~amp_plugin.fp8.Fp8Linear` with the transposed
weight ``weight.t()``, made contiguous before the cast: the same bits as an ``Fp8Linear`` holding
``weight.t()``, in the forward, both gradients and the FP8 state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from amp_plugin.fp8.linear import Fp8Module
from amp_plugin.fp8.recipe import Fp8Recipe

__all__ = ["Fp8Conv1D", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` has the structure of ``transformers``' ``Conv1D``: its class is named
    ``Conv1D``, its ``weight`` is a 2-D Parameter ``[nx, nf]`` with ``module.nf == nf`` (and
    ``module.nx == nx`` where it has ``nx``), and its ``bias`` is None or of shape ``[nf]``.
    (A 1-D convolution, ``nn.Conv1d``, has a 3-D weight and never matches.)"""
    if type(module).__name__ != "Conv1D":
        return False
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
        return False
    nx, nf = weight.shape
    if getattr(module, "nf", None) != nf or getattr(module, "nx", nx) != nx:
        return False
    return bias is None or (isinstance(bias, Tensor) and tuple(bias.shape) == (nf,))


class Fp8Conv1D(Fp8Module):
    """A ``Conv1D`` (``nf`` outputs, ``nx`` inputs, weight ``[nx, nf]``) computing in FP8;
    :meth:`from_conv1d` converts one, sharing its parameters. Once fallen back to BF16 it
    computes as ``Conv1D`` does (``torch.addmm``)."""

    bias: Tensor | None

    def __init__(
        self, nf: int, nx: int, *, recipe: Fp8Recipe, device: Any = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self._set_sizes(nf, nx)
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)  # Conv1D's own initialisation
        self._setup_fp8(recipe)

    def _set_sizes(self, nf: int, nx: int) -> None:
        self.nf, self.nx = nf, nx
        self.in_features, self.out_features = nx, nf

    @classmethod
    def from_conv1d(cls, conv: nn.Module, recipe: Fp8Recipe) -> Fp8Conv1D:
        """An ``Fp8Conv1D`` holding ``conv``'s own weight and bias ``Parameter`` objects."""
        if not is_conv1d(conv):
            raise TypeError(f"{type(conv).__name__} is not a Conv1D layer (weight [nx, nf], nf, bias [nf]).")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        weight: Tensor = conv.weight  # type: ignore[assignment]  # checked by is_conv1d
        nx, nf = weight.shape
        new._set_sizes(int(nf), int(nx))
        new.weight = weight
        new.bias = getattr(conv, "bias", None)
        new._setup_fp8(recipe)
        new.train(conv.training)
        return new

    @override
    def forward(self, x: Tensor) -> Tensor:
        if self.fp8_active:
            return self._fp8_forward(x, self.weight.t())
        size_out = (*x.size()[:-1], self.nf)
        flat = x.view(-1, x.size(-1))
        y = flat @ self.weight if self.bias is None else torch.addmm(self.bias, flat, self.weight)
        return y.view(size_out)

    @override
    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, {self._fp8_repr()}"
