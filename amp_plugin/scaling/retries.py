"""Running an overflowing batch again at a lower scale: a loss scaler's retry machinery.

:class:`Retries` is the part of :class:`~amp_plugin.LossScaler` that runs one batch (or one
accumulation window) until it steps or its retries are spent (:meth:`Retries.attempts`), and
counts what that costs (``passes``, ``wasted_passes``, ``wasted_fraction``). The policy (how
far to back off for a retry, and when not to retry) is the subclass's ``_retry_scale``; the
number of retries is its ``retries`` setting (``DynamicLossScaler(retries=N)``). Before a retry
the random streams (:class:`~amp_plugin.rng_state.RngState`) and the buffers of the modules
passed to :meth:`Retries.attempts` (:class:`~amp_plugin.scaling.buffer_state.BufferState`) are
put back where they were before the first attempt.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from amp_plugin.rng_state import RngState
from amp_plugin.scaling.buffer_state import BufferState, check_modules
from amp_plugin.scaling.scale_update import ScaleUpdate
from amp_plugin.scaling.stages import OptimizerStage, Stage

__all__ = ["Retries"]


class Retries:
    """Retries and their counters, mixed into :class:`~amp_plugin.LossScaler`.

    Attributes:
        retries: how often an overflowing batch may run again (``DynamicLossScaler``'s
            setting; 0 here).
        retried_steps: attempts run again at a lower scale.
    """

    retries: int = 0
    retried_steps: int
    skipped_steps: int
    update_count: int
    last_step_skipped: bool
    last_update: ScaleUpdate | None
    _enabled: bool
    _new_iteration: bool
    _per_optimizer: dict[int, OptimizerStage]

    def __init__(self) -> None:
        self.retried_steps = 0
        self._retry_updates: list[ScaleUpdate] = []  # this iteration's retries so far
        self._attempt: int | None = None  # inside attempts(): the attempt running (0 = first)
        self._retrying = False

    @property
    def retrying(self) -> bool:
        """True after an ``update()`` that backed the scale off to run the same batch again
        (inside :meth:`attempts`, until the next attempt starts)."""
        return self._retrying

    @property
    def passes(self) -> int:
        """Forward and backward passes that ended in an update: iterations plus retries."""
        return self.update_count + self.retried_steps

    @property
    def wasted_passes(self) -> int:
        """Passes that updated nothing: every retried attempt and every skipped iteration."""
        return self.retried_steps + self.skipped_steps

    @property
    def wasted_fraction(self) -> float:
        """``wasted_passes / passes`` (0.0 before the first update)."""
        return self.wasted_passes / self.passes if self.passes else 0.0

    def attempts(self, *modules: nn.Module) -> Iterator[int]:
        """Run one batch (or one accumulation window) until it steps or its retries are spent.

        Yields the attempt number (0 first). Put the batch's whole step inside, and pass the
        model (every module whose forward the body runs)::

            for _ in scaler.attempts(model):
                optimizer.zero_grad()
                scaler.scale(loss_fn(model(x), y)).backward()
                scaler.step(optimizer)
                scaler.update()

        With ``retries=0`` (or a disabled scaler) the body runs once and nothing is saved.
        Otherwise, when the step overflowed, ``update()`` backs the scale off instead of ending
        the iteration, and the body runs again, up to ``retries`` times; the last overflow is a
        skip as without retries. Before each retry the random streams
        (:class:`~amp_plugin.rng_state.RngState`) and every buffer of ``modules`` (BatchNorm's
        running statistics and batch counter, anything a forward updates;
        :class:`~amp_plugin.scaling.buffer_state.BufferState`) are put back where they were
        before the first attempt. Only an ``update()`` inside this loop can retry.

        Raises:
            TypeError: an argument is not a ``torch.nn.Module``.
        """
        checked = check_modules(modules, "attempts()")
        return self._run_attempts(checked)

    def _run_attempts(self, modules: tuple[nn.Module, ...]) -> Iterator[int]:
        saving = self._enabled and self.retries > 0  # a retry can happen: save what it puts back
        rng = RngState() if saving else None
        buffers = BufferState(modules) if saving and modules else None
        self._attempt, self._retrying, self._retry_updates = 0, False, []
        try:
            while True:
                yield self._attempt
                if not self._retrying:
                    return
                self._retrying = False
                if rng is not None:
                    rng.restore()
                if buffers is not None:
                    buffers.restore()
        finally:
            self._attempt, self._retrying = None, False

    def _retry_scale(self) -> float | None:
        """The scale to run an overflowing batch again with, or ``None`` for no retry."""
        return None

    def _may_retry(self) -> bool:
        """Inside :meth:`attempts`, with retries left, and no optimizer of the iteration stepped."""
        if self._attempt is None or self._attempt >= self.retries:
            return False
        states = [s for s in self._per_optimizer.values() if s.stage is not Stage.READY]
        return all(self._found_inf_host(s) for s in states)

    def _begin_retry(self, old: float, new: float) -> None:
        """``update()`` for an attempt that runs again at ``new``: the iteration goes on."""
        self._per_optimizer.clear()
        self._new_iteration = True
        self.last_step_skipped = True
        self.retried_steps += 1
        self._attempt = (self._attempt or 0) + 1
        self._retrying = True
        self.last_update = ScaleUpdate(self.update_count, old, new, True, "retry")
        self._retry_updates.append(self.last_update)
        self._set_scale(new)

    def _take_retry_updates(self) -> tuple[ScaleUpdate, ...]:
        """The iteration's retries, for ``iteration_updates``; the iteration is over."""
        updates, self._retry_updates, self._retrying = tuple(self._retry_updates), [], False
        return updates

    # Provided by LossScaler.
    def _found_inf_host(self, state: OptimizerStage) -> bool:
        raise NotImplementedError

    def _set_scale(self, value: float) -> None:
        raise NotImplementedError
