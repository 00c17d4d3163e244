"""Step-interval LR schedulers stand still on skipped optimizer steps.

Lightning steps "step"-interval schedulers after every optimizer step, skipped or not, so a
run with overflows ends with a schedule ahead of its weights (Lightning #5558, #16228). While
a fit runs, :class:`LRHold` gives each such scheduler a subclass of its own class whose
``step()`` does nothing when the scaler skipped the last step, and gives the original class
back at teardown. Nothing is stored on the user's module or in the scheduler's
``__dict__`` (so ``state_dict()``, ``torch.save(model)`` and ``copy.deepcopy`` see no trace),
and a user's own ``lr_scheduler_step`` that calls ``scheduler.step()`` is held the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["LRHold"]


class LRHold:
    """Hold step-interval schedulers while ``skipped()`` says the last optimizer step was skipped.

    Args:
        skipped: returns True when the scheduler must not step now (read at each ``step()``).
    """

    def __init__(self, skipped: Callable[[], bool]) -> None:
        self.skipped = skipped
        self._held: list[tuple[Any, type]] = []

    def attach(self, scheduler_configs: Iterable[Any]) -> None:
        """Hold the schedulers of Lightning's ``LRSchedulerConfig`` entries with ``interval="step"``."""
        self.detach()
        for config in scheduler_configs:
            scheduler = getattr(config, "scheduler", None)
            if getattr(config, "interval", None) != "step" or scheduler is None or _is_held(scheduler):
                continue
            original = type(scheduler)
            scheduler.__class__ = self._held_class(original)
            self._held.append((scheduler, original))

    def detach(self) -> None:
        """Give every held scheduler its own class back."""
        for scheduler, original in self._held:
            scheduler.__class__ = original
        self._held = []

    def _held_class(self, cls: type) -> type:
        hold = self
        held: type[Any]  # the class made below, after step() that refers to it

        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            if hold.skipped():
                return None  # the optimizer did not step: neither does its schedule
            # mypy resolves super() here in LRHold (the enclosing class), not in the class made below
            return super(held, scheduler).step(*args, **kwargs)  # type: ignore[misc]

        held = type(cls.__name__, (cls,), {"step": step, "__module__": cls.__module__, "_amp_plugin_held": True})
        held.__qualname__ = cls.__qualname__
        return held


def _is_held(scheduler: Any) -> bool:
    return bool(type(scheduler).__dict__.get("_amp_plugin_held"))
