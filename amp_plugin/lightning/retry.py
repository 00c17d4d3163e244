"""``DynamicLossScaler(retries=N)`` in Lightning's loops: an overflowing step runs its batch again.

Automatic optimization: :func:`retried_step` runs one whole optimizer step of the plugin
(closure, unscale, hooks, step or skip, scale update) per attempt of
:meth:`~amp_plugin.LossScaler.attempts`; Lightning's closure runs the same batch again. Gradient
accumulation is refused: Lightning ran the window's earlier micro-batches before the step, so
only the last one could run again.

Manual optimization: :func:`manual_attempts` drives ``plugin.attempts()``; a retried attempt's
``opt.step()`` calls are taken back from Lightning's step count.

In both, the LightningModule's buffers (BatchNorm's running statistics and counter, anything a
forward updates) are put back before a retry, with the random streams: the retried batch runs
from where the first attempt started (:class:`~amp_plugin.scaling.buffer_state.BufferState`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from torch.nn import Module

from amp_plugin.scaling import LossScaler

__all__ = ["manual_attempts", "retried_step", "retries_on"]


def retries_on(scaler: LossScaler, model: Any) -> bool:
    """Whether the automatic optimization step of ``model`` retries overflowing batches."""
    return bool(scaler.retries and scaler.is_enabled() and model.automatic_optimization)


def retried_step(scaler: LossScaler, model: Any, step_once: Callable[[], Any]) -> Any:
    """Run ``step_once`` (one optimizer step) until it did not overflow or the retries ran out.

    Returns what the last attempt returned.

    Raises:
        ValueError: ``accumulate_grad_batches`` is not 1.
    """
    accumulate = getattr(model.trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ValueError(
            f"DynamicLossScaler(retries={scaler.retries}) cannot retry with accumulate_grad_batches="
            f"{accumulate}: Lightning ran the window's earlier micro-batches before this step, so only the "
            "last one could run again, and the window's gradients would mix two scales. Use retries=0 with "
            "gradient accumulation, or accumulate in manual optimization inside plugin.attempts()."
        )
    result = None
    for _ in scaler.attempts(model):
        result = step_once()
    return result


def manual_attempts(
    scaler: LossScaler, trainer: Any, end_iteration: Callable[[], None], modules: tuple[Module, ...] = ()
) -> Generator[int, None, None]:
    """The attempts of a manual optimization step (see ``MixedPrecisionPlugin.attempts``).

    ``end_iteration`` runs after each attempt (the scale update, so the next attempt knows
    whether to run); a retried attempt's optimizer steps are taken back from
    ``trainer``'s step count, and the buffers of ``modules`` are put back.
    """
    loop = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "manual_optimization", None)
    progress = getattr(loop, "optim_step_progress", None)
    for attempt in scaler.attempts(*modules):
        counted = progress.state_dict() if progress is not None else None
        yield attempt
        end_iteration()
        if scaler.retrying and progress is not None:
            progress.load_state_dict(counted)  # the attempt's steps are taken again
