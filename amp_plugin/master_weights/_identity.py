"""The class of a :class:`~amp_plugin.MasterWeightOptimizer`: derived from the wrapped optimizer's too.

``isinstance(wrapper, torch.optim.SGD)`` holds for a wrapper over an SGD, as it does for Lightning's
``LightningOptimizer``, so callbacks that check for the user's class (``BaseFinetuning``, scheduler
factories, a user's ``isinstance``) find it. The wrapper's own methods come first in the MRO. The
class is built at run time (one per wrapped class), under the wrapper's name, so pickling goes
through :func:`restore`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from amp_plugin.master_weights._optimizer import MasterWeightOptimizer

__all__ = ["derived", "restore"]

_DERIVED: dict[tuple[type, type], type] = {}


def derived(base: type, inner: type) -> type:
    """``base`` (``MasterWeightOptimizer``, or a subclass) also deriving from the wrapped optimizer's
    class, under ``base``'s name: ``base``'s methods win, ``isinstance(wrapper, inner)`` holds."""
    base = getattr(base, "_amp_base", base)
    if issubclass(base, inner):
        return base
    cls = _DERIVED.get((base, inner))
    if cls is None:
        namespace = {"__module__": base.__module__, "__qualname__": base.__qualname__, "_amp_base": base}
        cls = _DERIVED[(base, inner)] = type(base.__name__, (base, inner), namespace)
    return cls


def restore(base: type, inner: type, state: dict[str, Any]) -> MasterWeightOptimizer:
    """A wrapper from :meth:`~amp_plugin.MasterWeightOptimizer.__reduce__`'s state: its masters made
    masters of its model parameters again (:func:`~amp_plugin.master_weights._adopt.readopt`)."""
    from amp_plugin.master_weights._adopt import readopt

    obj: MasterWeightOptimizer = object.__new__(derived(base, inner))
    obj.__dict__.update(state)
    readopt(obj)
    return obj
