"""LR schedulers stand still on the skipped steps of their own optimizer.

Lightning steps "step"-interval schedulers after every optimizer step, skipped or not, so a
run with overflows ends with a schedule ahead of its weights (Lightning #5558, #16228). While
a fit runs, :class:`LRHold` gives each scheduler it holds a subclass of its own class whose
``step()`` does nothing when the schedule's optimizer skipped, and gives the original class
back at teardown. Nothing is stored on the user's module or in the scheduler's ``__dict__``
(so ``state_dict()``, ``torch.save(model)`` and ``copy.deepcopy`` see no trace), and a user's
own ``lr_scheduler_step`` that calls ``scheduler.step()`` is held the same way.

Which schedules, and when:

- Automatic optimization: the "step"-interval ones. A skipped step holds them; a schedule with
  ``frequency=N`` steps when Lightning would step it (``(batch_idx + 1) % N == 0``) counting only
  the batches whose optimizer step was taken, so it steps once every N steps taken (Lightning
  counts every batch, so a skip would cost a whole schedule step on an N boundary and hold
  nothing off it). While held, Lightning's own frequency check is set to 1 (given back at
  teardown) so the hold sees every step.
- Manual optimization: every scheduler (Lightning gives them ``interval="epoch"`` although the
  user steps them). A ``scheduler.step()`` is held when its optimizer has skipped a step since
  the schedule last advanced and taken none: the schedule of the optimizer that skipped, and
  only that one. An epoch-wise schedule stepped at the end of an epoch in which its optimizer
  took at least one step advances.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from amp_plugin.master_weights import MasterWeightOptimizer

__all__ = ["LRHold"]


class LRHold:
    """Hold LR schedulers on their optimizer's skipped steps (see the module docstring).

    The plugin calls :meth:`attach` when a fit connects, :meth:`note_step` after every optimizer
    step (taken or skipped) and :meth:`detach` at teardown.
    """

    def __init__(self) -> None:
        self._held: list[tuple[Any, type, Any, int]] = []  # scheduler, its class, its config, config's frequency
        self._frequency: dict[int, int] = {}  # id(scheduler) -> the frequency the hold applies
        self._owner: dict[int, int] = {}  # id(scheduler) -> key of its optimizer
        self._taken: dict[int, int] = {}  # optimizer key -> steps taken in this fit
        self._skipped: dict[int, int] = {}  # optimizer key -> steps skipped in this fit
        self._seen: dict[int, tuple[int, int]] = {}  # id(scheduler) -> (taken, skipped) when it last advanced
        self._batch: tuple[int, int, int] = (-1, 0, 0)  # epoch, batch_idx + 1 of the last step, batches skipped

    def attach(self, scheduler_configs: Iterable[Any], manual: bool = False) -> None:
        """Hold the schedulers of Lightning's ``LRSchedulerConfig`` entries.

        Args:
            scheduler_configs: the trainer's scheduler configs.
            manual: manual optimization: hold every scheduler, not only the "step"-interval ones.
        """
        self._release()
        for config in scheduler_configs:
            scheduler = getattr(config, "scheduler", None)
            if scheduler is None or _is_held(scheduler) or not (manual or getattr(config, "interval", None) == "step"):
                continue
            original = type(scheduler)
            scheduler.__class__ = self._held_class(original)
            frequency = int(getattr(config, "frequency", 1) or 1)
            self._held.append((scheduler, original, config, frequency))
            self._owner[id(scheduler)] = _key(getattr(scheduler, "optimizer", None))
            self._seen[id(scheduler)] = (0, 0)
            if not manual and frequency > 1:
                self._frequency[id(scheduler)] = frequency
                config.frequency = 1  # the hold counts the steps taken (given back in detach)

    def detach(self) -> None:
        """Give every held scheduler its own class (and its config its frequency) back; forget the fit."""
        self._release()
        self._batch = (-1, 0, 0)

    def _release(self) -> None:
        for scheduler, original, config, frequency in self._held:
            scheduler.__class__ = original
            if id(scheduler) in self._frequency:
                config.frequency = frequency
        self._held, self._frequency, self._owner, self._seen = [], {}, {}, {}
        self._taken, self._skipped = {}, {}

    def note_step(self, optimizer: Any, skipped: bool, epoch: int | None = None, batch_end: int | None = None) -> None:
        """Record one optimizer step.

        Args:
            optimizer: the optimizer stepped (wrapped or not).
            skipped: whether its step was skipped.
            epoch: automatic optimization: ``trainer.current_epoch``.
            batch_end: automatic optimization: ``batch_idx + 1`` of the batch that stepped.
        """
        key = _key(optimizer)
        counts = self._skipped if skipped else self._taken
        counts[key] = counts.get(key, 0) + 1
        if epoch is None or batch_end is None:
            return
        last_epoch, last_end, skipped_batches = self._batch
        if epoch != last_epoch:
            last_end, skipped_batches = 0, 0
        if skipped:  # the batches of this step's accumulation window do not count towards a frequency
            skipped_batches += batch_end - last_end
        self._batch = (epoch, batch_end, skipped_batches)

    @property
    def counts_frequencies(self) -> bool:
        """Whether a held schedule has a frequency above 1 (then :meth:`state_dict` matters on resume)."""
        return bool(self._frequency)

    def state_dict(self) -> dict[str, int]:
        """What a resume needs to keep counting frequencies where they were."""
        epoch, last_end, skipped_batches = self._batch
        return {"epoch": epoch, "batch_end": last_end, "skipped_batches": skipped_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self._batch = (int(state["epoch"]), int(state["batch_end"]), int(state["skipped_batches"]))

    def holds(self, scheduler: Any) -> bool:
        """Whether ``scheduler.step()`` must do nothing now."""
        key = self._owner.get(id(scheduler))
        taken, skipped = self._taken.get(key, 0), self._skipped.get(key, 0)  # type: ignore[arg-type]
        seen_taken, seen_skipped = self._seen.get(id(scheduler), (taken, skipped))
        if skipped > seen_skipped and taken == seen_taken:
            return True  # its optimizer skipped since the schedule last advanced, and took no step
        frequency = self._frequency.get(id(scheduler), 1)
        if frequency > 1:
            _, last_end, skipped_batches = self._batch
            if (last_end - skipped_batches) % frequency != 0:
                return True  # not a frequency boundary, counting the batches whose step was taken
        self._seen[id(scheduler)] = (taken, skipped)
        return False

    def _held_class(self, cls: type) -> type:
        hold = self
        held: type[Any]  # the class made below, after step() that refers to it

        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            if hold.holds(scheduler):
                return None  # the optimizer did not step: neither does its schedule
            # mypy resolves super() here in LRHold (the enclosing class), not in the class made below
            return super(held, scheduler).step(*args, **kwargs)  # type: ignore[misc]

        held = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__, "_amp_plugin_held": True})
        held.__qualname__ = cls.__qualname__
        return held

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with the plugin (ddp_spawn) before a fit, when nothing is held; the held
        # schedulers and their generated classes belong to the process that runs the fit.
        state = dict(self.__dict__)
        state["_held"], state["_frequency"], state["_owner"], state["_seen"] = [], {}, {}, {}
        return state


def _key(optimizer: Any) -> int:
    """One key for an optimizer however it is wrapped (``LightningOptimizer``, master weights)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    if isinstance(optimizer, MasterWeightOptimizer):
        optimizer = optimizer.optimizer
    return id(optimizer)


def _is_held(scheduler: Any) -> bool:
    return bool(type(scheduler).__dict__.get("_amp_plugin_held"))
