"""Lightning's ``BaseFinetuning``/``BackboneFinetuning`` callbacks over master-weight optimizers.

Those callbacks name each optimizer's parameters by looking them up in
``pl_module.named_parameters()``, and on resume assign the saved groups back with
``optimizer.param_groups = ...``. A :class:`~amp_plugin.MasterWeightOptimizer`'s groups hold
the FP32 masters, which are not the module's parameters, so the lookup raises
``KeyError: MasterParameter`` and the assignment would put model parameters where the masters
belong. While a fit runs, :class:`FinetuningAdapter` gives each such callback a subclass of
its own class that names a master by its model parameter and restores saved groups through
``add_param_group`` (which builds their masters), and gives the class back at teardown.
Freezing and unfreezing act on the module's parameters, which the masters follow.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_warn

from amp_plugin.lightning.namespace import NAMESPACES
from amp_plugin.master_weights import MasterParameter, MasterWeightOptimizer

__all__ = ["FinetuningAdapter"]

_BASES: tuple[type, ...] = tuple(ns.callbacks.BaseFinetuning for ns in NAMESPACES)


class _ByModelParam(dict):
    """Lightning's ``{parameter: name}`` mapping that also names a master by its model parameter."""

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, MasterParameter):
            model = key.model_param()
            if model is not None and model in self:
                return self[model]
        raise KeyError(key)


def _named(param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
    """Lightning's ``_apply_mapping_to_param_groups``, with masters named by their model parameter."""
    mapping = _ByModelParam(mapping)
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [mapping[p] for p in g["params"]]}
        for g in param_groups
    ]


def _restore_groups(optimizer: MasterWeightOptimizer, saved: list[dict[str, Any]], named: dict[str, Any]) -> None:
    """Bring ``optimizer`` to the saved groups: settings of the groups it has, the others added."""
    current = optimizer.param_groups
    for group, state in zip(current, saved):
        group.update({k: v for k, v in state.items() if k != "params"})
    for state in saved[len(current) :]:
        optimizer.add_param_group({**state, "params": [named[n] for n in state["params"]]})


def _adapted_class(cls: Any) -> type:
    adapted: type[Any]  # the class made below, after the methods that refer to it

    def _apply_mapping_to_param_groups(param_groups: list[dict[str, Any]], mapping: dict) -> list[dict[str, Any]]:
        return _named(param_groups, mapping)

    def on_fit_start(self: Any, trainer: Any, pl_module: Any) -> None:
        if self._restarting and self._internal_optimizer_metadata:
            named = dict(pl_module.named_parameters())
            for index, optimizer in enumerate(trainer.optimizers):
                saved = self._internal_optimizer_metadata.get(index)
                if saved is not None and isinstance(optimizer, MasterWeightOptimizer):
                    _restore_groups(optimizer, saved, named)
                elif saved is not None:
                    optimizer.param_groups = _named(saved, named)
            self._restarting = False
        super(adapted, self).on_fit_start(trainer, pl_module)  # nothing left to restore there

    def filter_on_optimizer(optimizer: Any, params: Iterable) -> list:
        # Lightning compares values (torch.equal) to tell a parameter the optimizer already holds; its
        # groups hold masters (NaN placeholders for the kinds without an FP32 tensor): compare identities
        if not isinstance(optimizer, MasterWeightOptimizer):
            return cls.filter_on_optimizer(optimizer, params)
        held = {id(p) for p in optimizer.model_params()}
        params = list(params)
        if any(id(p) in held for p in params):
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this optimizer."
                " Those parameters will be skipped.\n"
                "HINT: Did you init your optimizer in `configure_optimizer` as such:\n"
                f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
            )
        return [p for p in params if id(p) not in held]

    def unfreeze_and_add_param_group(
        modules: Any, optimizer: Any, lr: float | None = None, initial_denom_lr: float = 10.0, train_bn: bool = True
    ) -> None:
        # Lightning's, with the parameters the optimizer already holds found by identity (it calls
        # BaseFinetuning.filter_on_optimizer by name, so overriding that alone would not reach it)
        if not isinstance(optimizer, MasterWeightOptimizer):
            return cls.unfreeze_and_add_param_group(modules, optimizer, lr, initial_denom_lr, train_bn)
        cls.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = filter_on_optimizer(optimizer, cls.filter_params(modules, train_bn=train_bn, requires_grad=True))
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})
        return None

    adapted = type(
        cls.__name__,
        (cls,),
        {
            "_apply_mapping_to_param_groups": staticmethod(_apply_mapping_to_param_groups),
            "filter_on_optimizer": staticmethod(filter_on_optimizer),
            "unfreeze_and_add_param_group": staticmethod(unfreeze_and_add_param_group),
            "on_fit_start": on_fit_start,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_amp_plugin_adapted": True,
        },
    )
    return adapted


class FinetuningAdapter:
    """Adapt the trainer's finetuning callbacks to master-weight optimizers for one fit."""

    def __init__(self) -> None:
        self._adapted: list[tuple[Any, type]] = []

    def attach(self, callbacks: Iterable[Any]) -> None:
        """Give every ``BaseFinetuning`` in ``callbacks`` the adapted subclass of its class."""
        self.detach()
        for callback in callbacks:
            if isinstance(callback, _BASES) and not type(callback).__dict__.get("_amp_plugin_adapted"):
                original = type(callback)
                callback.__class__ = _adapted_class(original)
                self._adapted.append((callback, original))

    def detach(self) -> None:
        """Give every adapted callback its own class back."""
        for callback, original in self._adapted:
            callback.__class__ = original
        self._adapted = []

    def __getstate__(self) -> dict[str, Any]:
        return {"_adapted": []}  # the adapted classes belong to the process that runs the fit
