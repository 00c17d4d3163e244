"""Which Lightning packages are installed, and one set of base classes that both accept.

Lightning ships under two names with the same code: ``lightning.pytorch`` (the unified
``lightning`` package) and ``pytorch_lightning`` (the standalone one). A ``Trainer`` of one
refuses plugins and callbacks that subclass the other's base classes. amp_plugin's Lightning
classes therefore derive from the base class of *every* installed namespace at once
(:data:`Precision`, :data:`Callback`, :data:`TorchCheckpointIO`): the two hierarchies share no
class but ``object``, so the combined class has a consistent method order and is an instance
of both. With one package installed, the bases are just that package's classes.

:data:`pl` is the namespace the app (``train.py``) and the recipes use: ``lightning.pytorch``
when it is installed, else ``pytorch_lightning``. ``AMP_PLUGIN_LIGHTNING=pytorch_lightning``
(or ``lightning``) in the environment picks one explicitly.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = [
    "ENV_CHOICE",
    "LIGHTNING_AUTOCAST_PLUGINS",
    "LIGHTNING_MODULES",
    "NAMESPACES",
    "TRAINERS",
    "Callback",
    "Precision",
    "TorchCheckpointIO",
    "namespace_of",
    "pl",
    "rank_zero_info",
    "rank_zero_warn",
    "trainer_calls",
]

ENV_CHOICE = "AMP_PLUGIN_LIGHTNING"
_PACKAGES = {
    "lightning": ("lightning.pytorch", "lightning.fabric"),
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
}


def _installed() -> dict[str, tuple[ModuleType, ModuleType]]:
    found = {}
    for name, (trainer_pkg, fabric_pkg) in _PACKAGES.items():
        try:
            found[name] = (importlib.import_module(trainer_pkg), importlib.import_module(fabric_pkg))
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "amp_plugin's Lightning layer needs Lightning: pip install 'amp_plugin[lightning]' (the unified "
            "'lightning' package) or 'amp_plugin[pytorch-lightning]' (the standalone 'pytorch_lightning')."
        )
    return found


class _RankZeroLog:
    """Lightning's shared rank-zero logger, routed to the namespace of the code that logs.

    ``lightning_utilities`` sends every ``rank_zero_info``/``rank_zero_warn`` message to one
    module-level logger, which each Lightning package re-points to its own logger when it is
    imported: with both loaded, the last one imported receives the other's messages too, and
    ``logging.getLogger("lightning.pytorch").setLevel(...)`` no longer reaches them. This
    stands in for that logger: a message logged from ``lightning.*`` code goes to the logger
    ``lightning.pytorch`` set, one from ``pytorch_lightning``/``lightning_fabric`` code to the
    logger ``pytorch_lightning`` set, anything else to the logger in place before amp_plugin
    loaded a second package.
    """

    def __init__(self, loggers: dict[str, logging.Logger], fallback: logging.Logger) -> None:
        self._loggers = loggers  # top-level package name -> logger
        self._fallback = fallback

    def _pick(self) -> logging.Logger:
        frame = sys._getframe(2)
        while frame is not None:
            top = str(frame.f_globals.get("__name__", "")).partition(".")[0]
            if top in self._loggers:
                return self._loggers[top]
            frame = frame.f_back  # type: ignore[assignment]
        return self._fallback

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pick(), name)


def _import_keeping_rank_zero_log() -> dict[str, tuple[ModuleType, ModuleType]]:
    """:func:`_installed`, leaving each package's rank-zero messages on its own logger."""
    try:
        import lightning_utilities.core.rank_zero as rank_zero_module
    except ImportError:  # a Lightning without lightning_utilities: nothing shared to keep apart
        return _installed()
    before = rank_zero_module.log
    found = _installed()
    if len(found) < 2 or isinstance(before, _RankZeroLog):
        return found
    loggers = {
        "lightning": logging.getLogger("lightning.pytorch.utilities.rank_zero"),
        "pytorch_lightning": logging.getLogger("pytorch_lightning.utilities.rank_zero"),
        "lightning_fabric": logging.getLogger("pytorch_lightning.utilities.rank_zero"),
    }
    fallback = before if before.name in {lg.name for lg in loggers.values()} else loggers[next(iter(found))]
    rank_zero_module.log = _RankZeroLog(loggers, fallback)  # type: ignore[assignment]
    return found


_FOUND = _import_keeping_rank_zero_log()


def _preferred() -> str:
    choice = os.environ.get(ENV_CHOICE)
    if choice is None:
        return next(iter(_FOUND))
    if choice not in _PACKAGES:
        raise ValueError(f"{ENV_CHOICE}={choice!r} is not allowed: it must be one of {', '.join(_PACKAGES)}.")
    if choice not in _FOUND:
        raise ImportError(f"{ENV_CHOICE}={choice!r}, but that package is not installed (pip install {choice}).")
    return choice


NAMESPACES: tuple[ModuleType, ...] = tuple(trainer_pkg for trainer_pkg, _ in _FOUND.values())
"""The installed Lightning trainer namespaces (``lightning.pytorch`` first when both are)."""

pl: ModuleType = _FOUND[_preferred()][0]
"""The namespace the app and the recipes use (see the module docstring)."""

# Typed as lightning.pytorch's classes, which stand for both namespaces' (as Precision and Callback below).
LIGHTNING_MODULES: tuple[type[LightningModule], ...] = tuple(ns.LightningModule for ns in NAMESPACES)
TRAINERS: tuple[type[Trainer], ...] = tuple(ns.Trainer for ns in NAMESPACES)


def _combined(path: str, fabric: bool = False) -> Any:
    """The class at ``path`` in every installed namespace, as one class deriving from all of them."""
    bases = []
    for trainer_pkg, fabric_pkg in _FOUND.values():
        obj: Any = fabric_pkg if fabric else trainer_pkg
        module_path, _, name = path.rpartition(".")
        obj = importlib.import_module(f"{obj.__name__}.{module_path}") if module_path else obj
        bases.append(getattr(obj, name))
    if len(bases) == 1:
        return bases[0]
    return type(bases[0].__name__, tuple(bases), {"__module__": __name__, "__doc__": bases[0].__doc__})


def namespace_of(obj: Any) -> str | None:
    """``"lightning"`` or ``"pytorch_lightning"``: the package whose class ``obj`` is an instance of."""
    for name, (trainer_pkg, _) in _FOUND.items():
        if isinstance(obj, (trainer_pkg.Trainer, trainer_pkg.LightningModule, trainer_pkg.Callback)):
            return name
    return None


def trainer_calls(obj: Any) -> ModuleType:
    """The ``trainer.call`` module (Lightning's hook dispatch) of ``obj``'s namespace."""
    name = namespace_of(obj) or next(iter(_FOUND))
    return importlib.import_module(f"{_FOUND[name][0].__name__}.trainer.call")


if TYPE_CHECKING:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import Precision
else:
    Precision = _combined("plugins.precision.Precision")
    Callback = _combined("callbacks.Callback")
    TorchCheckpointIO = _combined("plugins.io.torch_io.TorchCheckpointIO", fabric=True)

rank_zero_info = pl.utilities.rank_zero_info
rank_zero_warn = pl.utilities.rank_zero_warn
LIGHTNING_AUTOCAST_PLUGINS: tuple[type, ...] = tuple(ns.plugins.precision.MixedPrecision for ns in NAMESPACES)
"""Lightning's own ``16-mixed``/``bf16-mixed`` plugin class in every installed namespace."""
