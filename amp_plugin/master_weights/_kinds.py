"""How the FP32 value of a half-precision parameter is kept: one object per master kind.

A kind owns what differs between the ways of storing a master: what it allocates for a model
parameter (:meth:`MasterKind.new_record`), the exact FP32 value it holds (:meth:`fp32`), how it
takes an FP32 value (a checkpoint's, :meth:`load`; a step's result, :meth:`store`), and what it
does when the model's weight was written behind its back (:meth:`resync`). Every kind puts a
:class:`MasterParameter` in the optimizer's param groups: the key of the optimizer state and
the holder of the (transient, FP32) master gradient that clipping and hooks see. For the
kinds without an FP32 tensor its data is a one-element NaN broadcast to the parameter's shape.

:data:`KINDS` holds one instance per ``master=`` name; :func:`register_kind` adds one. The
step kernels that implement a kind say so in their registration (``_kernels.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.optim import Optimizer

from amp_plugin.master_weights import _split
from amp_plugin.master_weights._parameter import MasterParameter, Record
from amp_plugin.master_weights._stochastic import round_stochastic

__all__ = ["KINDS", "Fp32Master", "MasterKind", "RemainderMaster", "StochasticMaster", "register_kind"]


class MasterKind:
    """The base: an FP32 copy per parameter (override what differs)."""

    name: ClassVar[str] = "fp32"
    bytes_per_param: ClassVar[int] = 4  # what the master adds to the model's weight
    has_fp32_tensor: ClassVar[bool] = True  # the stock step (the wrapped optimizer's own) can run
    exact: ClassVar[bool] = True  # holds any FP32 value exactly

    def refusal(self, optimizer: Optimizer) -> str | None:
        """Why this kind cannot hold ``optimizer``'s half-precision parameters, or ``None``."""
        return None

    def new_record(self, p: torch.Tensor) -> Record:
        return Record(MasterParameter.of(p), None, p._version, p.data_ptr(), self.name)

    def fp32(self, model_p: torch.Tensor, record: Record) -> torch.Tensor:
        """A new FP32 tensor: the master's exact value."""
        return record.master.detach().clone()

    def step_value(self, model_p: torch.Tensor, record: Record) -> torch.Tensor:
        """The FP32 tensor a torch-ops step updates (the master itself, or a new one for :meth:`store`)."""
        return record.master

    def store(self, model_p: torch.Tensor, record: Record, value: torch.Tensor, key: int) -> None:
        """Take the FP32 ``value`` a step computed (from :meth:`step_value`) and update the model's weight."""
        if value is not record.master:
            record.master.copy_(value)
        model_p.copy_(record.master)

    def load(self, model_p: torch.Tensor, record: Record, value: torch.Tensor) -> bool:
        """Take an FP32 ``value`` (a checkpoint's); ``True`` when it had to be rounded."""
        record.master.copy_(value)
        model_p.copy_(record.master)
        return False

    def resync(self, model_p: torch.Tensor, record: Record) -> None:
        """The model's weight was written: make it the master's value, unless it still is the master
        rounded (the same values written back: an EMA swap undone, the model's state loaded after the
        optimizer's), which keeps the master's digits below the weight's precision."""
        if not torch.equal(record.master.to(model_p.dtype).view(torch.int16), model_p.view(torch.int16)):
            record.master.copy_(model_p)

    def storage(self, record: Record) -> list[torch.Tensor]:
        """The tensors holding the master beyond the model's weight (memory accounting)."""
        return [record.master]


class Fp32Master(MasterKind):
    """``master="fp32"``: an FP32 tensor per parameter; the model's weight is it rounded to nearest."""


class _Bf16Only(MasterKind):
    has_fp32_tensor = False

    def refusal(self, optimizer: Optimizer) -> str | None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.dtype is torch.float16:
                    return (
                        f"it needs a BF16 model, but a parameter of shape {tuple(p.shape)} is float16 (FP16 has "
                        "fewer exponent bits than FP32: its weight cannot carry an FP32 value's range)"
                    )
        return None

    def new_record(self, p: torch.Tensor) -> Record:
        return Record(MasterParameter.placeholder(p), self._extra(p), p._version, p.data_ptr(), self.name)

    def _extra(self, p: torch.Tensor) -> torch.Tensor | None:
        return None


class RemainderMaster(_Bf16Only):
    """``master="bf16_split"``: the BF16 weight is the master rounded to nearest, an int16
    remainder makes it exact (:mod:`amp_plugin.master_weights._split`)."""

    name = "bf16_split"
    bytes_per_param = 2

    def _extra(self, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros(p.shape, dtype=torch.int16, device=p.device)

    def fp32(self, model_p: torch.Tensor, record: Record) -> torch.Tensor:
        return _split.join(model_p, _remainder(record))

    step_value = fp32

    def store(self, model_p: torch.Tensor, record: Record, value: torch.Tensor, key: int) -> None:
        _split.split_into(value, model_p, _remainder(record))

    def load(self, model_p: torch.Tensor, record: Record, value: torch.Tensor) -> bool:
        _split.split_into(value.to(model_p.device, torch.float32), model_p, _remainder(record))
        return False

    def resync(self, model_p: torch.Tensor, record: Record) -> None:
        # the master is the weight, exactly: the weight is the master's high half, so a write of the
        # same values cannot be told from a new value (what FP32 masters keep, a remainder cannot)
        _remainder(record).zero_()

    def storage(self, record: Record) -> list[torch.Tensor]:
        return [_remainder(record)]


class StochasticMaster(_Bf16Only):
    """``master="stochastic"``: no master; the BF16 weight is updated in FP32 and written back
    with stochastic rounding (:mod:`amp_plugin.master_weights._stochastic`)."""

    name = "stochastic"
    bytes_per_param = 0
    exact = False

    def fp32(self, model_p: torch.Tensor, record: Record) -> torch.Tensor:
        # contiguous whatever the weight's layout: the step pairs it with the moments, which are contiguous,
        # and torch's fused Adam pairs elements by their place in memory (a channels_last weight's FP32 copy
        # kept its layout and was updated with other elements' moments)
        return model_p.detach().to(torch.float32, memory_format=torch.contiguous_format)

    step_value = fp32

    def store(self, model_p: torch.Tensor, record: Record, value: torch.Tensor, key: int) -> None:
        round_stochastic(value, model_p, key)

    def load(self, model_p: torch.Tensor, record: Record, value: torch.Tensor) -> bool:
        value = value.to(model_p.device, torch.float32)
        model_p.copy_(value)
        return not torch.equal(model_p.float(), value)

    def resync(self, model_p: torch.Tensor, record: Record) -> None:
        pass  # the weight is all there is

    def storage(self, record: Record) -> list[torch.Tensor]:
        return []


def _remainder(record: Record) -> torch.Tensor:
    remainder = record.remainder
    if remainder is None:  # a record made by another kind (refused when a wrapper adopts it)
        raise RuntimeError("this master has no remainder")
    return remainder


KINDS: dict[str, MasterKind] = {}
"""Every master kind by its ``master=`` name."""


def register_kind(kind: MasterKind) -> MasterKind:
    """Make ``kind`` available as ``MasterWeightOptimizer(..., master=kind.name)``."""
    KINDS[kind.name] = kind
    return kind


for _kind in (Fp32Master(), RemainderMaster(), StochasticMaster()):
    register_kind(_kind)
