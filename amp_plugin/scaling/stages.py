"""One optimizer's way through an iteration of a loss scaler, and the step's one host read.

Per optimizer, an iteration goes ``READY`` -> ``UNSCALED`` (``unscale_``) -> ``STEPPED``
(``step``). The unscale leaves a found-inf flag per device on the device (and, when the
scaler asks for it, the gradients' amax); :meth:`OptimizerStage.read` brings them to the host
in one transfer, max-reduced across ranks under ``torch.distributed`` so that every rank makes
the same decision.
"""

from __future__ import annotations

from enum import Enum

import torch

__all__ = ["OptimizerStage", "Stage"]


class Stage(Enum):
    """Where an optimizer stands in the iteration under way."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class OptimizerStage:
    """The device flags of one optimizer in the iteration under way, and their host values.

    Attributes:
        stage: how far the optimizer got.
        found_inf: one 0-dim float32 flag per device (non-zero: a gradient was inf/NaN).
        amax: the scaled gradients' largest magnitude, one 0-dim float32 tensor per device,
            or ``None`` when it was not measured.
        found_inf_host: the host value of the flags, once read (``None`` before).
        amax_host: the host value of the amax, once read (``None`` when not measured).
    """

    __slots__ = ("amax", "amax_host", "found_inf", "found_inf_host", "stage")

    def __init__(self) -> None:
        self.stage = Stage.READY
        self.found_inf: dict[torch.device, torch.Tensor] = {}
        self.amax: dict[torch.device, torch.Tensor] | None = None
        self.found_inf_host: bool | None = None
        self.amax_host: float | None = None

    def read(self, fallback: torch.device | str) -> bool:
        """Whether a gradient was inf/NaN: the flags (and the amax, if measured) read on the
        host in one transfer, after a max all-reduce across ranks under ``torch.distributed``.
        Read once; later calls return the stored answer.

        Args:
            fallback: the device of the zero flag made when there are no gradients at all
                (nothing overflowed, and the rank still joins the all-reduce).
        """
        if self.found_inf_host is not None:
            return self.found_inf_host
        flags = list(self.found_inf.values())
        if not flags:
            found = torch.zeros((), dtype=torch.float32, device=fallback)
        else:
            found = flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum()
        values = found
        if self.amax is not None:
            amaxes = [a.to(found.device) for a in self.amax.values()]
            largest = torch.stack(amaxes).max() if amaxes else torch.zeros((), dtype=torch.float32, device=found.device)
            values = torch.stack([found, largest])
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if distributed and torch.distributed.get_world_size() > 1:
            values = values.clone()
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        if self.amax is None:
            self.found_inf_host = bool(values.item() != 0)
        else:
            found_value, self.amax_host = values.tolist()
            self.found_inf_host = found_value != 0
        return self.found_inf_host
