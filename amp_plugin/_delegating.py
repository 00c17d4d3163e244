"""What an optimizer wrapper shares with the optimizer it wraps: the wrapped one's ``param_groups``
and ``state`` objects themselves, so LR schedulers, Lightning and ``torch.distributed.checkpoint``
read and write one set of groups and one state dict whichever object they hold.

:class:`DelegatingOptimizer` is the mixin; a wrapper puts it before ``torch.optim.Optimizer`` in
its bases and sets ``self.optimizer``. ``load_state_dict`` on the wrapped optimizer replaces its
``state`` dict, which the property then follows.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

__all__ = ["DelegatingOptimizer"]


class DelegatingOptimizer:
    """``param_groups``, ``state`` and ``repr`` of ``self.optimizer`` (the wrapped optimizer)."""

    optimizer: Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # the wrapped optimizer's (its load_state_dict replaces the dict)
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
