"""Inject the faults mixed precision must survive: inf/NaN gradients, a NaN loss, a NaN batch.

Usable from the command line (``+fault.inject_inf_at=[3,7]``) to watch the scaler skip,
count and recover, and from tests to prove it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from amp_plugin.fsdp import local_grad
from amp_plugin.lightning.namespace import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["FaultInjector", "first_floating"]


def _steps(name: str, value: Sequence[int] | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    steps = list(value)
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
        raise ValueError(f"{name}={value!r} is not allowed: {name} must be a list of optimizer steps (integers >= 0).")
    return frozenset(steps)


class FaultInjector(Callback):
    """Write non-finite values into a run at chosen optimizer steps (``trainer.global_step``).

    Args:
        inject_inf_at: steps whose gradient gets ``+inf`` (one element of ``param``).
        inject_nan_at: steps whose gradient gets a NaN.
        nan_loss_at: steps whose loss is multiplied by NaN before backward.
        nan_input_at: steps whose first floating-point batch tensor gets a NaN.
        inject_inf_from: every step from this one on gets a ``+inf`` gradient: a persistent
            overflow, which a dynamic scaler answers by backing off down to ``min_scale``.
        param: name of the parameter to corrupt (default: the first with a gradient).
        rank: only inject on this global rank (default: every rank).

    ``injected`` lists ``(step, kind)`` for every fault written so far on this rank.
    """

    def __init__(
        self,
        inject_inf_at: Sequence[int] | None = None,
        inject_nan_at: Sequence[int] | None = None,
        nan_loss_at: Sequence[int] | None = None,
        nan_input_at: Sequence[int] | None = None,
        inject_inf_from: int | None = None,
        param: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.inject_inf_at = _steps("inject_inf_at", inject_inf_at)
        self.inject_nan_at = _steps("inject_nan_at", inject_nan_at)
        self.nan_loss_at = _steps("nan_loss_at", nan_loss_at)
        self.nan_input_at = _steps("nan_input_at", nan_input_at)
        for name, value in (("inject_inf_from", inject_inf_from), ("rank", rank)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r} is not allowed: {name} must be an integer >= 0 or None.")
        if param is not None and (not isinstance(param, str) or not param):
            raise ValueError(f"param={param!r} is not allowed: param must be a parameter name or None.")
        self.inject_inf_from = inject_inf_from
        self.param = param
        self.rank = rank
        self.injected: list[tuple[int, str]] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Fail before the first step, not at the faulty one.
        if self.rank is not None and self.rank >= trainer.world_size:
            raise ValueError(
                f"rank={self.rank} is not allowed: the run has {trainer.world_size} process(es), so rank must be "
                f"in [0, {trainer.world_size - 1}] or None."
            )
        if self.param is not None:
            self._target_name(pl_module)

    def _active(self, trainer: pl.Trainer, steps: frozenset[int]) -> bool:
        return trainer.global_step in steps and self._on_this_rank(trainer)

    def _on_this_rank(self, trainer: pl.Trainer) -> bool:
        return self.rank is None or trainer.global_rank == self.rank

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active(trainer, self.nan_input_at):
            return
        tensor = first_floating(batch)
        if tensor is None:
            raise ValueError(
                "nan_input_at needs a floating-point tensor in the batch; this recipe's batches hold "
                "only integer tensors (token ids?). Use nan_loss_at or inject_nan_at instead."
            )
        tensor.view(-1)[0] = math.nan
        self.injected.append((trainer.global_step, "nan_input"))

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._active(trainer, self.nan_loss_at):
            loss.mul_(math.nan)
            self.injected.append((trainer.global_step, "nan_loss"))

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        persistent = self.inject_inf_from is not None and trainer.global_step >= self.inject_inf_from
        inf = self._active(trainer, self.inject_inf_at) or (persistent and self._on_this_rank(trainer))
        nan = self._active(trainer, self.inject_nan_at)
        for active, value, kind in ((inf, math.inf, "inf_grad"), (nan, math.nan, "nan_grad")):
            if active:
                name, grad = self._target(pl_module)
                shard = local_grad(grad)  # under FSDP2, this rank's shard of the gradient
                if shard.numel():
                    shard.view(-1)[0] = value
                    self.injected.append((trainer.global_step, f"{kind}:{name}"))

    def _target(self, pl_module: pl.LightningModule) -> tuple[str, torch.Tensor]:
        for name, p in pl_module.named_parameters():
            if p.grad is not None and (self.param is None or name == self.param):
                return name, p.grad
        self._target_name(pl_module)  # names the problem if param is unknown
        what = f"param={self.param!r} has" if self.param is not None else "no parameter has"
        raise ValueError(f"{what} a gradient at this step: there is no gradient to corrupt.")

    def _target_name(self, pl_module: pl.LightningModule) -> None:
        names = [n for n, p in pl_module.named_parameters() if p.requires_grad]
        if self.param is not None and self.param not in names:
            raise ValueError(
                f"param={self.param!r} is not allowed: it must name a trainable parameter, one of {names[:10]}"
                + (" ..." if len(names) > 10 else "")
            )


def first_floating(batch: Any) -> torch.Tensor | None:
    """The batch's first floating-point tensor (depth first through dicts, lists and tuples), which
    ``nan_input_at`` writes a NaN into; ``None`` when there is none."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.is_floating_point() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = first_floating(item)
        if found is not None:
            return found
    return None
